"""The random views the embedded mini-CLIP (and the quality script's digits judge) are trained on."""
import pytest
import torch

from fedguide.guidance.embedded.augment import random_views


def digits(b=6, seed=0):
    x = torch.full((b, 3, 16, 16), -1.0)  # dark background, a bright bar of a per-image colour
    x[:, :, 4:12, 7:9] = torch.rand(b, 3, 1, 1, generator=torch.Generator().manual_seed(seed)) * 2 - 1
    return x


def test_views_are_a_pure_function_of_the_generator():
    x = digits()
    a = random_views(x, torch.Generator().manual_seed(5))
    b = random_views(x, torch.Generator().manual_seed(5))
    c = random_views(x, torch.Generator().manual_seed(6))
    assert torch.equal(a, b) and not torch.equal(a, c) and a.shape == x.shape


def test_colour_views_permute_channels_then_negate_or_grey():
    x = digits()
    inverted = random_views(x, torch.Generator().manual_seed(0), affine=False, p_invert=1.0, p_grey=0.0)
    # Every pixel's channels are the negated original channels in some order.
    torch.testing.assert_close(inverted.sort(dim=1).values, (-x).sort(dim=1).values)
    grey = random_views(x, torch.Generator().manual_seed(0), affine=False, p_invert=0.0, p_grey=1.0)
    torch.testing.assert_close(grey, x.mean(1, keepdim=True).expand_as(x))
    kept = random_views(x, torch.Generator().manual_seed(0), affine=False, p_invert=0.0, p_grey=0.0)
    torch.testing.assert_close(kept.sort(dim=1).values, x.sort(dim=1).values)


def test_pose_views_move_the_digit_and_fill_with_the_background():
    x = digits()
    same = random_views(x, torch.Generator().manual_seed(1), colour=False, max_degrees=0, max_scale=0, max_shift=0)
    torch.testing.assert_close(same, x)
    moved = random_views(x, torch.Generator().manual_seed(1), colour=False, max_degrees=90)
    assert not torch.allclose(moved, x)
    assert torch.allclose(moved[..., 0, 0], x[..., 0, 0])  # the corner stays background
    blank = torch.full((2, 3, 16, 16), 0.3)
    torch.testing.assert_close(random_views(blank, torch.Generator().manual_seed(1), colour=False), blank)


def test_grey_images_are_refused_with_the_shape_named():
    with pytest.raises(ValueError, match=r"RGB images \[B, 3, H, W\]"):
        random_views(torch.zeros(2, 1, 8, 8), torch.Generator())
