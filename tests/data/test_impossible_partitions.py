"""Partitions that cannot be made as asked are refused with the numbers, not made with empty clients."""
import numpy as np
import pytest

from fedguide.data.partition import ShardsParams, shards
from fedguide.registry import ConfigError


def test_more_shards_than_samples_is_refused_with_the_numbers():
    labels = np.repeat(np.arange(3), 5)  # 15 samples
    with pytest.raises(ConfigError, match=r"8 clients x k=2 = 16 shards, but only 15 training samples"):
        shards(labels, 8, ShardsParams(k=2), np.random.default_rng(0))
    parts = shards(labels, 5, ShardsParams(k=3), np.random.default_rng(0))  # 15 shards of one sample each
    assert sorted(len(p) for p in parts) == [3] * 5
