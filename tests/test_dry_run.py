"""--dry-run checks a config against what is on disk and writes nothing: no download, no folder."""
from __future__ import annotations

import pytest

import fedguide
from tests.tiny import tiny_raw


def test_a_dry_run_names_a_missing_data_set_instead_of_downloading_it(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDGUIDE_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("FEDGUIDE_OFFLINE", raising=False)  # the refusal is the dry run's, not the offline switch's
    with pytest.raises(fedguide.ConfigError, match="CIFAR-10 not found .* A dry run does not download; run without "
                                                   "--dry-run to fetch it"):
        fedguide.dry_run(tiny_raw(data={"name": "cifar10"}))
    assert not (tmp_path / "data").exists() and not (tmp_path / "home").exists()


def test_a_dry_run_of_a_config_on_disk_prints_it_resolved(tmp_path):
    text = fedguide.dry_run(tiny_raw(), ["seed=3"])
    assert "seed: 3" in text and "partition summary: " in text
