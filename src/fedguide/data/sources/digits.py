"""scikit-learn's 8x8 handwritten digits: tiny, always available offline, for quick tests."""
from __future__ import annotations

import numpy as np
import torch

from fedguide.data.sources.base import DATASETS, DatasetSplits, SourceParams

TEST_FRACTION = 0.2
SPLIT_SEED = 0  # fixed, so every run of every seed evaluates on the same test images


@DATASETS.register("digits", params=SourceParams, summary="scikit-learn 8x8 digits, 10 classes (1797 images)")
def load_digits(params: SourceParams) -> DatasetSplits:
    from sklearn.datasets import load_digits as sk_load
    from sklearn.model_selection import train_test_split

    bunch = sk_load()
    images = (bunch.images / 16.0).astype(np.float32)  # pixel values are 0..16
    images = (images - images.mean()) / images.std()
    tr_x, te_x, tr_y, te_y = train_test_split(
        images, bunch.target, test_size=TEST_FRACTION, stratify=bunch.target, random_state=SPLIT_SEED
    )
    return DatasetSplits(
        train_x=torch.from_numpy(np.ascontiguousarray(tr_x)).unsqueeze(1),
        train_y=torch.from_numpy(tr_y.astype(np.int64)),
        test_x=torch.from_numpy(np.ascontiguousarray(te_x)).unsqueeze(1),
        test_y=torch.from_numpy(te_y.astype(np.int64)),
        class_names=[str(d) for d in range(10)],
    )
