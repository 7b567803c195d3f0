"""Dataset sources, one module per family; importing this package registers every module in it."""
import importlib
import pkgutil

from fedguide.data.sources.base import DATASETS, DatasetSplits, SourceParams

__all__ = ["DATASETS", "DatasetSplits", "SourceParams"]  # the package's API

# A new module in this folder is registered without touching this file.
for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if _module != "base" and not _module.startswith("_"):
        importlib.import_module(f"{__name__}.{_module}")
