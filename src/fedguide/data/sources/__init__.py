"""Dataset sources, one module per family; ``DATASETS`` discovers every public module in this package at its
first lookup (a new module is registered without touching this file)."""
from fedguide.data.sources._files import no_downloads
from fedguide.data.sources.base import DATASETS, DatasetSplits, SourceParams

__all__ = ["DATASETS", "DatasetSplits", "SourceParams", "no_downloads"]  # the package's API
