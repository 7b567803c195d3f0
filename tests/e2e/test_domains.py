"""Domain shift end to end: the embedded digits_domains set split by domain, per-domain accuracy
in the run directory, and the report's per-domain table and domain x client heatmap."""
from __future__ import annotations

import json

import pytest
import yaml

from tests.e2e.helpers import cli_here, metrics, summary

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.e2e
def test_domain_partition_reports_per_domain_accuracy(tmp_path):
    cfg = tmp_path / "domains.yaml"
    cfg.write_text(yaml.safe_dump({
        "data": {"name": "digits_domains", "per_class": 40},
        "partition": {"name": "domain", "assign": {"uci": 1, "fonts": 2, "mnistm_like": 1}},
        "model": {"name": "cnn"},
        "method": {"name": "fedavg"},
        "clients": {"num": 4, "per_round": 4},
        "train": {"rounds": 2, "epochs": 1, "batch_size": 32, "lr": 0.05},
    }))
    run = tmp_path / "run"
    cli_here("run", str(cfg), "--quiet", "--out", str(run))

    part = json.loads((run / "partition.json").read_text())
    assert part["domain_names"] == ["uci", "fonts", "mnistm_like"]
    # one domain per client, in the assigned numbers
    assert [[int(c > 0) for c in row] for row in part["domain_counts"]] == [[1, 0, 0], [0, 1, 0], [0, 1, 0], [0, 0, 1]]
    s = summary(run)
    assert set(s["domain_accuracy"]) == {"uci", "fonts", "mnistm_like"}
    assert all(0.0 <= v <= 1.0 for v in s["domain_accuracy"].values())
    rows = metrics(run)
    assert all(set(r["domain_accuracy"]) == set(s["domain_accuracy"]) for r in rows)
    assert s["domain_accuracy"] == rows[-1]["domain_accuracy"]

    report = tmp_path / "report"
    cli_here("report", str(run), "--out", str(report))
    text = (report / "report.md").read_text()
    assert "Per-domain test accuracy" in text
    header = next(line for line in text.splitlines() if line.startswith("| method | partition |"))
    assert header.split("|")[3:7] == [" last k ", " uci ", " fonts ", " mnistm_like "]
    heatmaps = sorted(report.glob("partition_*_domains.png"))
    assert len(heatmaps) == 1 and heatmaps[0].read_bytes().startswith(PNG)
    assert heatmaps[0].name in text
