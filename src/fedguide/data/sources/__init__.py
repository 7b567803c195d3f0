"""Dataset sources, one module per family; importing this package registers them all."""
from fedguide.data.sources.base import DATASETS, DatasetSplits, SourceParams  # noqa: F401
from fedguide.data.sources import digits, fmnist  # noqa: F401
