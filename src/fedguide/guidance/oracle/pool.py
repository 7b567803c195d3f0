"""The labeled images the oracle learns from: the pool the embedded guidance models were pretrained on for
the run's dataset, else the run's own public pool; never another client image, never the test set.

The embedded pretraining pool is drawn exactly as ``fedguide pretrain-guidance`` drew it: the public
fraction, public seed and per-class cap recorded in the shipped models' MODEL_CARD.md (the pretraining
defaults where no card is found), applied to the run's training split of the dataset; a run that reads the
dataset with other source parameters (digits_domains' image size, say) gets the same draw of its own images
(``embedded_pretraining_draw``). A run whose own public pool differs (``data.public_fraction`` 0, or other
settings) may hand some of those images to its clients, as it does for the embedded models themselves: how
many is recorded (``clients_hold``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from fedguide.registry import ConfigError


@dataclass(frozen=True)
class OraclePool:
    indices: np.ndarray  # sorted indices into the run's training split
    source: str  # "embedded_pretraining_pool", "embedded_pretraining_draw" or "run_public_pool"
    settings: dict  # how the pool is drawn: public_fraction, public_seed, max_per_class

    @property
    def sha256(self) -> str:
        from fedguide.guidance.embedded.pretrain.data import indices_sha256

        return indices_sha256(self.indices)

    def describe(self) -> str:
        where = {"embedded_pretraining_pool": "the embedded guidance models' pretraining pool",
                 "embedded_pretraining_draw": ("this run's data drawn as the embedded models' pretraining pool "
                                               "(its source parameters differ from the pretraining's, so these are "
                                               "not the very images the embedded models saw)"),
                 "run_public_pool": "the run's public pool (data.public_fraction)"}[self.source]
        return f"{len(self.indices)} labeled images of {where}"


def embedded_pool_settings() -> dict:
    """public_fraction, public_seed and max_per_class the shipped embedded models were pretrained with."""
    return dict(_recorded_pool_settings())


@functools.lru_cache(maxsize=1)
def _recorded_pool_settings() -> tuple:
    # Read once per process: the shipped card does not change under a run.
    from fedguide.guidance.embedded import SHIPPED
    from fedguide.guidance.embedded.pretrain.card import card_settings
    from fedguide.guidance.embedded.pretrain.settings import PretrainSettings

    defaults = PretrainSettings()
    try:
        recorded = card_settings(SHIPPED)
    except ValueError:  # no shipped models: the pool their pretraining would draw
        recorded = {}
    keys = ("public_fraction", "public_seed", "max_per_class")
    return tuple((k, recorded.get(k, getattr(defaults, k))) for k in keys)


def pretraining_source(run) -> bool:
    """Whether the run reads its dataset with the parameters pretraining read it with (the source's defaults; where
    its files sit aside), so the pool's indices name the images the embedded models saw."""
    from fedguide.data.sources.base import DATASETS as SOURCES

    name = run.data_settings.name
    given = {k: v for k, v in run.data_settings.params_dict().items() if k != "root"}
    parsed = SOURCES.parse_params(name, given, "data").model_dump()
    default = SOURCES.parse_params(name, {}, "data").model_dump()
    parsed.pop("root", None)
    default.pop("root", None)
    return parsed == default


def oracle_pool(run) -> OraclePool:
    """The run's oracle pool (module docstring); a ConfigError naming the fix where there is none."""
    from fedguide.guidance.embedded.pretrain.data import pool_indices
    from fedguide.guidance.embedded.pretrain.settings import DATASETS as PRETRAINED

    name = run.data_settings.name
    labels = run.data.splits.train_y.numpy()
    if name in PRETRAINED:
        settings = embedded_pool_settings()
        indices = pool_indices(labels, settings["public_fraction"], settings["public_seed"], settings["max_per_class"])
        source = "embedded_pretraining_pool" if pretraining_source(run) else "embedded_pretraining_draw"
        return OraclePool(np.asarray(indices, dtype=np.int64), source, settings)
    public = np.sort(np.asarray(run.data.public_indices, dtype=np.int64))
    if len(public):
        settings = {"public_fraction": run.data_settings.public_fraction,
                    "public_seed": run.data_settings.public_seed, "max_per_class": None}
        return OraclePool(public, "run_public_pool", settings)
    raise ConfigError(
        f"guidance.model=oracle learns from the labeled pool the embedded guidance models were pretrained on, and "
        f"they saw none of '{name}' (only {', '.join(PRETRAINED)}); set data.public_fraction > 0 (e.g. 0.1) to "
        "hold out a public pool of this dataset for it")


def pool_note(pool: OraclePool, run) -> dict:
    """What the run's guidance record says of the pool."""
    labels = run.data.splits.train_y.numpy()
    held = [np.asarray(idx, dtype=np.int64) for idx in run.data.client_indices if len(idx)]
    clients_hold = int(len(np.intersect1d(pool.indices, np.concatenate(held)))) if held else 0
    return {"source": pool.source, "description": pool.describe(), **pool.settings,
            "images": int(len(pool.indices)),
            "per_class": np.bincount(labels[pool.indices], minlength=len(run.data.splits.class_names)).tolist(),
            "indices_sha256": pool.sha256, "clients_hold": clients_hold}
