"""The command line end to end: the smoke config on real Fashion-MNIST and the listing as processes of their own;
dry runs, errors and sweeps through the command line's code in this process (``cli_here``)."""
from __future__ import annotations

import json

import pytest
import yaml

from tests.e2e.helpers import REPO, cli, cli_here, metrics, summary, tiny_config

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.e2e
def test_smoke_config_writes_the_run_directory_contract(tmp_path):
    run = tmp_path / "smoke"
    # Scored on a fifth of the test set: the full 10 000 images, three times, were half of this run's time, and the
    # contract is the same (the override is written into config.yaml like any other).
    out = cli("run", str(REPO / "configs/smoke.yaml"), "--out", str(run), "eval.test_subset=0.2")
    last = out.stdout.strip().splitlines()[-1]
    done = summary(run)
    # The final line leads with the number runs are compared by.
    assert last.startswith(f"last-{done['last_k']} accuracy {100 * done['accuracy_last_k']:.2f}%  final "
                           f"{100 * done['final_accuracy']:.2f}%")

    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert cfg["seed"] == 0 and cfg["method"]["name"] == "fedavg"
    assert cfg["meta"]["version"] and "git_commit" in cfg["meta"] and cfg["meta"]["cpu"]
    assert cfg["partition"]["alpha"] == 0.5 and cfg["partition"]["min_size"] == 10  # resolved defaults
    assert cfg["eval"]["test_subset"] == 0.2

    rows = metrics(run)
    assert [r["round"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert {"round", "accuracy", "loss", "seconds", "bytes_up", "bytes_down"} <= r.keys()
        assert 0.0 <= r["accuracy"] <= 1.0 and r["bytes_up"] > 0 and r["bytes_down"] > 0

    s = summary(run)
    for key in ("method", "dataset", "partition", "num_clients", "rounds", "seed", "final_accuracy",
                "best_accuracy", "best_round", "accuracy_curve", "wall_seconds"):
        assert key in s, key
    assert s["final_accuracy"] == rows[-1]["accuracy"]
    assert s["best_accuracy"] == max(r["accuracy"] for r in rows)
    assert s["final_accuracy"] > 0.3, "3 rounds of FedAvg on 3000 FMNIST images learn something"

    part = json.loads((run / "partition.json").read_text())
    assert len(part["counts"]) == 4 and sum(map(sum, part["counts"])) == 3000
    assert (run / "checkpoints" / "last.safetensors").is_file()

    rep = cli("report", str(run))
    assert "| fedavg | fmnist |" in rep.stdout
    for name in ("accuracy_curves.png", "partition_smoke.png"):
        assert (run / "plots" / name).read_bytes()[:8] == PNG


def test_list_json_names_every_registry():
    listing = json.loads(cli("list", "--json").stdout)
    assert set(listing) >= {"methods", "datasets", "partitions", "models"}
    names = {k: {e["name"] for e in v} for k, v in listing.items()}
    assert {"fedavg", "fedprox", "local", "centralized"} <= names["methods"]
    assert {"fmnist", "digits", "digits_domains", "cifar10", "cifar100", "tinyimagenet", "mnist", "svhn", "usps",
            "synthdigits", "mnistm", "digit_benchmark", "imagefolder", "office_caltech10", "domainnet", "nicopp",
            "openimage_fedcado", "openimage_feddisc", "ham10000", "eurosat", "imdb"} <= names["datasets"]
    assert {"iid", "dirichlet", "shards", "nid2", "longtail", "domain", "feature_skew", "disjoint_classes",
            "semi_supervised"} <= names["partitions"]
    assert {"cnn", "resnet10", "resnet18", "resnet34", "resnet50", "mobilenetv2", "mobilenetv3_small",
            "shufflenetv2", "vgg16_bn", "bilstm"} <= names["models"]
    assert "dw" in names["regularizers"]
    # The closed sets a config names: what train.device, train.augment and logging accept.
    assert names["devices"] == {"auto", "cpu", "cuda", "cuda:N", "mps", "simulated"}
    assert names["augmentations"] == {"none", "crop", "crop_flip", "autoaugment"}
    assert names["loggers"] == {"csv", "tensorboard", "wandb"}


def test_dry_run_validates_and_trains_nothing(tmp_path):
    cfg = tiny_config(tmp_path / "cfg.yaml")
    out = cli_here("run", str(cfg), "--dry-run", "--out", str(tmp_path / "run"), "method.name=fedprox", "method.mu=0.5")
    resolved = yaml.safe_load(out.stdout.split("partition summary:")[0])
    assert resolved["method"] == {"name": "fedprox", "mu": 0.5, "gradient": "direct"}
    assert "# train.augment: one of none, crop, crop_flip, autoaugment\n" in out.stdout  # the choices, as comments
    summary_line = json.loads(out.stdout.split("partition summary:")[1])
    assert summary_line["num_clients"] == 4
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "override,expected",
    [
        ("method.name=fedsgd", "unknown method 'fedsgd'"),
        ("train.lr=-1", "train.lr"),
        ("train.lrr=0.1", "valid keys"),
        ("clients.per_round=9", "lower clients.per_round"),
        ("partition.name=nid2", "clients.num"),
        ("model.name=cnn", "at least 12x12"),
        ("train.augment=flip", "write 'none', 'crop', 'crop_flip' or 'autoaugment'"),
        ("train.device=gpu", "write one of auto, cpu, cuda, cuda:N, mps, simulated"),
    ],
)
def test_bad_input_is_a_clear_error_not_a_traceback(tmp_path, override, expected):
    cfg = tiny_config(tmp_path / "cfg.yaml")
    proc = cli_here("run", str(cfg), "--out", str(tmp_path / "run"), override, check=False)
    assert proc.returncode == 2, proc.stderr
    assert expected in proc.stderr
    assert "Traceback" not in proc.stderr


def test_sweep_runs_every_combination_and_prints_a_table(tmp_path):
    cfg = tiny_config(tmp_path / "cfg.yaml", train={"rounds": 2})
    out = cli_here("run", str(cfg), "--out", str(tmp_path / "sweep"), "--quiet",
              "--sweep", "method.name=fedavg,fedprox", "--sweep", "seed=0,1")
    runs = sorted(p.name for p in (tmp_path / "sweep").iterdir() if (p / "summary.json").exists())
    assert runs == ["name=fedavg-seed=0", "name=fedavg-seed=1", "name=fedprox-seed=0", "name=fedprox-seed=1"]
    assert "| fedavg | digits |" in out.stdout and "| fedprox | digits |" in out.stdout


def test_reuse_synthetic_flag_sets_the_method_option(tmp_path):
    cfg = tiny_config(tmp_path / "cfg.yaml")
    earlier = tmp_path / "earlier-run"
    # sd_gen hands generated images to classifiers in the data's pixel format: a source that declares it
    out = cli_here("run", str(cfg), "--dry-run", "method.name=sd_gen", "data.name=digits_domains", "--reuse-synthetic",
              str(earlier))
    resolved = yaml.safe_load(out.stdout.split("partition summary:")[0])
    assert resolved["method"]["reuse_synthetic"] == str(earlier)
    proc = cli_here("run", str(cfg), "--dry-run", "--reuse-synthetic", str(earlier), check=False)
    assert proc.returncode == 2 and "reuse_synthetic" in proc.stderr and "Traceback" not in proc.stderr


def test_dry_run_sweep_labels_each_combination_and_takes_list_values(tmp_path):
    cfg = tiny_config(tmp_path / "cfg.yaml")
    out = cli_here("run", str(cfg), "--dry-run", "--out", str(tmp_path / "sweep"),
              "--sweep", "model.mapping=[[16], []]", "--sweep", "seed=0,1")
    blocks = out.stdout.split("# sweep run ")[1:]
    assert len(blocks) == 4 and not (tmp_path / "sweep").exists()
    expected = [("model.mapping=[16] seed=0", [16], 0), ("model.mapping=[16] seed=1", [16], 1),
                ("model.mapping=[] seed=0", [], 0), ("model.mapping=[] seed=1", [], 1)]
    for i, (block, (label, mapping, seed)) in enumerate(zip(blocks, expected), 1):
        head, body = block.split("\n", 1)
        assert head.startswith(f"{i}/4: {label}  (folder ") and head.endswith(": new)")
        resolved = yaml.safe_load(body.split("partition summary:")[0])
        assert resolved["model"]["mapping"] == mapping and resolved["seed"] == seed


def test_sweep_checks_every_combination_before_the_first_run(tmp_path):
    cfg = tiny_config(tmp_path / "cfg.yaml")
    # fedprox comes first and would run before fedavg failed on mu, were the combinations not all checked first
    proc = cli_here("run", str(cfg), "--out", str(tmp_path / "sweep"), "method.mu=0.5",
               "--sweep", "method.name=fedprox,fedavg", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "1 of 2 sweep combinations are invalid, so none ran" in proc.stderr
    assert "method.name=fedavg: method.mu: method 'fedavg' has no parameter 'mu'" in proc.stderr
    assert not (tmp_path / "sweep").exists()


def test_a_sweep_run_again_skips_finished_runs_and_continues_the_unfinished_one(tmp_path):
    import fedguide
    from fedguide.fl.engine import TIMING_METRICS
    from tests.tiny import Crash, crash_after

    cfg = tiny_config(tmp_path / "cfg.yaml", train={"rounds": 3, "epochs": 1})
    parent = tmp_path / "sweep"
    # Stopped during seed=1's second round: seed=0 finished, seed=1 has round 1 on disk (log lines:
    # seed=0 starting, 3 rounds, its final line, seed=1 starting, round 1).
    with pytest.raises(Crash):
        fedguide.sweep(cfg, ["seed=0,1"], out=parent, log=crash_after(7))
    finished = (parent / "seed=0" / "summary.json").read_bytes()
    assert not (parent / "seed=1" / "summary.json").exists() and len(metrics(parent / "seed=1")) == 1

    out = cli_here("run", str(cfg), "--out", str(parent), "--quiet", "--sweep", "seed=[0, 1]")
    assert "[1/2] seed=0: finished before, skipped" in out.stdout
    assert "[2/2] seed=1: continuing" in out.stdout
    assert (parent / "seed=0" / "summary.json").read_bytes() == finished
    ref = fedguide.sweep(cfg, ["seed=1"], out=tmp_path / "ref", quiet=True)[0]

    def untimed(rows):
        return [{k: v for k, v in r.items() if k not in TIMING_METRICS} for r in rows]
    assert untimed(metrics(parent / "seed=1")) == untimed(ref.metrics)
    assert "| fedavg | digits |" in out.stdout  # the comparison table over both runs
