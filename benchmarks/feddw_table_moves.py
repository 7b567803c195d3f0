"""Where FedDW's Table I rows moved when the pFL rows took FedDW's released protocol (and FedDistill+ the authors'
released form): the "Table I's shape" table of the suite before (benchmarks/results/feddw_table/tables.md) beside
the same table of the suite re-run with them (``feddw_table_suite.py --only ... --results
benchmarks/results/feddw_table_protocol``), cell by cell.

    .venv/bin/python benchmarks/feddw_table_moves.py [--before DIR] [--after DIR]

Writes <after>/moves.md: per row and column the mean before, after, and the change in points, with the seeds each
side holds. The runs before the preset are not kept, so the change is between means over seeds (the same seeds and
partitions on both sides), not a paired interval; a cell whose side has fewer than 3 seeds says so.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
SECTION = "## Table I's shape"
CELL = re.compile(r"^\s*(?P<mean>-?\d+(?:\.\d+)?)(?:\s*±\s*(?P<std>\d+(?:\.\d+)?))?\s*(?:\((?P<n>\d+) seeds?\))?\s*$")


def shape_table(path: Path) -> tuple[list[str], dict[str, list[Optional[tuple[float, Optional[float], int]]]]]:
    """The columns and rows (method -> cells) of a tables.md's Table I section; a cell is (mean, std, seeds) or
    None where it is empty."""
    if not path.is_file():
        raise SystemExit(f"{path} is missing: run benchmarks/feddw_table_suite.py --report for that folder first")
    lines = path.read_text().splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.startswith(SECTION))
    except StopIteration:
        raise SystemExit(f"{path} has no '{SECTION}' section") from None
    end = next((i for i, line in enumerate(lines[start + 1:]) if line.startswith("## ")), len(lines))
    table = [line for line in lines[start + 1: start + 1 + end] if line.startswith("|")]
    columns = [c.strip() for c in table[0].strip("|").split("|")][1:]
    rows = {}
    for line in table[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = [_cell(c) for c in cells[1:]]
    return columns, rows


def _cell(text: str) -> Optional[tuple[float, Optional[float], int]]:
    m = CELL.match(text)
    if not m:
        return None
    return float(m["mean"]), float(m["std"]) if m["std"] else None, int(m["n"]) if m["n"] else 3


def moves(before: Path, after: Path) -> str:
    cols_b, rows_b = shape_table(before / "tables.md")
    cols_a, rows_a = shape_table(after / "tables.md")
    if cols_b != cols_a:
        raise SystemExit(f"the two tables have other columns: {cols_b} vs {cols_a}")
    out = ["# Where Table I's rows moved with FedDW's released protocol", "",
           f"Before: {before.relative_to(REPO)}/tables.md; after: {after.relative_to(REPO)}/tables.md. Each cell: "
           "last-k accuracy % before → after (change in points); the mean over the seeds each side has (3 unless "
           "noted). The runs before are not kept: the change is between means over the same seeds and partitions, "
           "not a paired interval.", "",
           "Two things changed between the sides besides the rows' own algorithms: before, only FedDW and the +DW "
           "rows had a bias-free classification layer (the others a bias there), after every row has one; and the "
           "FedDistill+ rows ran PFLlib's form before and the FedDW authors' released form after. FedAvg's row, "
           "whose algorithm did not change, shows how far that and the seeds' spread alone move a cell.", "",
           "| method | " + " | ".join(cols_a) + " |", "|---|" + "---:|" * len(cols_a)]
    for method, cells in rows_a.items():
        if method not in rows_b or all(c is None for c in cells):
            continue
        parts = []
        for old, new in zip(rows_b[method], cells):
            if old is None or new is None:
                parts.append("—")
                continue
            note = "" if new[2] == 3 and old[2] == 3 else f" ({new[2]} vs {old[2]} seeds)"
            parts.append(f"{old[0]:.2f} → {new[0]:.2f} ({new[0] - old[0]:+.2f}){note}")
        out.append(f"| {method} | " + " | ".join(parts) + " |")
    return "\n".join(out) + "\n"


def main(argv: Optional[list[str]] = None) -> None:
    from fedguide.core.atomic import write_text

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path, default=REPO / "benchmarks/results/feddw_table")
    ap.add_argument("--after", type=Path, default=REPO / "benchmarks/results/feddw_table_protocol")
    args = ap.parse_args(argv)
    text = moves(args.before.resolve(), args.after.resolve())
    write_text(args.after / "moves.md", text)
    print(text)


if __name__ == "__main__":
    main()
