"""Weighted averaging of flat weight vectors."""
import itertools

import pytest
import torch

from fedguide.core.aggregation import sample_weighted_average, weighted_average


def test_hand_computed_sample_weighted_average():
    out = sample_weighted_average([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0])], [1, 3])
    # (1*[1,2] + 3*[3,6]) / 4 = [10, 20] / 4
    assert torch.equal(out, torch.tensor([2.5, 5.0]))


def test_hand_computed_three_clients():
    vecs = [torch.tensor([0.0, 10.0]), torch.tensor([4.0, 0.0]), torch.tensor([8.0, -2.0])]
    out = weighted_average(vecs, [2.0, 1.0, 1.0])
    # ([0,20] + [4,0] + [8,-2]) / 4
    assert torch.allclose(out, torch.tensor([3.0, 4.5]))


def test_equal_weights_is_mean_and_scale_invariant():
    vecs = [torch.randn(17, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    mean = torch.stack(vecs).mean(0)
    assert torch.allclose(weighted_average(vecs, [1, 1, 1, 1]), mean, atol=1e-6)
    assert torch.allclose(weighted_average(vecs, [5, 5, 5, 5]), mean, atol=1e-6)


def test_zero_weight_client_is_ignored():
    out = weighted_average([torch.tensor([1.0]), torch.tensor([100.0])], [2, 0])
    assert torch.equal(out, torch.tensor([1.0]))


def test_single_client_returns_its_vector():
    v = torch.tensor([1.5, -2.0, 3.25])
    assert torch.equal(sample_weighted_average([v], [42]), v)


def test_order_independent_up_to_tolerance():
    g = torch.Generator().manual_seed(0)
    vecs = [torch.randn(1000, generator=g) * 10 for _ in range(4)]
    weights = [3, 17, 1, 250]
    ref = sample_weighted_average(vecs, weights)
    for perm in itertools.permutations(range(4)):
        out = sample_weighted_average([vecs[i] for i in perm], [weights[i] for i in perm])
        assert torch.allclose(out, ref, rtol=1e-6, atol=1e-6)


def test_same_order_is_bitwise_reproducible():
    g = torch.Generator().manual_seed(1)
    vecs = [torch.randn(500, generator=g) for _ in range(5)]
    a = sample_weighted_average(vecs, [1, 2, 3, 4, 5])
    b = sample_weighted_average([v.clone() for v in vecs], [1, 2, 3, 4, 5])
    assert torch.equal(a, b)


def test_keeps_dtype_and_shape_and_inputs():
    vecs = [torch.ones(3, dtype=torch.float32), torch.zeros(3, dtype=torch.float32)]
    before = [v.clone() for v in vecs]
    out = weighted_average(vecs, [1, 1])
    assert out.dtype == torch.float32 and out.shape == (3,)
    assert all(torch.equal(v, b) for v, b in zip(vecs, before)), "inputs must not be modified"


def test_accumulates_in_float64():
    # 1e8 + 1 is not representable in float32; a float32 accumulator would lose the 1s.
    big = torch.tensor([1e8], dtype=torch.float64)
    one = torch.tensor([1.0], dtype=torch.float64)
    out = weighted_average([big, one, one], [1, 1, 1])
    assert out.dtype == torch.float64
    assert out.item() == pytest.approx((1e8 + 2) / 3, rel=1e-15)


@pytest.mark.parametrize("weights", [[0, 0], [0.0, 0.0], [-1, 2], [1, -0.5]])
def test_bad_weights_raise(weights):
    with pytest.raises(ValueError, match="non-negative"):
        weighted_average([torch.ones(2), torch.ones(2)], weights)


@pytest.mark.parametrize("weights", [[1], [1, 2, 3]])
def test_mismatched_lengths_raise(weights):
    with pytest.raises(ValueError, match="2 vectors"):
        weighted_average([torch.ones(2), torch.ones(2)], weights)


def test_empty_raises():
    with pytest.raises(ValueError, match="zero client updates"):
        weighted_average([], [])
    with pytest.raises(ValueError):
        sample_weighted_average([], [])
