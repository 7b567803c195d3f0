"""What a deployed server and its clients agree on: the experiment they run, the messages they swap.

Every client builds its own run context from its own copy of the config (the data lives on its
machine), so the server checks at connection time that each client's resolved config is its own,
key for key, and every train message carries the config's fingerprint, so a client never trains on
a different experiment. Keys that may differ between machines are left out of the comparison:
``runtime`` (how each side runs), ``meta`` (written by the server) and ``data.root`` (where the data
lies on each machine).

Query messages hold a ConfigRecord "fedguide" whose "kind" says what is asked:
- ``hello``: which partition (client id) are you, and what config do you hold?
- ``state``: send client state as of a round (methods whose server code reads client state, e.g.
  ``local`` evaluating every client's own model, read it through these messages).
- ``finish``: the run is complete; commit the state of the rounds the server accepted.

Client state written in round r stays pending on the client until the server says, in a later
message, which of the client's rounds it aggregated and checkpointed ("settled-round"): those are
committed, the others (a reply that came too late, a round re-run after a resume) are dropped —
the same rule the local runtime applies with its checkpoints.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from fedguide.config import Config, config_differences

APP_PUBLISHER = "fedguide"
APP_NAME = "fedguide-run"
LOCAL_KEYS = ("runtime", "meta", "data.root")  # may differ between the server's and a client's machine


def comparable(cfg: Config) -> dict[str, Any]:
    """The config with the machine-local keys left out, as plain JSON values."""
    raw = cfg.model_dump(mode="json")
    for key in LOCAL_KEYS:
        *parents, leaf = key.split(".")
        node = raw
        for p in parents:
            node = node.get(p, {})
        node.pop(leaf, None)
    return raw


def fingerprint(cfg: Config) -> str:
    text = json.dumps(comparable(cfg), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def differences(server: dict[str, Any], client: dict[str, Any], limit: int = 8) -> list[str]:
    """'key: server value vs client value' for every key the two comparable configs disagree on."""
    return config_differences(server, client, ("server", "client"), limit)


def run_key(run_dir: Path) -> str:
    """Names a server's run on the clients: the run directory's name and a hash of its full path, so
    a resumed run finds its clients' state again and two runs never share it."""
    run_dir = Path(run_dir).resolve()
    return f"{run_dir.name}-{hashlib.sha256(str(run_dir).encode()).hexdigest()[:8]}"
