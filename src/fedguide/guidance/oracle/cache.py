"""The oracle on disk: one sealed safetensors file per key (core/sealed.py), its weights, class prototypes,
the key it was trained under and its training report.

The key holds everything the network depends on: the dataset and its source parameters (not where its
files sit), the class names, the input size, how the pool was drawn and the sha256 of its indices, and
every training setting. The file name carries the key's digest; a file whose stored key differs, or that
fails its seal (a changed byte), is never used: the oracle is trained again and the file replaced.
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Optional

from fedguide.core.sealed import Unverified, load_sealed, save_sealed
from fedguide.guidance.oracle import INPUT_SIDE
from fedguide.guidance.oracle.network import OracleNet
from fedguide.guidance.oracle.pool import OraclePool
from fedguide.guidance.oracle.training import OracleSettings, TrainedOracle

log = logging.getLogger("fedguide.guidance")
KEY, REPORT = "key", "report"
NET = "net."
PROTOTYPES = "prototypes"
VERSION = 1


def oracle_key(run, pool: OraclePool, settings: OracleSettings) -> dict:
    data = run.data_settings
    return {"kind": "oracle", "version": VERSION, "dataset": data.name,
            "data": {k: v for k, v in data.params_dict().items() if k != "root"},
            "class_names": list(run.data.splits.class_names), "input_side": INPUT_SIDE,
            "pool": {"source": pool.source, **pool.settings, "images": int(len(pool.indices)),
                     "indices_sha256": pool.sha256},
            "settings": settings.as_dict()}


def key_text(key: dict) -> str:
    return json.dumps(key, sort_keys=True, default=str)


def key_digest(key: dict) -> str:
    return hashlib.sha256(key_text(key).encode()).hexdigest()[:16]


def save_oracle(path: Path, trained: TrainedOracle, key: dict) -> None:
    tensors = {NET + k: v.detach().cpu().contiguous() for k, v in trained.net.state_dict().items()}
    tensors[PROTOTYPES] = trained.prototypes.detach().cpu().contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_sealed(path, tensors, {KEY: key_text(key), REPORT: json.dumps(trained.report, sort_keys=True)})


def load_oracle(path: Path, key: dict, settings: OracleSettings) -> Optional[TrainedOracle]:
    """The oracle stored at ``path`` under ``key``; None when there is none, it was stored under another key, or
    it fails its seal (said as a warning)."""
    if not path.is_file():
        return None
    try:
        opened = load_sealed(path, frozenset({KEY, REPORT}))
    except Unverified as err:
        log.warning("the cached oracle %s cannot be trusted (%s); training it again", path, err.reason)
        return None
    if opened.metadata.get(KEY) != key_text(key):
        return None
    prototypes = opened.tensors[PROTOTYPES]
    net = OracleNet(int(prototypes.shape[0]), settings.width, tuple(settings.channels))
    net.load_state_dict({k[len(NET):]: v for k, v in opened.tensors.items() if k.startswith(NET)})
    net.eval().requires_grad_(False)
    return TrainedOracle(net, prototypes.float(), json.loads(opened.metadata[REPORT]))
