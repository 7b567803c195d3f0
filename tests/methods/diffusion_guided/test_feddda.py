"""FedDDA as released (ZhZhuang/FedDDA, Fed_classifier/): how many images of each class a client gets (``add:
lack``, utils.py L616-650 ``get_lackdata_idx``; ``add: random``, utils.py L598-605 ``get_data_random_idx`` with
common.py L190-209), one shuffled pass over real + generated (core_feddiffusion.py L101-108) and FedAvg weighted by
real + generated (core_feddiffusion.py L102, L116-122), on hand-computed numbers; then runs on a tiny
Stable-Diffusion-layout pipeline. FedRCL ◇'s amounts (its own images of the classes a client holds) are here too."""
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedguide.data.federated import ClientData
from fedguide.fl.setup import open_run, prepare
from fedguide.methods import ClientContext
from fedguide.methods._synthetic import SyntheticStore
from fedguide.methods.diffusion_guided._generated_data import (JoinedFeed, extra_count, held_counts, interleaved,
                                                              lack_counts, mix, per_class_count, random_counts,
                                                              reference_pool_per_class)
from fedguide.registry import ConfigError
from tests.tiny import run_tiny, tiny_config

# tiny_sd and fmnist_root (60 training images of horizontal bands): conftest.py
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py
SAMPLER = {"steps": 1, "cfg_scale": 1.0, "gen_batch_size": 16}  # one UNet pass per sampler batch
HELD = {"per_class": 2, **SAMPLER}  # FedRCL ◇'s settings

# Three clients' label histograms over four classes (n = 60, 25 and 40).
HIST = np.array([[50, 3, 0, 7],
                 [0, 0, 0, 25],
                 [10, 10, 10, 10]])


def config(tiny_sd, fmnist_root, cache, method="feddda", **params):
    return tiny_config({"data": {"name": "fmnist", "root": str(fmnist_root)},
                        "guidance": {"model": str(tiny_sd), "feature_cache": str(cache)}, "train": {"rounds": 2}},
                       method={"name": method, **SAMPLER, **params})


def test_lack_fills_each_class_under_n_over_div_up_to_it_from_a_finite_pool():
    """utils.py L632-649: mean = Σ dtbs[i] // div; lack = mean − dtbs[i][j] where positive, taken from what the
    class's pool has left (L639-641), clients in order.
    Client 0: mean ⌊60/10⌋ = 6 → class 1: 6 − 3 = 3, class 2: 6 − 0 = 6, classes 0 and 3 are above 6.
    Client 1: mean ⌊25/10⌋ = 2 → classes 0, 1, 2: 2 each; but class 2's pool of 7 has 7 − 6 = 1 left: 1.
    Client 2: mean 4, every class holds 10: nothing."""
    got = lack_counts(HIST, div=10, pool_per_class=7)
    assert got.tolist() == [[0, 3, 6, 0], [2, 2, 1, 0], [0, 0, 0, 0]]
    assert (HIST + got).tolist() == [[50, 6, 6, 7], [2, 2, 1, 25], [10, 10, 10, 10]]
    # a pool large enough: every class reaches ⌊n_k / div⌋ (client 1's class 2 gets its 2)
    assert lack_counts(HIST, div=10, pool_per_class=100)[1].tolist() == [2, 2, 2, 0]
    # div 2 (the reference's other setting): client 2's mean is 20, each class lacks 10
    assert lack_counts(HIST, div=2, pool_per_class=100)[2].tolist() == [10, 10, 10, 10]


def test_random_hands_client_k_the_kth_slice_of_the_class_balanced_pool():
    """utils.py L599-604: num_items = ⌊len(dataset) / num_users⌋ images per slice, drawn without replacement;
    common.py L200-209: client i gets slice i. Pool: 3 classes x 4 = 12 images."""
    rng = np.random.default_rng(0)
    got = random_counts(num_clients=2, num_classes=3, pool_per_class=4, n_block=5, rng=rng)
    assert got.sum(1).tolist() == [2, 2]  # ⌊12 / 5⌋ each
    assert (got.sum(0) <= 4).all()  # without replacement: no class gives more than its 4
    whole = random_counts(1, 3, 4, 1, np.random.default_rng(1))
    assert whole.tolist() == [[4, 4, 4]]  # one slice is the whole pool, balanced
    three = random_counts(3, 3, 4, 3, np.random.default_rng(2))
    assert three.sum(0).tolist() == [4, 4, 4] and three.sum(1).tolist() == [4, 4, 4]  # 3 slices cover the pool
    again = random_counts(2, 3, 4, 5, np.random.default_rng(0))
    assert np.array_equal(again, got)  # the seed decides the slices
    with pytest.raises(ConfigError, match="method.n_block 2 is below the number of clients 3"):
        random_counts(3, 3, 4, 2, np.random.default_rng(0))


def test_the_reference_pool_is_twice_the_training_samples_per_class():
    # fed-ddim-main/runners/diffusion.py L264: 12 000 per class for Fashion-MNIST's 6 000, 10 000 for CIFAR-10's 5 000
    assert reference_pool_per_class(HIST) == 2 * (125 // 4)
    assert reference_pool_per_class(np.full((10, 10), 600)) == 12_000


def test_fedrcl_held_amounts():
    assert per_class_count(10, 3, "match") == 4  # ⌈10 / 3⌉ per class: at least as many as the real images
    assert per_class_count(10, 3, 7) == 7
    assert held_counts(HIST, "match").tolist() == [[20, 20, 0, 20], [0, 0, 0, 25], [10, 10, 10, 10]]
    assert held_counts(HIST, 2).tolist() == [[2, 2, 0, 2], [0, 0, 0, 2], [2, 2, 2, 2]]
    assert extra_count(32, 40, 40) == 32  # as many generated as real: a generated image per real one
    assert extra_count(32, 10, 40) == 8  # ⌈32 · 10/40⌉
    assert extra_count(32, 5, 1000) == 1  # ⌈0.16⌉
    assert extra_count(32, 0, 40) == 0 and extra_count(32, 3, 1) == 3  # never more than the pool holds


def test_interleaved_labels_take_turns():
    assert interleaved([0, 3, 1, 2]) == [1, 2, 3, 1, 3, 1]
    assert interleaved([2, 0, 2]) == [0, 2, 0, 2]  # equal counts: the round robin of the held classes


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


class FakeDeviceData:
    """DeviceData's interface as the local loop uses it. Pixel statistics (mean 0.5, std 0.5) and an augmentation of
    unit pixels u -> 1 - u: a stored value v is the pixel 0.5 v + 0.5, augmented 0.5 - 0.5 v, standardised back -v,
    which is what its batches of real samples give."""

    device = torch.device("cpu")
    augment = staticmethod(lambda u: 1 - u)

    def __init__(self, x, y):
        self.x, self.y = x, y

    def indices(self, idx):
        return idx

    def train_batch(self, idx):
        return -self.x[idx], self.y[idx]


def test_a_joined_batch_keeps_real_and_generated_rows_in_the_shuffled_order():
    """Host indices below the training set's size are real samples, offset + j the j-th generated image; each row
    of the batch is the sample at its place, the generated ones augmented as the real ones."""
    train_x, train_y = torch.arange(6.0).view(6, 1, 1, 1), torch.arange(6)
    data = ClientData(0, torch.tensor([1, 2, 5]), train_x, train_y, 10)
    pool_x, pool_y = torch.tensor([100.0, 200.0]).view(2, 1, 1, 1), torch.tensor([7, 8])
    idx = torch.tensor([6 + 1, 2, 6 + 0, 5])
    host = JoinedFeed(ClientContext(0, 1, data, {}, {}), pool_x, pool_y, 6, None)
    x, y = host.train_batch(host.indices(idx))
    assert x.flatten().tolist() == [200.0, 2.0, 100.0, 5.0] and y.tolist() == [8, 2, 7, 5]
    base = FakeDeviceData(train_x, train_y)
    feed = JoinedFeed(ClientContext(0, 1, data, {}, {}, device_data=base), pool_x, pool_y, 6, ([0.5], [0.5]))
    x, y = feed.train_batch(feed.indices(idx))
    assert x.flatten().tolist() == [-200.0, -2.0, -100.0, -5.0] and y.tolist() == [8, 2, 7, 5]
    assert feed.train_batch(torch.tensor([6 + 0]))[0].flatten().tolist() == [-100.0]  # a batch of generated only
    assert feed.train_batch(torch.tensor([1]))[0].flatten().tolist() == [-1.0]  # of real only


def test_lack_run_fills_every_clients_classes_and_weights_fedavg_by_real_plus_generated(tmp_path, tiny_sd,
                                                                                          fmnist_root):
    cfg = config(tiny_sd, fmnist_root, tmp_path / "cache", add="lack")
    summary, _, run_dir = run_tiny(tmp_path, cfg)
    assert 0.0 <= summary["final_accuracy"] <= 1.0
    record = json.loads((run_dir / "guidance" / "feddda.json").read_text())["generated_data"]
    hist = record["histograms"]
    real, added, after = (np.array(hist[k]) for k in ("real", "generated", "after"))
    data = prepare(cfg).data
    store = SyntheticStore(run_dir / "generated_data")
    assert record["pool_per_class"] == reference_pool_per_class(real) and record["add"] == "lack"
    assert np.array_equal(added, lack_counts(real, 10, record["pool_per_class"])) and added.sum() > 0
    for cid in range(4):
        assert real[cid].tolist() == data.client(cid).class_counts().tolist()
        assert (after[cid] >= real[cid].sum() // 10).all()  # every class filled up to ⌊n_k/10⌋ (the pool suffices)
        assert (added[cid][real[cid] >= real[cid].sum() // 10] == 0).all()  # and no class already there
        images = store.load(cid)
        got = np.bincount(images.labels.numpy(), minlength=10) if images is not None else np.zeros(10, int)
        assert got.tolist() == added[cid].tolist()
    ctx, method = open_run(prepare(cfg), run_dir)
    assert method.generated.setup()["generated_images"] == 0  # every chunk found: nothing regenerated

    # one round of a client: one shuffled pass over real + generated, its upload weighted by both
    cid = int(np.argmax(added.sum(1)))
    n, g = int(real[cid].sum()), int(added[cid].sum())
    cctx = ClientContext(cid, 1, ctx.data.client(cid), method.server_payload(1, cid, ctx.initial_weights), {},
                         generator=torch.Generator().manual_seed(0), device_data=ctx.device_data)
    ctx.layout.load(ctx.model, ctx.initial_weights)
    loss, state = method.fit(ctx.model, cctx, ctx.train)
    assert cctx.steps == math.ceil((n + g) / ctx.train.batch_size) * ctx.train.epochs
    upload = method.client_upload(ctx.model, cctx, state)
    assert upload["num_samples"] == n + g
    # FedAvg: weights ∝ real + generated. Client A: 3 real + 5 generated, weights 1; B: 6 real, weights 5:
    # (8·1 + 6·5) / 14 = 38/14, where real counts alone would give (3 + 30)/9.
    agg = method.aggregate(1, ctx.initial_weights, [{"weights": torch.ones(2), "num_samples": 3 + 5},
                                                    {"weights": torch.full((2,), 5.0), "num_samples": 6}])
    assert torch.allclose(agg, torch.full((2,), 38 / 14))


def test_random_run_gives_each_client_a_slice_of_the_pool(tmp_path, tiny_sd, fmnist_root, capsys):
    cfg = config(tiny_sd, fmnist_root, tmp_path / "cache", pool_per_class=2)
    summary, _, run_dir = run_tiny(tmp_path, cfg)
    # the generation says how far it is, client by client, chunk by chunk (hours on a CPU at full scale)
    said = capsys.readouterr().err
    assert all(f"synthetic: client {c} chunk 1/1: 5 images in" in said for c in range(4))
    assert said.count("sampling: 5/5") == 4
    record = json.loads((run_dir / "guidance" / "feddda.json").read_text())["generated_data"]
    assert record["add"] == "random" and record["pool_per_class"] == 2
    assert record["per_client"] == {str(c): 5 for c in range(4)}  # ⌊10 classes · 2 / 4 slices⌋
    assert np.array(record["histograms"]["generated"]).sum(0).max() <= 2


def test_local_steps_are_cross_entropy_on_batches_of_the_joined_set(tmp_path, tiny_sd, fmnist_root):
    ctx, method = open_run(prepare(config(tiny_sd, fmnist_root, tmp_path / "cache", add="lack")),
                           tmp_path / "run", setup=True)
    cid = next(c for c in range(4) if len(method.generated.pool(c, torch.device("cpu"))[1]))
    cctx = ClientContext(cid, 1, ctx.data.client(cid), {}, {})
    joined = method.generated.joined(cctx)
    pool_x, pool_y = method.generated.pool(cid, torch.device("cpu"))
    assert len(joined.data) == len(cctx.data) + len(pool_y)
    offset = len(ctx.data.splits.train_y)
    assert joined.data.indices[len(cctx.data):].tolist() == list(range(offset, offset + len(pool_y)))
    x, y = joined.device_data.train_batch(joined.data.indices)
    assert torch.equal(y[len(cctx.data):], pool_y) and torch.allclose(x[len(cctx.data):], pool_x)
    with torch.no_grad():
        assert method.local_loss(ctx.model, x, y, joined, None).item() == pytest.approx(
            F.cross_entropy(ctx.model(x), y).item(), rel=1e-6)


def test_too_few_slices_are_refused_when_the_method_is_built(tmp_path, tiny_sd, fmnist_root):
    with pytest.raises(ConfigError, match="method.n_block 3 is below the number of clients 4"):
        open_run(prepare(config(tiny_sd, fmnist_root, tmp_path / "cache", n_block=3)), tmp_path / "run")
    with pytest.raises(ConfigError, match="per_class"):  # FedRCL ◇'s amount is not FedDDA's: refused, not ignored
        prepare(config(tiny_sd, fmnist_root, tmp_path / "cache", per_class=2))


def test_a_dataset_without_pixel_statistics_is_refused(tmp_path, tiny_sd):
    # 8x8 digits declare no pixel statistics: generated images could not be brought to the model's input
    cfg = tiny_config({"guidance": {"model": str(tiny_sd), "feature_cache": str(tmp_path / "c")}},
                      method={"name": "feddda", **SAMPLER})
    with pytest.raises(ConfigError, match="pixel statistics"):
        run_tiny(tmp_path, cfg)


def test_a_joined_order_is_split_from_host_indices_only():
    """The split reads the order (counts, positions): on a device tensor that would be a sync, so it is refused."""
    from fedguide.methods.diffusion_guided._generated_data import JoinedOrder

    with pytest.raises(ValueError, match="host indices"):
        JoinedOrder(torch.zeros(3, dtype=torch.long, device="meta"), 6, lambda i: i, torch.device("cpu"))
    order = JoinedOrder(torch.tensor([7, 2, 6, 5]), 6, lambda i: i, torch.device("cpu"))
    batch = order[1:3]  # rows 2 (real) and 6 (generated 0)
    assert (batch.r0, batch.r1, batch.g0, batch.g1) == (0, 1, 1, 2)
    assert order.real[batch.r0: batch.r1].tolist() == [2] and order.gen[batch.g0: batch.g1].tolist() == [0]
