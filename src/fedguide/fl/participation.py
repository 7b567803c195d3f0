"""Who takes part in a round: the sampled clients, those of them that fail (``clients.dropout``) and those that
return late with part of their work (``clients.stragglers``, ``clients.straggler_steps``).

Failures and stragglers are simulated the same way on every runtime: drawn from (seed, round) alone, so the
server and any process training a client compute the same sets without being told, and a resumed run draws them
again identically. A failed client trains nothing and uploads nothing; the round aggregates the others, as a
deployment leaves out a client that did not reply (fl/runtimes/flower/deployed_clients.py). At least one sampled
client always remains. A straggler trains ``straggler_steps`` local steps (its ``train.local_steps``) and its
partial update is aggregated like any other, as FedProx's systems-heterogeneity setting does (Li et al. 2020,
Sec. 5.2: stragglers perform fewer local updates); a method that trains in its own loop takes the shorter work
where it honours ``train.local_steps``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from fedguide.config import ClientsConfig, TrainConfig
from fedguide.core.seeding import sample_clients, sample_subset


@dataclass(frozen=True)
class Participation:
    sampled: list[int]  # the round's clients, ascending
    dropped: list[int]  # sampled clients that fail this round
    stragglers: list[int]  # training clients that return late

    @property
    def training(self) -> list[int]:
        return [c for c in self.sampled if c not in self.dropped]


def _share(fraction: float, clients: list[int]) -> int:
    return math.floor(fraction * len(clients) + 0.5)


def participation(seed: int, round_: int, num_clients: int, clients: ClientsConfig) -> Participation:
    sampled = sample_clients(seed, round_, num_clients, min(clients.per_round, num_clients))
    # The share rounded half up, never every sampled client: a round aggregates at least one upload.
    dropped = sample_subset(seed, "dropout", round_, sampled, min(_share(clients.dropout, sampled), len(sampled) - 1))
    training = [c for c in sampled if c not in dropped]
    late = sample_subset(seed, "stragglers", round_, training, _share(clients.stragglers, training))
    return Participation(sampled, dropped, late)


def client_train(train: TrainConfig, clients: ClientsConfig, seed: int, round_: int, client_id: int,
                 num_clients: int) -> TrainConfig:
    """The local training settings of ``client_id`` in ``round_``: a straggler's are cut to its steps."""
    if clients.stragglers == 0.0:
        return train
    if client_id not in participation(seed, round_, num_clients, clients).stragglers:
        return train
    return train.model_copy(update={"local_steps": clients.straggler_steps})
