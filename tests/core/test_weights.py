"""Models as flat vectors: flatten/load round trips, integer buffers, the parameter mask."""
import pytest
import torch
from torch import nn

from fedguide.core.weights import WeightLayout


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 3, 3),
        nn.BatchNorm2d(3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(3 * 4 * 4, 5),
        nn.BatchNorm1d(5),
    )


def n_buffer_elements(model: nn.Module) -> int:
    return sum(b.numel() for b in model.buffers())


def n_param_elements(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_layout_matches_state_dict():
    model = make_model()
    layout = WeightLayout.of(model)
    sd = model.state_dict()
    assert layout.names == tuple(sd)
    assert layout.numel == sum(t.numel() for t in sd.values())
    assert layout.numel == n_param_elements(model) + n_buffer_elements(model)
    assert torch.int64 in layout.dtypes  # num_batches_tracked


def test_flatten_is_float32_of_right_length():
    model = make_model()
    layout = WeightLayout.of(model)
    vec = layout.flatten(model)
    assert vec.dtype == torch.float32 and vec.dim() == 1 and vec.numel() == layout.numel


def test_round_trip_with_batchnorm_buffers():
    src = make_model(seed=0)
    # Give the BN buffers non-default values: a training pass updates running stats and counters.
    src.train()
    for _ in range(3):
        src(torch.randn(4, 1, 6, 6))
    src[1].num_batches_tracked.fill_(7)
    layout = WeightLayout.of(src)
    vec = layout.flatten(src)

    dst = make_model(seed=1)
    assert not torch.equal(layout.flatten(dst), vec), "the fresh model must start different"
    layout.load(dst, vec)

    assert dst[1].num_batches_tracked.item() == 7
    assert dst[1].num_batches_tracked.dtype == torch.int64
    assert dst[5].num_batches_tracked.item() == 3
    for (name, a), b in zip(src.state_dict().items(), dst.state_dict().values()):
        assert a.dtype == b.dtype, name
        assert torch.equal(a, b), name
    assert torch.equal(layout.flatten(dst), vec)


def test_load_rounds_integer_buffers():
    model = make_model()
    layout = WeightLayout.of(model)
    vec = layout.flatten(model)
    # Averaging can leave a counter at e.g. 6.6; it is rounded, not truncated.
    offset = 0
    for name, shape in zip(layout.names, layout.shapes):
        n = int(torch.Size(shape).numel())
        if name == "1.num_batches_tracked":
            vec[offset] = 6.6
        offset += n
    layout.load(model, vec)
    assert model[1].num_batches_tracked.item() == 7


def test_load_is_in_place():
    model = make_model()
    weight = model[0].weight
    layout = WeightLayout.of(model)
    layout.load(model, torch.zeros(layout.numel))
    assert model[0].weight is weight
    assert torch.count_nonzero(model[0].weight) == 0


def test_loaded_model_computes_same_outputs():
    src, dst = make_model(0), make_model(1)
    layout = WeightLayout.of(src)
    layout.load(dst, layout.flatten(src))
    src.eval(), dst.eval()
    x = torch.randn(2, 1, 6, 6)
    assert torch.equal(src(x), dst(x))


@pytest.mark.parametrize("delta", [-1, 1])
def test_wrong_length_raises(delta):
    model = make_model()
    layout = WeightLayout.of(model)
    with pytest.raises(ValueError, match=str(layout.numel)):
        layout.load(model, torch.zeros(layout.numel + delta))


def test_parameter_mask_false_exactly_on_buffers():
    model = make_model()
    layout = WeightLayout.of(model)
    mask = layout.parameter_mask(model)
    assert mask.dtype == torch.bool and mask.numel() == layout.numel
    assert int((~mask).sum()) == n_buffer_elements(model)
    assert int(mask.sum()) == n_param_elements(model)
    # The masked entries of the flat vector are exactly the parameters, in order.
    vec = layout.flatten(model)
    params = torch.cat([p.detach().reshape(-1) for _, p in model.named_parameters()])
    assert torch.equal(vec[mask], params)


def test_parameter_mask_without_buffers_is_all_true():
    model = nn.Linear(3, 2)
    mask = WeightLayout.of(model).parameter_mask(model)
    assert mask.all() and mask.numel() == 8
