"""benchmarks/paper_scale.py: a paper config's cost on stand-in data, its projection and its floor."""
import re
import sys

import paper_scale
import pytest

from fedguide.registry import ConfigError
from tests import REPO

SMALL = REPO / "configs/paper/feddw_mnist_practical.yaml"  # a CNN on MNIST-shaped data, 10 clients
KEYS = ("setup_s", "s_per_round", "first_round_extra_s", "peak_gpu_gib", "projected_hours", "ratio_vs_floor")


def printed(out: str) -> dict:
    return dict(re.findall(r"^(\w+)=(\S+)$", out, re.MULTILINE))


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One CPU run of a paper config at a tiny fraction: 120 training images, one epoch, two rounds."""
    capture = tmp_path_factory.mktemp("paper-scale") / "out.txt"
    with capture.open("w") as fh:
        stdout, sys.stdout = sys.stdout, fh
        try:
            rc = paper_scale.main([str(SMALL), "--fraction", "0.002", "--rounds", "2", "--device", "cpu",
                                   "train.epochs=1"])
        finally:
            sys.stdout = stdout
    return rc, capture.read_text()


def test_a_paper_config_runs_on_standin_data_and_prints_its_costs(smoke):
    rc, out = smoke
    assert rc == 0, out
    values = printed(out)
    assert set(KEYS) <= set(values), out
    assert values["peak_gpu_gib"] == "n/a"  # a CPU run
    for key in ("setup_s", "s_per_round", "projected_hours", "ratio_vs_floor"):
        assert float(values[key]) > 0, (key, out)
    walls = [float(w) for w in re.findall(r"^round \d+: wall ([\d.]+) s", out, re.MULTILINE)]
    # walls and the extra are printed to 1 ms: three roundings of at most 0.5 ms each
    assert float(values["first_round_extra_s"]) == pytest.approx(walls[0] - walls[1], abs=2e-3), out
    assert "like=mnist (train 120 of 60000, test 20 of 10000), 2 of 50 rounds" in out
    assert "floor: 10 steps" in out  # 10 clients x 1 epoch x 1 batch of the timed round 2


def test_projection_scales_training_and_evaluation_by_the_data_drawn():
    rows = [{"train_seconds": 2.0, "eval_seconds": 1.0}, {"train_seconds": 1.0, "eval_seconds": 0.5},
            {"train_seconds": 1.0, "eval_seconds": 0.5}]
    walls = [4.0, 2.0, 2.0]  # 1 s of aggregation and checkpoint per round, 0.5 s in rounds 2 and 3
    # Training drawn at 1/10, test at 1/2: rounds 2, 3 = 2 + 1 * 9 + 0.5 * 1 = 11.5; round 1 = 11.5 plus its extra
    # wall of 4 - 2 = 2 s, not scaled by the data (scaled, it would be 4 + 2 * 9 + 1 * 1 = 23).
    assert paper_scale.projected_hours(rows, walls, 0.1, 0.5, 10) == pytest.approx((13.5 + 11.5 * 9) / 3600)
    assert paper_scale.projected_hours(rows, walls, 0.1, 0.5, 2) == pytest.approx((13.5 + 11.5) / 3600)
    assert paper_scale.projected_hours(rows, walls, 1.0, 1.0, 3) == pytest.approx(8 / 3600)
    # a first round faster than the later ones (noise) costs a later one
    assert paper_scale.projected_hours(rows, [1.0, 2.0, 2.0], 1.0, 1.0, 3) == pytest.approx(6 / 3600)


def test_hub_guidance_is_swapped_only_when_asked_and_said(tmp_path):
    config = REPO / "configs/paper/feddifrc_cifar10_dir0.05.yaml"
    lines = []
    kept, rounds = paper_scale.standin_raw(config, 2, 0.01, None, "keep", [], tmp_path, lines.append)
    assert kept["guidance"]["model"] == "runwayml/stable-diffusion-v1-5" and not lines and rounds == 100
    assert kept["data"] == {"name": "standin", "like": "cifar10", "scale": 0.01} and kept["train"]["rounds"] == 2
    swapped, _ = paper_scale.standin_raw(config, 2, 0.01, None, "embedded", ["seed=3"], tmp_path, lines.append)
    assert swapped["guidance"]["model"] == "embedded" and swapped["seed"] == 3
    assert len(lines) == 1 and "swapped for embedded" in lines[0]
    assert swapped["guidance"]["feature_cache"].startswith(str(tmp_path))  # set-up measured, not cached


def test_data_larger_than_memory_is_refused_with_the_fraction_that_fits():
    params = paper_scale.StandinParams(like="domainnet", image_size=224)  # ~586k images: ~0.4 TB as float32
    with pytest.raises(ConfigError, match=r"pass --fraction 0\.\d+ or less"):
        paper_scale.check_memory(params, 1.0)


@pytest.mark.gpu
def test_paper_scale_on_cuda_reports_peak_memory(capsys):
    rc = paper_scale.main([str(SMALL), "--fraction", "0.01", "--rounds", "2", "--device", "cuda"])
    values = printed(capsys.readouterr().out)
    assert rc == 0 and float(values["peak_gpu_gib"]) > 0 and float(values["ratio_vs_floor"]) > 0
