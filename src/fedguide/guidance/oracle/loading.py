"""One oracle per run data and process: from this process's memory, the run's own copy (a resumed run, a
worker process), the cache (``guidance.feature_cache``/oracle/<dataset>-<key digest>.safetensors), or trained
and written to both. ``guidance.rebuild`` trains it again unless the run already holds its copy (the
first process of the run made that one)."""
from __future__ import annotations

import json
import logging
import time
import weakref
from pathlib import Path
from typing import Optional

import torch

from fedguide.guidance.oracle import INPUT_SIDE, NAME
from fedguide.guidance.oracle.cache import key_digest, load_oracle, oracle_key, save_oracle
from fedguide.guidance.oracle.network import oracle_input
from fedguide.guidance.oracle.pool import OraclePool, oracle_pool, pool_note
from fedguide.guidance.oracle.serving import OracleGuidance
from fedguide.guidance.oracle.training import OracleSettings, TrainedOracle, train_oracle
from fedguide.registry import ConfigError

log = logging.getLogger("fedguide.guidance")
RUN_COPY = "oracle.safetensors"  # in <run>/guidance/
FEATURES = ("penultimate features f(x) of a supervised CNN at 32 px, the same for every timestep, noise draw and "
            "client condition; a class prompt adds its class prototype (the class's mean f over the pool), a prompt "
            "naming no class adds nothing; every block name a method asks for serves these as a 1 x 1 map")
ROLE = ("diagnostic upper bound, not a diffusion model: the best features the embedded models' guidance pool "
        "gives, served where the guidance model's would be")

_ORACLES: dict[tuple, tuple[OracleGuidance, TrainedOracle]] = {}


# The key of each run's oracle, by the run's id (with a reference to check it is still that run): methods look
# the oracle up per batch (a frozen image encoder's every call), and drawing the pool and hashing its indices
# each time was work repeated on that path. A run's data, pool and settings do not change under it.
# An entry leaves with its run (weakref.finalize), so a long sweep does not keep every run's pool.
_RUN_KEYS: dict[tuple, tuple[str, dict, tuple, OraclePool]] = {}


def _memo_key(cfg, run, settings: OracleSettings) -> tuple[str, dict, tuple, OraclePool]:
    """(key digest, key, this process's memo key, pool) of the run's oracle."""
    from fedguide.guidance.components import resolve_device

    lookup = (id(run), str(cfg.device), str(cfg.cache_dir()), json.dumps(settings.as_dict(), sort_keys=True))
    found = _RUN_KEYS.get(lookup)
    if found is not None:
        return found
    pool = oracle_pool(run)
    key = oracle_key(run, pool, settings)
    digest = key_digest(key)
    result = digest, key, (digest, str(resolve_device(cfg.device)), str(cfg.cache_dir())), pool
    _RUN_KEYS[lookup] = result
    weakref.finalize(run, _RUN_KEYS.pop, lookup, None)  # before another object can take the run's id
    return result


def _check(cfg, run) -> None:
    if run is None:
        raise ConfigError("guidance.model=oracle is trained on the run's labeled pool, and this caller loads it "
                          "without the run; methods that generate images cannot use it: use guidance.model=embedded "
                          "or a Stable Diffusion pipeline for them")
    if cfg.image_encoder is not None and cfg.image_encoder.lower() != "none":
        raise ConfigError(f"guidance.image_encoder={cfg.image_encoder} names an image encoder, but "
                          "guidance.model=oracle serves its own features as the image encoder; leave "
                          "guidance.image_encoder unset")


def _obtain(cfg, run, key: dict, digest: str, pool, settings: OracleSettings) -> tuple[TrainedOracle, dict]:
    """The trained oracle and where it came from (run copy, cache, trained), written where it is missing."""
    run_copy = Path(run.run_dir) / "guidance" / RUN_COPY
    cache_copy = cfg.cache_dir() / "oracle" / f"{run.data_settings.name}-{digest}.safetensors"
    t0 = time.perf_counter()
    places = [("run copy", run_copy)] + ([] if cfg.rebuild else [("cache", cache_copy)])
    for origin, path in places:
        trained = load_oracle(path, key, settings)
        if trained is not None:
            break
    else:
        origin = "trained"
        log.info("oracle: training on %s", pool.describe())
        splits = run.data.splits
        index = torch.as_tensor(pool.indices, dtype=torch.long)
        images = oracle_input(splits.unit_images(splits.train_x[index]) * 2 - 1)
        trained = train_oracle(images, splits.train_y[index], len(splits.class_names), settings)
        save_oracle(cache_copy, trained, key)
    if not run_copy.is_file() or origin != "run copy":
        save_oracle(run_copy, trained, key)
    return trained, {"origin": origin, "file": str(cache_copy), "seconds": round(time.perf_counter() - t0, 3)}


def oracle_model(cfg, run, settings: OracleSettings = OracleSettings()) -> OracleGuidance:
    """The oracle of ``run``'s data for the guidance config ``cfg``, once per process."""
    _check(cfg, run)
    digest, key, memo, pool = _memo_key(cfg, run, settings)
    if memo in _ORACLES:
        oracle, trained = _ORACLES[memo]
        run_copy = Path(run.run_dir) / "guidance" / RUN_COPY
        if not run_copy.is_file():  # another run of this process trained it: this run keeps its own copy too
            save_oracle(run_copy, trained, key)
        return oracle
    from fedguide.guidance.components import resolve_device

    trained, where = _obtain(cfg, run, key, digest, pool, settings)
    note = pool_note(pool, run)
    record = {"model": NAME, "model_id": f"{NAME}@{digest}", "role": ROLE, "features": FEATURES,
              "input_side": INPUT_SIDE, "width": settings.width, "pool": note, **trained.report,
              "settings": settings.as_dict(), **where}
    if note["clients_hold"]:
        log.warning("oracle: %d of its %d pool images are also clients' training images (the embedded models saw "
                    "them too); hold the pool out with data.public_fraction=%s data.public_seed=%s",
                    note["clients_hold"], note["images"], note["public_fraction"], note["public_seed"])
    oracle = OracleGuidance(trained, run.data.splits.class_names, record["model_id"], record,
                            resolve_device(cfg.device))
    _ORACLES[memo] = (oracle, trained)
    return oracle


def loaded_oracle(cfg, run) -> Optional[OracleGuidance]:
    """The oracle this process already holds for ``run``'s data (None: none loaded; nothing is trained)."""
    if run is None:
        return None
    try:
        _, _, memo, _ = _memo_key(cfg, run, OracleSettings())
    except ConfigError:  # no pool for this data: no oracle was loaded either
        return None
    found = _ORACLES.get(memo)
    return None if found is None else found[0]


def forget_oracles() -> None:
    """Drops this process's oracles (the next load reads the run copy or the cache, or trains)."""
    _ORACLES.clear()
    _RUN_KEYS.clear()
