"""The method modules' source lines that match a pattern: what the source-scan tests of methods/ share."""
from __future__ import annotations

import re
from pathlib import Path

import fedguide.methods

METHODS_DIR = Path(fedguide.methods.__file__).parent


def matching_lines(pattern: re.Pattern) -> dict[Path, list[int]]:
    """Module path -> the numbers of its non-comment lines that ``pattern`` finds, for every module that has one."""
    found = {}
    for path in sorted(METHODS_DIR.rglob("*.py")):
        hits = [n for n, line in enumerate(path.read_text().splitlines(), 1)
                if pattern.search(line) and not line.lstrip().startswith("#")]
        if hits:
            found[path] = hits
    return found
