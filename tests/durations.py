"""Writes tests/durations.json, each test file's slowest test in seconds, from a pytest ``--junitxml`` report or
from the folder tests/cpu_profile.py wrote:

    pytest tests -n auto --junitxml=/tmp/junit.xml && python -m tests.durations /tmp/junit.xml
    FEDGUIDE_CPU_PROFILE=/tmp/prof pytest tests -n auto -p tests.cpu_profile && python -m tests.durations /tmp/prof

conftest.py starts the slowest files first. Only the order depends on it: a stale or missing file costs wall
time, never a result."""
from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

OUT = Path(__file__).with_name("durations.json")


def slowest_per_file(junit: Path) -> dict[str, float]:
    slowest: dict[str, float] = {}
    for case in ET.parse(junit).iter("testcase"):
        # classname is the dotted module path (tests.e2e.test_cli), a test class's name appended (TestX)
        parts = case.get("classname", "").split(".")
        while parts and not parts[-1].startswith("test_"):
            parts.pop()
        if not parts:
            continue
        path = "/".join(parts) + ".py"
        slowest[path] = max(slowest.get(path, 0.0), round(float(case.get("time", 0.0)), 1))
    return dict(sorted(slowest.items(), key=lambda kv: -kv[1]))


def slowest_per_file_profiled(folder: Path) -> dict[str, float]:
    """The same from tests/cpu_profile.py's rows (node id, wall s, worker CPU s, children CPU s)."""
    slowest: dict[str, float] = {}
    for worker in sorted(folder.glob("*.json")):
        for nodeid, wall, *_ in json.loads(worker.read_text()):
            path = nodeid.split("::")[0]
            slowest[path] = max(slowest.get(path, 0.0), round(float(wall), 1))
    return dict(sorted(slowest.items(), key=lambda kv: -kv[1]))


if __name__ == "__main__":
    source = Path(sys.argv[1])
    table = slowest_per_file_profiled(source) if source.is_dir() else slowest_per_file(source)
    OUT.write_text(json.dumps(table, indent=1) + "\n")
