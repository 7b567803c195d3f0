"""methods/ stays a house of rooms: each family's folder is a list a reader takes in at a glance."""
from __future__ import annotations

from tests.methods.source_scan import METHODS_DIR

MOST_MODULES = 12


def test_no_room_of_methods_holds_more_than_a_dozen_modules():
    crowded = {str(d.relative_to(METHODS_DIR)) or ".": n for d in [METHODS_DIR, *METHODS_DIR.rglob("*")]
               if d.is_dir() and d.name != "__pycache__"
               and (n := sum(1 for p in d.glob("*.py") if p.name != "__init__.py")) > MOST_MODULES}
    assert not crowded, f"split these rooms by kind (a sub-room with an __init__ docstring): {crowded}"


def test_every_room_says_what_its_family_shares():
    bare = [str(d.relative_to(METHODS_DIR)) for d in METHODS_DIR.rglob("*") if d.is_dir() and d.name != "__pycache__"
            and not (d / "__init__.py").read_text().lstrip().startswith('"""')]
    assert not bare, f"rooms without an __init__ docstring: {bare}"
