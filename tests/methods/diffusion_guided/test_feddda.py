"""FedDDA: how many images each client gets generated, how they join its batches (hand-computed), and a run on a
tiny Stable-Diffusion-layout pipeline whose generated set is reused by a second setup."""
import json

import pytest
import torch
import torch.nn.functional as F

from fedguide.fl.setup import open_run, prepare
from fedguide.methods import ClientContext
from fedguide.methods.diffusion_guided._generated_data import extra_count, mix, per_class_count
from fedguide.methods._synthetic import SyntheticStore
from fedguide.registry import ConfigError
from tests.tiny import run_tiny, tiny_config

# tiny_sd and fmnist_root (60 training images of horizontal bands): conftest.py
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py
GEN = {"per_class": 2, "steps": 1, "cfg_scale": 1.0, "gen_batch_size": 16}  # one UNet pass per sampler batch


def config(tiny_sd, fmnist_root, cache, method="feddda", **params):
    return tiny_config({"data": {"name": "fmnist", "root": str(fmnist_root)},
                        "guidance": {"model": str(tiny_sd), "feature_cache": str(cache)}, "train": {"rounds": 2}},
                       method={"name": method, **params})


def test_amounts():
    assert per_class_count(10, 3, "match") == 4  # ⌈10 / 3⌉ per class: at least as many as the real images
    assert per_class_count(10, 3, 7) == 7
    assert extra_count(32, 40, 40) == 32  # as many generated as real: a generated image per real one
    assert extra_count(32, 10, 40) == 8  # ⌈32 · 10/40⌉
    assert extra_count(32, 5, 1000) == 1  # ⌈0.16⌉
    assert extra_count(32, 0, 40) == 0 and extra_count(32, 3, 1) == 3  # never more than the pool holds


def test_mix_appends_distinct_pool_rows_with_their_labels():
    x, y = torch.zeros(2, 1), torch.tensor([0, 0])
    pool_x, pool_y = torch.tensor([[1.0], [2.0], [3.0]]), torch.tensor([10, 20, 30])
    torch.manual_seed(0)
    mx, my = mix(x, y, pool_x, pool_y, 2)
    assert mx.shape == (4, 1) and torch.equal(mx[:2], x) and torch.equal(my[:2], y)
    assert len(set(mx[2:, 0].tolist())) == 2  # without replacement
    assert torch.equal(my[2:], (mx[2:, 0] * 10).long())  # each row keeps its label
    torch.manual_seed(0)
    again, _ = mix(x, y, pool_x, pool_y, 2)
    assert torch.equal(again, mx)  # the client's seeded stream decides the draw
    assert mix(x, y, pool_x, pool_y, 0)[0] is x


def test_run_generates_each_clients_classes_and_a_second_setup_reuses_them(tmp_path, tiny_sd, fmnist_root):
    cfg = config(tiny_sd, fmnist_root, tmp_path / "cache", **GEN)
    summary, _, run_dir = run_tiny(tmp_path, cfg)
    assert 0.0 <= summary["final_accuracy"] <= 1.0
    record = json.loads((run_dir / "guidance" / "feddda.json").read_text())["generated_data"]
    assert record["generated_images"] > 0
    store = SyntheticStore(run_dir / "generated_data")
    data = prepare(cfg).data
    for cid in range(4):
        held = set(torch.nonzero(data.client(cid).class_counts()).flatten().tolist())
        images = store.load(cid)
        assert set(images.labels.tolist()) == held
        assert len(images.labels) == 2 * len(held)  # per_class for every class it holds
        assert images.images.shape[1:] == (1, 28, 28)  # the dataset's own format
    ctx, method = open_run(prepare(cfg), run_dir)
    assert method.generated.setup()["generated_images"] == 0  # every chunk found: nothing regenerated


def test_local_loss_is_cross_entropy_on_the_joined_batch(tmp_path, tiny_sd, fmnist_root):
    ctx, method = open_run(prepare(config(tiny_sd, fmnist_root, tmp_path / "cache", **GEN)), tmp_path / "run",
                           setup=True)
    data = ctx.data.client(0)
    cctx = ClientContext(0, 1, data, method.server_payload(1, 0, ctx.initial_weights), {})
    state = method.begin_local(ctx.model, cctx)
    pool_x, pool_y = state
    x, y = data.x[data.indices[:8]], data.y[data.indices[:8]]
    torch.manual_seed(3)
    with torch.no_grad():
        got = method.local_loss(ctx.model, x, y, cctx, state)
    torch.manual_seed(3)
    jx, jy = mix(x, y, pool_x, pool_y, extra_count(8, len(pool_y), len(data)))
    assert len(jy) > 8
    with torch.no_grad():
        assert got.item() == pytest.approx(F.cross_entropy(ctx.model(jx), jy).item(), rel=1e-6)


def test_a_dataset_without_pixel_statistics_is_refused(tmp_path, tiny_sd):
    # 8x8 digits declare no pixel statistics: generated images could not be brought to the model's input
    cfg = tiny_config({"guidance": {"model": str(tiny_sd), "feature_cache": str(tmp_path / "c")}},
                      method={"name": "feddda", **GEN})
    with pytest.raises(ConfigError, match="pixel statistics"):
        run_tiny(tmp_path, cfg)
