"""Every method built on a guidance model, one round on its tiny pipeline, on the CPU and on the simulated device
(``train.device: simulated``, core/simulated.py; ``guidance.device`` follows it): the same metrics, and no
operation mixing device and host tensors (the simulated device raises on one, as CUDA refuses it).

The configs are the methods' own tests' smallest ones (test_feddifrc.py, test_semanticfl.py, test_feddda.py,
test_fedrcl_table6.py, conftest's digits_config, test_feddisc.py, test_feddisc_baselines.py, test_fedcado.py,
test_feddf.py), cut to one round.

Bit-identical, not close: both runs compute on the CPU with the same kernels. The guidance model's weights are
where they could part: ``from_pretrained`` leaves them as views into the safetensors file, 8 bytes off a 64-byte
boundary, while the simulated device's copies are freshly allocated (aligned), and oneDNN may round a convolution
differently on the two. On an AMD EPYC host FedRCL's and FedDDA's round-1 losses parted by about 2e-6 (relative);
``guidance.components.align_weights`` now copies unaligned weights on load, so both runs read aligned memory.
"""
from __future__ import annotations

import copy

import pytest

from fedguide.config import build_config
from tests.tiny import BASE, run_tiny, tiny_raw, without_timing

# tiny_sd, tiny_unclip, tiny_clip, fmnist_root, cached_digits, one_thread: conftest.py
pytestmark = pytest.mark.usefixtures("cached_digits", "one_thread")

FMNIST = {"n_train": 80, "vertical": True}  # SemanticFL's: its PCA to z's 64 dims needs 64 images to fit on
GEN = {"per_class": 2, "steps": 1, "cfg_scale": 1.0, "gen_batch_size": 16}  # one UNet pass per sampler batch
DDA = {"pool_per_class": 2, "steps": 1, "cfg_scale": 1.0, "gen_batch_size": 16}  # FedDDA's pool of 2 per class
FEDDISC = {"num_centroids": 2, "images_per_centroid": 2, "steps": 2, "head_epochs": 3, "sample_grid": 2}
SEMI = {"name": "semi_supervised", "server_domain": "uci", "clients": "feature_skew"}


def fmnist(f, method: dict) -> dict:
    """FedDifRC's, SemanticFL's, FedDDA's and FedRCL's tests: Fashion-MNIST bands, an MLP, the tiny SD pipeline."""
    return tiny_raw({"data": {"name": "fmnist", "root": str(f.fmnist_root)}, "model": {"name": "mlp"},
                     "guidance": {"model": str(f.tiny_sd)}, "train": {"rounds": 1}}, method=method)


def digits(f, method: dict, image_encoder=None, **over) -> dict:
    """FedDISC's and its baselines' tests (conftest's digits_config): 16-pixel digits_domains split
    semi-supervised over two clients, the tiny unCLIP pipeline."""
    guidance = {"model": str(f.tiny_unclip)}
    if image_encoder is not None:
        guidance["image_encoder"] = str(image_encoder)
    raw = tiny_raw({"data": {"name": "digits_domains", "image_size": 16, "per_class": 20, "fraction": 0.5},
                    "clients": {"num": 2, "per_round": 2}, "train": {"rounds": 1}, "guidance": guidance},
                   method=method, **over)
    raw["partition"] = dict(SEMI)
    return raw


def one_shot(f, method: dict) -> dict:
    """FedCADO's and SD_Gen's tests (test_fedcado.py's raw_config): 2 clients of 2 digit classes each, 8x8 RGB
    images, the tiny SD pipeline; FedDF (test_feddf.py) the same data with an MLP and no guidance model."""
    raw = copy.deepcopy(BASE)
    raw.update({
        "data": {"name": "digits_domains", "image_size": 8, "per_class": 4, "fraction": 0.3, "public_fraction": 0.1},
        "partition": {"name": "disjoint_classes", "k": 2},
        "model": {"name": "resnet10", "width": 4},
        "clients": {"num": 2, "per_round": 2},
        "train": {"rounds": 1, "epochs": 1, "batch_size": 32, "lr": 0.05},
        "method": {"local_epochs": 2, "progress": False, **method},
    })
    if method["name"] == "feddf":
        raw["model"] = {"name": "mlp", "hidden": 32}
    else:
        raw["method"] = {"images_per_class": 2, "steps": 2, "gen_batch_size": 4, "agg_epochs": 2, **raw["method"]}
        raw["guidance"] = {"model": str(f.tiny_sd)}
    return raw


LR = {"train": {"lr": 0.05}}
CASES = {
    "align_features": lambda f: fmnist(f, {"name": "align_features"}),
    "centroid_finetune": lambda f: digits(f, {"name": "centroid_finetune", "num_centroids": 3, "head_epochs": 20},
                                          **LR),
    "fedavg_sm": lambda f: digits(f, {"name": "fedavg_sm"}, **LR),
    "fedcado": lambda f: one_shot(f, {"name": "fedcado", "edit_steps": 2}),
    "feddda": lambda f: fmnist(f, {"name": "feddda", **DDA}),
    "feddf": lambda f: one_shot(f, {"name": "feddf", "distill_steps": 5}),
    "feddifrc": lambda f: fmnist(f, {"name": "feddifrc", "image_size": "pipeline"}),
    "feddisc": lambda f: digits(f, {"name": "feddisc", **FEDDISC}),
    # FedRCL's guided variants together (◇+†): the generated images join the batches the SD alignment sees.
    "fedrcl": lambda f: fmnist(f, {"name": "fedrcl", "generated": GEN, "sd_align": 1.0, "sd_image_size": "pipeline"}),
    "rscfed": lambda f: digits(f, {"name": "rscfed", "strong_views": 2, "subset_size": 2}, **LR),
    "sd_gen": lambda f: one_shot(f, {"name": "sd_gen"}),
    "semanticfl": lambda f: fmnist(f, {"name": "semanticfl"}),
    "semifl": lambda f: digits(f, {"name": "semifl", "threshold": 0.3, "strong_views": 2}, **LR),
    "zero_shot": lambda f: digits(f, {"name": "zero_shot"}, image_encoder=f.tiny_clip),
}


class Fixtures:
    """The test's fixtures by attribute, requested only when a case reads them."""

    def __init__(self, request):
        self._request = request

    def __getattr__(self, name):
        return self._request.getfixturevalue(name)


def without_clock(value):
    """Metrics without what measures the machine: the engine's timings and a method's own seconds and
    throughputs, at any depth (benchmarks/behaviour_hashes.py's rule)."""
    if isinstance(value, dict):
        return {k: without_clock(v) for k, v in value.items()
                if not (k.endswith("seconds") or k.endswith("per_second"))}
    if isinstance(value, list):
        return [without_clock(v) for v in value]
    return value


def test_every_guided_method_has_a_case():
    from tests.tiny import GUIDED_METHODS

    assert GUIDED_METHODS | {"fedrcl"} == set(CASES)


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_round_on_the_simulated_device_computes_what_the_cpu_computes(case, request, tmp_path):
    raw = CASES[case](Fixtures(request))
    runs = {}
    for device in ("cpu", "simulated"):
        layer = copy.deepcopy(raw)
        layer["train"] = {**layer["train"], "device": device}
        if "guidance" in layer:  # each run computes its own features (a shared cache would hide the second's)
            layer["guidance"] = {**layer["guidance"], "feature_cache": str(tmp_path / f"cache-{device}")}
        runs[device] = run_tiny(tmp_path, build_config(layer), name=device)
    (cpu, cpu_rows, _), (sim, sim_rows, _) = runs["cpu"], runs["simulated"]
    assert "device_check" not in cpu and sim["device_check"]["device"] == "simulated"
    assert without_clock(without_timing(sim_rows)) == without_clock(without_timing(cpu_rows))
    check = sim["device_check"]
    assert check["mixes"] == 0 and check["host_syncs_per_step"] == 0
    # Nothing is copied from the host inside a step (FedRCL-◇ draws its generated rows on the device).
    assert check["h2d_bytes_per_step"] == 0, check["h2d_step_sites"]
