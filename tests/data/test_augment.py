"""train.augment's recipes: the hand-written crop and flip against a slow reference, seeding, shapes and
range, and that they run as batched operations on the batch's device (no loop over images, no host sync)."""
from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fedguide.core.simulated import SIMULATED, SimulatedDevice
from fedguide.data.augment import PADDING, build_augment, crop_at, draw_crops

SHAPES = [(1, 28, 28), (3, 32, 32)]
RECIPES = [("crop", (1, 28, 28)), ("crop", (3, 32, 32)), ("crop_flip", (1, 28, 28)), ("crop_flip", (3, 32, 32)),
           ("autoaugment", (3, 32, 32))]
SYNCING = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "is_nonzero", "equal", "allclose",
           "repeat_interleave")


def reference(image: torch.Tensor, dy: int, dx: int, flip: bool) -> torch.Tensor:
    """One image [C, H, W]: pad PADDING px of zeros, cut H x W at (dy, dx), mirror left-right if asked."""
    c, h, w = image.shape
    padded = torch.zeros(c, h + 2 * PADDING, w + 2 * PADDING, dtype=image.dtype)
    padded[:, PADDING:PADDING + h, PADDING:PADDING + w] = image
    out = padded[:, dy:dy + h, dx:dx + w]
    return out.flip(-1) if flip else out


def images(n: int, shape: tuple[int, ...], seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    return torch.rand((n, *shape), generator=torch.Generator().manual_seed(seed), dtype=dtype)


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def ops_of(fn, x: torch.Tensor, seed: int = 0) -> collections.Counter:
    torch.manual_seed(seed)
    with CountOps() as count:
        fn(x)
    return count.ops


# ---- the crop is the reference's crop ------------------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_crop_at_equals_pad_cut_and_mirror_on_hand_picked_offsets(shape, dtype):
    top = 2 * PADDING
    picks = [(0, 0, False), (0, 0, True), (top, top, False), (top, top, True), (PADDING, PADDING, False),
             (PADDING, PADDING, True), (0, top, False), (top, 0, True), (1, 7, False), (6, 2, True)]
    x = images(len(picks), shape, dtype=dtype)
    dy, dx, flip = (torch.tensor(v) for v in zip(*picks))
    out = crop_at(x, dy, dx, flip)
    for b, (y, xx, f) in enumerate(picks):
        assert torch.equal(out[b], reference(x[b], y, xx, f)), (y, xx, f)
    # the centre crop without a flip is the image itself; without flips the mirrored ones are plain crops
    assert torch.equal(out[4], x[4])
    plain = crop_at(x, dy, dx)
    assert all(torch.equal(plain[b], reference(x[b], y, xx, False)) for b, (y, xx, _) in enumerate(picks))


@pytest.mark.parametrize("name,shape", [r for r in RECIPES if r[0] != "autoaugment"])
def test_recipes_crop_at_the_offsets_they_draw(name, shape):
    x = images(48, shape)
    torch.manual_seed(5)
    out = build_augment(name, shape)(x)
    torch.manual_seed(5)
    dy, dx, flip = draw_crops(len(x), x.device, name == "crop_flip")
    assert (flip is None) == (name == "crop")
    for b in range(len(x)):
        mirrored = bool(flip[b]) if flip is not None else False
        assert torch.equal(out[b], reference(x[b], int(dy[b]), int(dx[b]), mirrored))


def test_offsets_cover_every_shift_and_flips_are_about_half():
    torch.manual_seed(0)
    dy, dx, flip = draw_crops(20000, torch.device("cpu"), True)
    span = 2 * PADDING + 1
    for d in (dy, dx):
        counts = torch.bincount(d, minlength=span)
        assert len(counts) == span and counts.min() > 0.8 * 20000 / span and counts.max() < 1.2 * 20000 / span
    assert 0.47 < flip.float().mean().item() < 0.53
    # offsets and flips are drawn independently of one another
    for part in (flip[dy == 0], flip[dx == 2 * PADDING]):
        assert 0.44 < part.float().mean().item() < 0.56


@pytest.mark.parametrize("shape", SHAPES)
def test_crop_flip_mirrors_about_half_of_a_large_batch_and_crop_none(shape):
    c, h, w = shape
    ramp = torch.arange(1, w + 1, dtype=torch.float32) / (w + 1)  # brighter to the right
    x = ramp.expand(4096, c, h, w).contiguous()
    torch.manual_seed(1)
    out = build_augment("crop_flip", shape)(x)
    mirrored = out[:, 0, h // 2, w // 2 - 1] > out[:, 0, h // 2, w // 2 + 1]  # centre columns are never padding
    assert 0.45 < mirrored.float().mean().item() < 0.55
    torch.manual_seed(1)
    out = build_augment("crop", shape)(x)
    assert not (out[:, 0, h // 2, w // 2 - 1] > out[:, 0, h // 2, w // 2 + 1]).any()


# ---- shapes, range, seeding ----------------------------------------------------------------------

@pytest.mark.parametrize("name,shape", RECIPES)
def test_recipes_keep_shape_dtype_and_range(name, shape):
    x = images(16, shape)
    x[0] = 1.0  # the edges of the range stay inside it
    x[1] = 0.0
    torch.manual_seed(0)
    out = build_augment(name, shape)(x)
    assert out.shape == x.shape and out.dtype == x.dtype and out.device == x.device
    assert out.min() >= 0 and out.max() <= 1
    assert not torch.equal(out, x)


def test_crop_keeps_double_precision():
    x = images(8, (3, 32, 32), dtype=torch.float64)
    out = build_augment("crop_flip", (3, 32, 32))(x)
    assert out.dtype == torch.float64 and out.shape == x.shape


def test_none_is_no_augmentation():
    assert build_augment("none", (3, 32, 32)) is None


@pytest.mark.parametrize("name,shape", RECIPES)
def test_one_seed_augments_alike_and_another_differs(name, shape):
    x = images(32, shape)
    augment = build_augment(name, shape)
    runs = {}
    for seed in (3, 3, 4):
        torch.manual_seed(seed)
        runs.setdefault(seed, []).append(augment(x))
    assert torch.equal(runs[3][0], runs[3][1])
    assert not torch.equal(runs[3][0], runs[4][0])
    # a fresh build (another worker, a resumed run) draws the same
    torch.manual_seed(3)
    assert torch.equal(build_augment(name, shape)(x), runs[3][0])


def test_the_input_is_left_untouched():
    x = images(8, (3, 32, 32))
    before = x.clone()
    build_augment("autoaugment", (3, 32, 32))(x)
    assert torch.equal(x, before)


# ---- batched, on the batch's device --------------------------------------------------------------

@pytest.mark.parametrize("name,shape", [r for r in RECIPES if r[0] != "autoaugment"])
def test_operation_count_does_not_grow_with_the_batch(name, shape):
    augment = build_augment(name, shape)
    small, large = ops_of(augment, images(2, shape)), ops_of(augment, images(256, shape))
    assert small == large
    assert sum(small.values()) < 30
    assert sum(small[op] for op in small if "randint" in op) == 1  # every draw in one operation
    assert not [op for op in small if any(s in op for s in SYNCING)]


def test_autoaugment_policy_is_batched_per_sub_policy():
    """kornia's policy picks one sub-policy per call; each one runs the same operations whatever the batch."""
    from kornia.augmentation.auto import AutoAugment

    policy = AutoAugment("imagenet")
    for k in range(len(policy)):
        policy.rand_selector.sample = lambda shape, k=k: torch.tensor([k])
        small = ops_of(policy, images(2, (3, 32, 32)))
        large = ops_of(policy, images(64, (3, 32, 32)))
        assert sum(small.values()) == sum(large.values()), k


@pytest.mark.parametrize("name,shape", RECIPES)
def test_recipes_run_on_the_simulated_device_without_host_syncs(name, shape):
    augment = build_augment(name, shape)
    with SimulatedDevice() as sim:
        x = sim.put(images(16, shape))
        assert x.device == SIMULATED
        torch.manual_seed(0)
        out = augment(x)
        assert out.device == SIMULATED and sim.on_device(out)
        assert sim.counters.host_syncs == 0
        if name != "autoaugment":  # kornia draws AutoAugment's gates and magnitudes on the host and copies them
            assert sim.counters.h2d_bytes == 0


# ---- in a run ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["crop_flip", "autoaugment"])
def test_a_run_augmenting_on_the_simulated_device_repeats_the_cpu_run_without_per_step_syncs(tmp_path, name):
    from tests.tiny import run_tiny, tiny_config

    base = {"data": {"name": "standin", "like": "cifar10", "scale": 0.002}, "model": {"name": "cnn"},
            "train": {"rounds": 2, "augment": name}}
    _, cpu_rows, _ = run_tiny(tmp_path, tiny_config(base, {"train": {"device": "cpu"}}), "cpu")
    sim, sim_rows, _ = run_tiny(tmp_path, tiny_config(base, {"train": {"device": "simulated"}}), "sim")
    # The device keeps the images as uint8 (the host as the source's floats), so the values agree to rounding.
    assert [r["clients"] for r in sim_rows] == [r["clients"] for r in cpu_rows]
    assert [r["loss"] for r in sim_rows] == pytest.approx([r["loss"] for r in cpu_rows], rel=1e-3)
    check = sim["device_check"]
    assert check["mixes"] == 0 and check["steps"] > 0 and check["host_syncs_per_step"] == 0
    if name == "crop_flip":  # AutoAugment's draws come from the host (see fedguide.data.augment)
        assert check["h2d_bytes_per_step"] == 0
    else:
        assert check["h2d_bytes_per_step"] > 0
