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
from typing import Iterable, Iterator

OUT = Path(__file__).with_name("durations.json")


def slowest(timings: Iterable[tuple[str, float]]) -> dict[str, float]:
    """Each file's slowest test, slowest file first, from (test file, seconds) pairs."""
    table: dict[str, float] = {}
    for path, seconds in timings:
        table[path] = max(table.get(path, 0.0), round(float(seconds), 1))
    return dict(sorted(table.items(), key=lambda kv: -kv[1]))


def junit_timings(junit: Path) -> Iterator[tuple[str, float]]:
    for case in ET.parse(junit).iter("testcase"):
        # classname is the dotted module path (tests.e2e.test_cli), a test class's name appended (TestX)
        parts = case.get("classname", "").split(".")
        while parts and not parts[-1].startswith("test_"):
            parts.pop()
        if parts:
            yield "/".join(parts) + ".py", float(case.get("time", 0.0))


def profile_timings(folder: Path) -> Iterator[tuple[str, float]]:
    """tests/cpu_profile.py's rows (node id, wall s, worker CPU s, children CPU s), every worker's."""
    for worker in sorted(folder.glob("*.json")):
        for nodeid, wall, *_ in json.loads(worker.read_text()):
            yield nodeid.split("::")[0], wall


if __name__ == "__main__":
    source = Path(sys.argv[1])
    table = slowest(profile_timings(source) if source.is_dir() else junit_timings(source))
    OUT.write_text(json.dumps(table, indent=1) + "\n")
