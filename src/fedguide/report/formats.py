"""Tables as data, rendered as Markdown, CSV or a LaTeX tabular.

A table is built once from the runs and rendered in any format, so the three can never disagree on a
number. Accuracy cells hold the per-seed values themselves (``Stat``): Markdown and LaTeX show
"mean ± std" in percent, CSV gives the mean and the standard deviation as plain numbers in two columns.
"""
from __future__ import annotations

import csv
import io
import statistics
from dataclasses import dataclass, field
from typing import Union

FORMATS = ("md", "csv", "latex")
EXTENSIONS = {"md": "md", "csv": "csv", "latex": "tex"}


@dataclass(frozen=True)
class Stat:
    """Accuracies (fractions) of the seeds of one table cell; shown in percent."""

    values: tuple[float, ...]
    bold: bool = False
    note: str = ""  # replaces the number when the cell has none (e.g. "seed 0 repeated")

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.values) if self.values else None

    @property
    def std(self) -> float | None:
        """Sample standard deviation (ddof=1) over seeds; None for a single seed."""
        return statistics.stdev(self.values) if len(self.values) > 1 else None


@dataclass(frozen=True)
class Num:
    """A plain number with the precision it is shown at (CSV keeps it unrounded)."""

    value: float | None
    fmt: str = ".2f"


@dataclass(frozen=True)
class Delta:
    """A paired difference (fractions) with its interval; shown in signed percentage points, "mean [lo, hi]"."""

    mean: float | None
    interval: tuple[float, float] | None = None


Cell = Union[str, int, float, None, Stat, Num, Delta]


def _pp(v: float) -> str:
    return f"{v * 100:+.2f}"


@dataclass
class Table:
    columns: list[str]
    rows: list[list[Cell]] = field(default_factory=list)
    # Columns aligned right (numbers); the others are aligned left.
    numeric: set[int] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)  # footnotes, shown under the Markdown table only
    # CSV headers of an accuracy column's mean and std where "<name>", "<name> std" would read badly.
    csv_names: dict[int, tuple[str, str]] = field(default_factory=dict)


def bold_best(table: Table, columns: list[int]) -> None:
    """Mark the highest mean of each given column bold (every tie too), where two or more rows have one."""
    for j in columns:
        means = [c.mean for row in table.rows if isinstance(c := row[j], Stat) and c.mean is not None]
        if len(means) < 2:
            continue
        best = max(means)
        for row in table.rows:
            c = row[j]
            if isinstance(c, Stat) and c.mean is not None and c.mean == best:
                row[j] = Stat(c.values, True, c.note)


# ---- Markdown ---------------------------------------------------------------------------------------
def _md_text(c: Cell) -> str:
    if isinstance(c, Stat):
        if c.mean is None:
            return c.note or "n/a"
        std = f"{c.std * 100:.2f}" if c.std is not None else "n/a"
        text = f"{c.mean * 100:.2f} ± {std}"
        return f"**{text}**" if c.bold else text
    if isinstance(c, Num):
        return "n/a" if c.value is None else format(c.value, c.fmt)
    if isinstance(c, Delta):
        if c.mean is None:
            return "n/a"
        return f"{_pp(c.mean)} [{_pp(c.interval[0])}, {_pp(c.interval[1])}]" if c.interval else f"{_pp(c.mean)} [n/a]"
    return "n/a" if c is None else str(c)


def _md_escape(text: str) -> str:
    # A literal pipe would split the cell; labels come from user configs so this can happen.
    return text.replace("|", "\\|").replace("\n", " ")


def to_markdown(table: Table, notes: bool = True) -> str:
    align = ["---:" if j in table.numeric else "---" for j in range(len(table.columns))]
    lines = ["| " + " | ".join(_md_escape(c) for c in table.columns) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(_md_escape(_md_text(c)) for c in row) + " |" for row in table.rows]
    text = "\n".join(lines) + "\n"
    if notes and table.notes:
        text += "\n" + "\n\n".join(table.notes) + "\n"
    return text


# ---- CSV --------------------------------------------------------------------------------------------
def _csv_number(v: float | None, scale: float = 1.0) -> str:
    return "" if v is None else f"{v * scale:.10g}"


def to_csv(table: Table) -> str:
    """Plain numbers: an accuracy column becomes "<name>" (mean, %) and "<name> std" (%), a paired difference
    "<name>", "<name> low", "<name> high" (percentage points), empty when undefined; nothing is bold and there
    are no footnotes."""
    stat_cols = {j for j in range(len(table.columns)) if any(isinstance(r[j], Stat) for r in table.rows)}
    delta_cols = {j for j in range(len(table.columns)) if any(isinstance(r[j], Delta) for r in table.rows)}
    header: list[str] = []
    for j, name in enumerate(table.columns):
        if j in stat_cols:
            header += list(table.csv_names.get(j, (name, f"{name} std")))
        elif j in delta_cols:
            header += [name, f"{name} low", f"{name} high"]
        else:
            header.append(name)
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(header)
    for row in table.rows:
        out: list[str] = []
        for j, c in enumerate(row):
            if j in stat_cols:
                out += ([_csv_number(c.mean, 100), _csv_number(c.std, 100)] if isinstance(c, Stat)
                        else [_csv_text(c), ""])
            elif j in delta_cols:
                lo, hi = c.interval if isinstance(c, Delta) and c.interval else (None, None)
                out += ([_csv_number(c.mean, 100), _csv_number(lo, 100), _csv_number(hi, 100)] if isinstance(c, Delta)
                        else [_csv_text(c), "", ""])
            else:
                out.append(_csv_text(c))
        writer.writerow(out)
    return buf.getvalue()


def _csv_text(c: Cell) -> str:
    if isinstance(c, Num):
        return _csv_number(c.value)
    if isinstance(c, float):
        return _csv_number(c)
    return "" if c is None else str(c)


# ---- LaTeX ------------------------------------------------------------------------------------------
_LATEX_SPECIAL = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                  "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}",
                  "±": r"$\pm$", "†": r"$^\dagger$"}


def latex_escape(text: str) -> str:
    return "".join(_LATEX_SPECIAL.get(ch, ch) for ch in text)


def _latex_text(c: Cell) -> str:
    if isinstance(c, Stat):
        if c.mean is None:
            return latex_escape(c.note or "n/a")
        text = f"{c.mean * 100:.2f}" + (rf" $\pm$ {c.std * 100:.2f}" if c.std is not None else "")
        return rf"\textbf{{{text}}}" if c.bold else text
    return latex_escape(_md_text(c))


def to_latex(table: Table) -> str:
    """A plain ``tabular`` (no packages needed): header, one line per row, ``\\hline`` rules."""
    spec = "".join("r" if j in table.numeric else "l" for j in range(len(table.columns)))
    lines = [rf"\begin{{tabular}}{{{spec}}}", r"\hline",
             " & ".join(latex_escape(c) for c in table.columns) + r" \\", r"\hline"]
    lines += [" & ".join(_latex_text(c) for c in row) + r" \\" for row in table.rows]
    lines += [r"\hline", r"\end{tabular}"]
    return "\n".join(lines) + "\n"


def render(table: Table, fmt: str = "md") -> str:
    if fmt == "md":
        return to_markdown(table)
    if fmt == "csv":
        return to_csv(table)
    if fmt == "latex":
        return to_latex(table)
    raise ValueError(f"unknown table format '{fmt}'; choose one of {', '.join(FORMATS)}")
