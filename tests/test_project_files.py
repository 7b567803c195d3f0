"""The files people look for at a repository's root: the LICENSE is the licence pyproject.toml declares, and
CITATION.cff is valid YAML naming the same version and licence, with a reference for each of the five papers."""
from __future__ import annotations

from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10: pytest's own dependency
    import tomli as tomllib

import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_license_file_is_the_licence_pyproject_declares():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"]["text"]
    assert declared == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text  # the whole licence, not a pointer to it


def test_citation_names_the_package_version_licence_and_the_five_papers():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert cff["cff-version"] == "1.2.0" and cff["type"] == "software"
    assert cff["version"] == project["version"] and cff["license"] == project["license"]["text"]
    titles = " | ".join(ref["title"] for ref in cff["references"])
    for paper in ("FedDifRC", "Semantic Consistency", "Classifier-Guided Diffusion", "One-shot Semi-supervised",
                  "FedDW"):
        assert paper in titles, paper
    assert all(ref["authors"] and ref["url"].startswith("https://") for ref in cff["references"])
