"""Methods, one module each; importing this package registers every module in it."""
import importlib
import pkgutil

from fedguide.methods.base import METHODS, ClientContext, Method, Record, RunContext, record_bytes  # noqa: F401

# One file per method: a new module in this folder is registered without touching this file.
for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if _module not in ("base", "context") and not _module.startswith("_"):
        importlib.import_module(f"{__name__}.{_module}")
