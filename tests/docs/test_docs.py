"""The documentation: the site builds with ``mkdocs build --strict`` (no warning: every internal link and
anchor resolves), the nav's links into the sections of a page point at headings that exist, and every
runnable example runs; the repository paths the pages name exist.

A runnable example is a fenced block whose info string is ``{ .python .runnable title="NAME.py" }``
(pymdownx.superfences renders it as a Python block headed by its file name). Each runs as a script in a
fresh interpreter, in an empty folder, offline, so what it registers never reaches the other tests.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
RUNNABLE = re.compile(r'^```[ \t]*\{[ \t]*\.python[ \t]+\.runnable[ \t]+title="([^"]+)"[ \t]*\}[ \t]*\n(.*?)^```[ \t]*$',
                      re.M | re.S)
# The extending guide's four examples must stay runnable.
REQUIRED = {"add_a_method.py", "add_a_dataset.py", "add_a_runtime.py", "add_a_figure.py"}
EXAMPLE_SECONDS = 120  # each takes seconds on an idle CPU; the limit only catches a hang


def runnable_blocks() -> dict[str, tuple[Path, str]]:
    """title -> (page, code) of every runnable block in docs/."""
    found: dict[str, tuple[Path, str]] = {}
    for page in sorted(DOCS.rglob("*.md")):
        for title, code in RUNNABLE.findall(page.read_text(encoding="utf-8")):
            assert title not in found, f"two runnable examples are titled {title} ({found[title][0].name}, {page.name})"
            found[title] = (page, code)
    return found


def quiet_env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", FEDGUIDE_OFFLINE="1", NO_MKDOCS_2_WARNING="1")
    env.pop("PYTHONPATH", None)  # the examples see the installed fedguide only, as a reader's script would
    return env


def nav_links(items) -> list[str]:
    out: list[str] = []
    for item in items:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        out += nav_links(value) if isinstance(value, list) else [value]
    return out


def test_runnable_examples_are_marked():
    blocks = runnable_blocks()
    assert REQUIRED <= set(blocks), f"missing runnable examples: {sorted(REQUIRED - set(blocks))}"
    for title, (page, _) in blocks.items():
        assert title.endswith(".py"), f"{page.name}: a runnable example's title is its file name, got {title}"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    pytest.importorskip("mkdocs", reason="mkdocs is part of the dev install (pip install -e '.[dev]')")
    pytest.importorskip("material", reason="mkdocs-material is part of the dev install")
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                          cwd=ROOT, env=quiet_env(), capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{log}"
    warnings = [line for line in log.splitlines() if "WARNING" in line]
    assert not warnings, "\n".join(warnings)
    return out


def test_site_builds_strict(site):
    assert (site / "index.html").is_file()
    assert (site / "extending" / "index.html").is_file()


def test_nav_links_into_pages_name_existing_headings(site):
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    sections = [link for link in nav_links(nav) if "#" in link]
    assert sections, "the nav lists the extending guide's sections"
    for link in sections:
        page, anchor = link.split("#", 1)
        html = site / page.strip("/") / "index.html"
        assert html.is_file(), f"nav link {link}: no page {page}"
        assert f'id="{anchor}"' in html.read_text(encoding="utf-8"), f"nav link {link}: no heading #{anchor}"


# Paths into the repository are written as code spans (`src/fedguide/...`): links out of docs/ would not
# survive the site build. They are checked here instead, except templates (`<family>`) and the files the
# extending guide's examples would become (`*_example.py`).
REPO_PATH = re.compile(r"`((?:src|tests|benchmarks|configs|examples|scripts)/[^`\s:]*)")


def test_paths_the_docs_name_exist():
    pages = [*sorted(DOCS.rglob("*.md")), ROOT / "README.md",
             ROOT / "src" / "fedguide" / "guidance" / "embedded" / "weights" / "MODEL_CARD.md"]
    missing = sorted({f"{page.relative_to(ROOT)}: {path}" for page in pages
                      for path in REPO_PATH.findall(page.read_text(encoding="utf-8"))
                      if "<" not in path and not path.endswith("_example.py") and not (ROOT / path).exists()})
    assert not missing, "paths named in the documentation that do not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize("title", sorted(runnable_blocks()))
def test_runnable_example(title, tmp_path):
    page, code = runnable_blocks()[title]
    script = tmp_path / title
    script.write_text(code, encoding="utf-8")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=quiet_env(), capture_output=True,
                          text=True, timeout=EXAMPLE_SECONDS)
    assert proc.returncode == 0, (f"{page.relative_to(ROOT)}: example {title} failed after "
                                  f"{time.perf_counter() - start:.1f} s:\n{proc.stdout}\n{proc.stderr}")


def test_the_gpu_pages_settings_block_states_the_defaults():
    """docs/gpu.md opens with the device settings as a config block: each value there is the default a config
    that leaves it out gets."""
    from fedguide.config import build_config

    text = (DOCS / "gpu.md").read_text()
    block = yaml.safe_load(text.split("```yaml\n", 1)[1].split("```", 1)[0])
    defaults = build_config({}).model_dump(mode="json")
    stated = [(section, key, value) for section, keys in block.items() for key, value in keys.items()]
    assert len(stated) >= 7
    for section, key, value in stated:
        assert defaults[section][key] == value, (f"{section}.{key}", value, defaults[section][key])
