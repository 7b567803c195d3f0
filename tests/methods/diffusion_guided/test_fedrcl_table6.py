"""FedRCL's FedDifRC Table 6 variants: ◇ (generated images join each client's batches), † (L2 alignment of z to
the guidance model's features of the image) and ◇+†, on a tiny Stable-Diffusion-layout pipeline."""
import json

import pytest
import torch
import torch.nn.functional as F

from fedguide.fl.setup import open_run, prepare
from fedguide.methods import ClientContext
from fedguide.methods.diffusion_guided._generated_data import extra_count
from fedguide.methods.diffusion_guided.align_features import alignment_loss
from tests.tiny import run_tiny, tiny_config

# tiny_sd and fmnist_root (60 training images of horizontal bands): conftest.py
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py
GEN = {"per_class": 2, "steps": 1, "cfg_scale": 1.0, "gen_batch_size": 16}  # one UNet pass per sampler batch


def config(tiny_sd, fmnist_root, cache, method="fedrcl", **params):
    if params.get("sd_align"):  # the pipeline's 32 px: FedDifRC's 224 px is 49 times the UNet work on a CPU
        params.setdefault("sd_image_size", "pipeline")
    return tiny_config({"data": {"name": "fmnist", "root": str(fmnist_root)},
                        "guidance": {"model": str(tiny_sd), "feature_cache": str(cache)}, "train": {"rounds": 2}},
                       method={"name": method, **params})


def client(ctx, method, cid=0):
    data = ctx.data.client(cid)
    cctx = ClientContext(cid, 1, data, method.server_payload(1, cid, ctx.initial_weights), {})
    state = method.begin_local(ctx.model, cctx)
    idx = data.indices[:8]
    cctx.batch_indices = idx
    return cctx, state, data.x[idx], data.y[idx]


def test_generated_images_join_the_batch_every_level_sees(tmp_path, tiny_sd, fmnist_root):
    ctx, method = open_run(prepare(config(tiny_sd, fmnist_root, tmp_path / "c", generated=GEN)), tmp_path / "run",
                           setup=True)
    cctx, state, x, y = client(ctx, method)
    seen = []
    handle = ctx.model.encoder.register_forward_hook(lambda m, i, o: seen.append(o.shape[0]))
    try:
        method.local_loss(ctx.model, x, y, cctx, state)
    finally:
        handle.remove()
        method._tap.detach()
    pool = state.generated[1]
    assert len(pool) > 0 and seen == [8 + extra_count(8, len(pool), len(cctx.data))]


def test_sd_alignment_adds_lambda_times_the_normalised_l2_to_its_targets(tmp_path, tiny_sd, fmnist_root):
    cfg = config(tiny_sd, fmnist_root, tmp_path / "c", sd_align=2.0, weight=0.0)
    ctx, method = open_run(prepare(cfg), tmp_path / "run", setup=True)
    sd = method._sd
    rows = sd._rows(ctx.data.client(0).indices[:3])
    e = torch.as_tensor(sd.features[rows]).float()
    cctx, state, x, y = client(ctx, method)
    first = ClientContext(0, 1, ctx.data.client(0), {}, {}, batch_indices=ctx.data.client(0).indices[:3])
    assert torch.allclose(sd.targets(first, torch.zeros(1), state.sd), e @ sd.map.T)  # P e(x)
    with torch.no_grad():
        got = method.local_loss(ctx.model, x, y, cctx, state)
        z, logits = ctx.model.forward_features(x)
        expected = F.cross_entropy(logits, y) + 2.0 * alignment_loss(z, sd.targets(cctx, z, state.sd), True)
    method._tap.detach()
    assert got.item() == pytest.approx(expected.item(), rel=1e-6)
    record = json.loads((tmp_path / "run" / "guidance" / "fedrcl.json").read_text())["sd_features"]
    assert record["shape"][0] == 60  # every training image, pooled over every UNet block


def test_sd_features_are_taken_at_feddifrcs_input_size_not_the_datas(tmp_path, tiny_sd, fmnist_root):
    """FedDifRC Sec. 4.1 ("the image size is 224x224"; released code ``--diffu_size 224``, hwang52/FedDifRC
    utils/options.py L29): † and ◇+† resize the images to feddifrc's image_size, resolved by the same rule (224 on
    a pipeline that is not one of fedguide's 32-px models), not to the data's 28 px."""
    sizes = {}
    for name, params in (("feddifrc", {"image_size": "paper"}), ("fedrcl", {"sd_align": 1.0, "sd_image_size": "paper"}),
                         ("fedrcl+", {"sd_align": 1.0, "sd_image_size": "paper", "generated": GEN})):
        cfg = config(tiny_sd, fmnist_root, tmp_path / "c", method=name.rstrip("+"), **params)
        _, built = open_run(prepare(cfg), tmp_path / name)
        sizes[name] = built.image_size if name == "feddifrc" else built._sd.image_size
    assert sizes == {"feddifrc": 224, "fedrcl": 224, "fedrcl+": 224}
    _, native = open_run(prepare(config(tiny_sd, fmnist_root, tmp_path / "c", sd_align=1.0, sd_image_size="native")),
                         tmp_path / "native")
    assert native._sd.image_size == 28  # the data's own: what † used before the option


def test_on_the_embedded_model_sd_features_take_the_size_feddifrc_takes(tmp_path, fmnist_root):
    embedded = {"guidance": {"model": "embedded", "feature_cache": str(tmp_path / "c")}}
    sizes = []
    for method in ({"name": "feddifrc", "fused_dim": 32}, {"name": "fedrcl", "sd_align": 1.0}):
        cfg = tiny_config({"data": {"name": "fmnist", "root": str(fmnist_root)}, **embedded,
                           "model": {"name": "mlp", "feature_dim": 32}}, method=method)
        _, built = open_run(prepare(cfg), tmp_path / method["name"])
        sizes.append(built.image_size if method["name"] == "feddifrc" else built._sd.image_size)
    assert sizes == [32, 32]  # fedguide's own models take their own 32 px under paper, for both


def test_both_variants_run_together(tmp_path, tiny_sd, fmnist_root):
    summary, rows, run_dir = run_tiny(tmp_path, config(tiny_sd, fmnist_root, tmp_path / "c", generated=GEN,
                                                       sd_align=1.0))
    assert len(rows) == 2 and 0.0 <= summary["final_accuracy"] <= 1.0
    record = json.loads((run_dir / "guidance" / "fedrcl.json").read_text())
    assert record["generated_data"]["generated_images"] > 0 and "sd_features" in record
    assert record["sd_features"]["image_size"] == {"requested": "pipeline", "pixels": 32, "latents": 8,
                                                   "pipeline_pixels": 32}


def test_the_default_fedrcl_needs_no_guidance_model(tmp_path):
    ctx, method = open_run(prepare(tiny_config(method={"name": "fedrcl"})), tmp_path / "run", setup=True)
    assert method._generated is None and method._sd is None
    assert not (tmp_path / "run" / "guidance").exists()
