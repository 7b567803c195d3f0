"""The code names only files the repository holds: every repository path written in the source, the tests,
the benchmarks and the configs exists, and nothing points at documents kept outside it."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# A path from the repository's root, as code and docstrings write one: configs/x.yaml, benchmarks/y.py, ...
ROOTED = re.compile(r"(?<![\w./-])((?:configs|benchmarks|scripts|docs|tests|src)/[\w./-]*\w\.(?:py|yaml|yml|md|json|txt|sh|toml))")
# Documents a reader of the repository does not have.
OUTSIDE = re.compile(r"(?<![\w.-])(?:papers/[\w-]+\.md|SPEC\b|ARCHITECTURE\.md|\.\./shared/)")


def texts():
    for folder in ("src", "tests", "benchmarks", "configs", "scripts"):
        for path in sorted((REPO / folder).rglob("*")):
            if path.suffix in (".py", ".yaml", ".yml", ".sh") and "results" not in path.parts:
                yield path, path.read_text(encoding="utf-8", errors="replace")


def test_every_repository_path_the_code_names_exists():
    missing = sorted({f"{path.relative_to(REPO)}: {m}" for path, text in texts() for m in ROOTED.findall(text)
                      if not (REPO / m).exists() and "*" not in m and path.name != "test_references.py"})
    assert missing == []


def test_no_reference_to_documents_outside_the_repository():
    found = sorted({f"{path.relative_to(REPO)}: {m.group(0)}" for path, text in texts() for m in OUTSIDE.finditer(text)
                    if path.name != "test_references.py"})
    assert found == []
