"""The study scripts' own logic: the guidance study's edge stage and its chosen-variant file, and the reading of
two FedDW tables into where the rows moved."""
import pytest

import feddw_table_moves as moves
import guidance_study as study


def test_the_edge_stage_goes_one_factor_further_only_for_weights_at_the_grids_edge():
    chosen = {("feddifrc", "embedded"): study.Variant("feddifrc", "embedded",
                                                      (("lambda_ndcr", 4.0), ("lambda_tdcl", 0.25), ("t", 150))),
              ("align_features", "embedded"): study.Variant("align_features", "embedded")}
    labels = {v.label for v in study.stage_variants("edge", chosen)}
    assert {"feddifrc@embedded[lambda_ndcr=16.0,lambda_tdcl=0.25,t=150]",
            "feddifrc@embedded[lambda_ndcr=4.0,lambda_tdcl=0.0625,t=150]",
            "feddifrc@embedded[lambda_ndcr=4.0,lambda_tdcl=0.25,t=150]"} <= labels
    assert not any("t=600" in label or "t=37.5" in label for label in labels)  # the timestep is no weight
    assert "align_features@embedded" in labels and not [x for x in labels if x.startswith("align_features@embedded[")]
    kd = study.defaults("semanticfl")["lambda_kd"]
    assert study._at_edge(0.25 * kd, kd) and study._at_edge(4 * kd, kd) and not study._at_edge(kd, kd)


def test_chosen_variants_are_written_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setattr(study, "RESULTS", tmp_path)
    chosen = {("feddifrc", "embedded"): study.Variant("feddifrc", "embedded", (("lambda_ndcr", 4.0), ("t", 150))),
              ("semanticfl", "oracle"): study.Variant("semanticfl", "oracle", (("t", "paper"),))}
    study.write_chosen("demo", chosen)
    assert study.read_chosen("demo") == chosen  # the same labels, so the same run folders
    with pytest.raises(SystemExit, match="missing: run the stages on other's config first"):
        study.read_chosen("other")


TABLE = """# title

## Table I's shape (last-k accuracy %)

| method | practical global | pathological global |
|---|---:|---:|
| FedAvg | {a} | {b} |
| FedRep | {c} | — |

## practical: every statistic (%)

| method | seeds |
|---|---|
| FedAvg | 0, 1, 2 |
"""


def test_moves_set_each_cell_beside_its_earlier_value_with_the_seeds_each_side_has(tmp_path, monkeypatch):
    monkeypatch.setattr(moves, "REPO", tmp_path)
    before, after = tmp_path / "before", tmp_path / "after"
    before.mkdir()
    after.mkdir()
    (before / "tables.md").write_text(TABLE.format(a="84.88 ± 0.80", b="63.39 ± 7.98", c="74.72 ± 1.44"))
    (after / "tables.md").write_text(TABLE.format(a="85.77 (1 seed)", b="57.32 ± 1.00", c="71.88 ± 0.50 (2 seeds)"))
    text = moves.moves(before, after)
    assert "| FedAvg | 84.88 → 85.77 (+0.89) (1 vs 3 seeds) | 63.39 → 57.32 (-6.07) |" in text
    assert "| FedRep | 74.72 → 71.88 (-2.84) (2 vs 3 seeds) | — |" in text
    assert "every statistic" not in text  # only Table I's section is read
