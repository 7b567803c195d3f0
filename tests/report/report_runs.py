"""Run folders in the engine's format, written by hand (fast): the report tests' input."""
from __future__ import annotations

import json
from pathlib import Path

import yaml

ROUNDS = 5


def make_run(
    root: Path,
    name: str,
    method: str,
    seed: int,
    finals: float = 0.5,
    *,
    curve: list[float] | None = None,
    method_params: dict | None = None,
    rounds_done: int | None = None,
    complete: bool = True,
    counts: list[list[int]] | None = None,
    partition_label: str = "dirichlet(alpha=0.1)",
    bytes_up: int = 2_000_000,
    wall: float = 10.0,
    summary_extra: dict | None = None,
    metrics_extra: dict | None = None,
) -> Path:
    """A run directory in the engine's format. By default the curve rises linearly to ``finals`` and peaks
    one round earlier at finals + 0.01, so final and best differ and a mix-up shows in the numbers; ``curve``
    gives the accuracies of every planned round instead. The summary is an older run's (no
    accuracy_last_k) unless ``summary_extra`` adds it; ``metrics_extra`` adds keys to every round's line."""
    d = root / name
    d.mkdir(parents=True)
    if curve is None:
        curve = [finals * (r + 1) / ROUNDS for r in range(ROUNDS)]
        curve[-2] = finals + 0.01
    rounds = len(curve)
    config = {
        "data": {"name": "cifar10"},
        "partition": {"name": "dirichlet", "alpha": 0.1},
        "method": {"name": method, **(method_params or {})},
        "clients": {"num": 3, "per_round": 3},
        "train": {"rounds": rounds},
        "seed": seed,
        "meta": {"version": "0.1.0", "git_commit": "abc123"},
    }
    (d / "config.yaml").write_text(yaml.safe_dump(config))
    curve = curve[:rounds if rounds_done is None else rounds_done]
    with open(d / "metrics.jsonl", "w") as fh:
        for r, acc in enumerate(curve, start=1):
            fh.write(json.dumps({"round": r, "accuracy": acc, "loss": 1.0 / r, "seconds": wall / rounds,
                                 "bytes_up": bytes_up, "bytes_down": bytes_up,
                                 "domain_accuracy": {"a": acc, "b": acc / 2}, **(metrics_extra or {})}) + "\n")
    if complete:
        summary = {
            "method": method, "dataset": "cifar10", "partition": partition_label, "num_clients": 3,
            "rounds": rounds, "seed": seed, "final_accuracy": curve[-1], "best_accuracy": max(curve),
            "best_round": curve.index(max(curve)) + 1, "accuracy_curve": curve, "wall_seconds": wall,
            **(summary_extra or {}),
        }
        (d / "summary.json").write_text(json.dumps(summary))
    counts = counts or [[10, 0, 5, 1], [0, 20, 3, 2], [7, 7, 0, 9]]
    (d / "partition.json").write_text(json.dumps({"num_classes": 4, "class_names": list("wxyz"), "counts": counts}))
    return d


def with_config(run_dir: Path, **dotted) -> Path:
    """Set config keys of a run folder: ``train__lr=0.1`` is train.lr."""
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    for key, value in dotted.items():
        section, leaf = key.split("__")
        cfg.setdefault(section, {})[leaf] = value
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))
    return run_dir


def table_rows(md: str) -> list[list[str]]:
    """The cells of a Markdown table's body rows (the first table in ``md``)."""
    lines = md.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return [[c.strip() for c in row.strip("|").split("|")] for row in lines[start + 2:end]]


rows_of = table_rows
