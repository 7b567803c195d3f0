"""FedCDA (Wang et al., ICLR 2024): cross-round divergence-aware aggregation.

Local training is FedAvg's. The server remembers each client's M most recent local models. At
aggregation it picks, for every participating client k, one model w_k from its memory so that the
picked models diverge least from one another, and averages the picks with sample weights:

    min_{s}  J(s) = Σ_k p_k ‖w_{k,s_k} − w̄(s)‖²,   w̄(s) = Σ_k p_k w_{k,s_k},   p_k = N_k / Σ N_j,

which equals ½ Σ_{k,j} p_k p_j ‖w_{k,s_k} − w_{j,s_j}‖² (each pick's divergence from the others'
picks) and keeps the global model close to every selected local model. The exact problem has
Π_k M_k combinations; the paper solves it approximately, and plain FedAvg is used during warm-up
rounds, when local models are still far from their local optima.

Decisions:
- Approximation: block coordinate descent. Start from every client's newest model (FedAvg's
  choice); sweep over the participants in ascending id order in blocks of ``block_size``; for a
  block try every combination of its members' memories with the other picks fixed and keep the
  best; stop after a sweep with no change or after ``max_sweeps``. block_size = 1 is the greedy
  per-client selection; block_size ≥ |S| is the exact search. J never increases, so the result is
  never worse than FedAvg's choice under the objective.
- "Recent" means a client's last M participations (the newest is this round's upload); with
  partial participation they may span more than M rounds.
- Divergence is measured on trainable parameters only (buffers such as BN statistics or counters
  are not points of the loss landscape); the average covers the full weight vectors.
- Memory lives in the server's per-client disk store (≤ M vectors per client); during aggregation
  only this round's participants' memories are loaded. Distances come from one Gram matrix of all
  candidates (float64, centred on one candidate, accumulated over column chunks), so the search
  itself never touches the weight vectors again.
- Defaults from the paper's experimental setup (Sec. 6.1, with Algorithm 1 of Sec. 4): M = 3 local
  models per client (``memory``), B = 3 batches of the participants searched in turn (``batches``:
  blocks of ⌈participants / 3⌉ clients; ``block_size`` sets the block size directly, 1 = greedy
  per-client selection), and FedAvg for the first 50 rounds (``warmup_rounds``; the paper runs 200).
  A run whose rounds all fall in the warm-up is FedAvg throughout: a note on stderr says so.
- Not reproduced: the paper's selection objective (Sec. 4, Eq. 7-8) adds each selected model's
  recorded local training loss to the divergence term and averages over all N clients (the last pick
  of a client that does not take part stays in the aggregate, with uniform weights); here the
  objective is the divergence alone, over this round's participants, with sample weights.
"""
from __future__ import annotations

import itertools
import math
import sys
from typing import Optional, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field

from fedguide.core.aggregation import sample_weighted_average
from fedguide.methods.base import METHODS, Method

_CHUNK = 1 << 16  # Gram columns per step: bounds the float64 working copy to |candidates|·64k values


class FedCDAParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    memory: int = Field(3, ge=1, description="M: local models remembered per client (newest included)")
    warmup_rounds: int = Field(50, ge=0, description="rounds aggregated by plain FedAvg before selection starts "
                                                     "(paper: 50 of 200)")
    batches: int = Field(3, ge=1, description="B: the participants are searched in this many blocks (paper: 3)")
    block_size: Optional[int] = Field(None, ge=1, description="clients re-selected jointly by exhaustive search; "
                                                              "null = ⌈participants / batches⌉")
    max_sweeps: int = Field(10, ge=1, description="passes of block coordinate descent")


def candidate_gram(candidates: Sequence[torch.Tensor], mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Inner products (float64) between all candidates (rows of each [m_k, P] tensor, client after
    client), restricted to ``mask`` and centred on the first candidate (distances are unchanged,
    cancellation in ‖a‖² + ‖b‖² − 2⟨a, b⟩ is smaller). Computed where the candidates are; returned on the host,
    where the search reads its few entries many times (one copy instead of a device read per trial)."""
    width = candidates[0].shape[1]
    n = sum(int(c.shape[0]) for c in candidates)
    gram = torch.zeros(n, n, dtype=torch.float64, device=candidates[0].device)
    for start in range(0, width, _CHUNK):
        cols = slice(start, min(width, start + _CHUNK))
        block = torch.cat([c[:, cols] for c in candidates]).to(torch.float64)
        block -= block[0].clone()
        if mask is not None:
            block = block[:, mask[cols]]
        gram.addmm_(block, block.T)
    return gram.cpu()


def selection_objective(gram: torch.Tensor, picks: Sequence[int], weights: torch.Tensor) -> float:
    """J = Σ_k p_k ‖w_k − w̄‖² = Σ_k p_k G_kk − Σ_{k,j} p_k p_j G_kj for the rows ``picks`` of the Gram matrix."""
    idx = torch.as_tensor(list(picks))
    sub = gram[idx][:, idx]
    return float(weights @ sub.diagonal() - weights @ sub @ weights)


def select_models(candidates_per_client: Sequence[torch.Tensor], weights: Optional[Sequence[float]] = None,
                  block_size: int = 1, max_sweeps: int = 10, mask: Optional[torch.Tensor] = None) -> list[int]:
    """For each client, the row of its candidate tensor ([m_k, P], row 0 = newest) to aggregate.

    Block coordinate descent on J (module docstring) from the all-newest choice; ties keep the
    current pick, so the newest model wins unless an older one is strictly better.
    """
    sizes = [int(c.shape[0]) for c in candidates_per_client]
    if any(s < 1 for s in sizes):
        raise ValueError("every client needs at least one candidate model")
    k = len(sizes)
    p = torch.as_tensor([1.0] * k if weights is None else [float(w) for w in weights], dtype=torch.float64)
    p = p / p.sum()
    gram = candidate_gram(candidates_per_client, mask)
    offsets = [0] + list(itertools.accumulate(sizes))[:-1]

    def objective(choice: list[int]) -> float:
        return selection_objective(gram, [o + c for o, c in zip(offsets, choice)], p)

    choice = [0] * k
    best = objective(choice)
    for _ in range(max_sweeps):
        changed = False
        for start in range(0, k, block_size):
            block = list(range(start, min(k, start + block_size)))
            best_combo = tuple(choice[i] for i in block)
            for combo in itertools.product(*(range(sizes[i]) for i in block)):
                trial = list(choice)
                for i, c in zip(block, combo):
                    trial[i] = c
                value = objective(trial)
                if value < best - 1e-12 * abs(best):  # strict improvement; rounding noise is no reason to move
                    best, best_combo = value, combo
            if best_combo != tuple(choice[i] for i in block):
                for i, c in zip(block, best_combo):
                    choice[i] = c
                changed = True
        if not changed:
            break
    return choice


@METHODS.register("fedcda", params=FedCDAParams)
class FedCDA(Method):
    """FedCDA: aggregate, per client, the remembered local model that diverges least from the others' picks."""

    def __init__(self, params, run):
        super().__init__(params, run)
        self._mask: Optional[torch.Tensor] = None
        self._last: dict[str, float] = {}  # this round's selection statistics, for evaluate()

    @property
    def mask(self) -> torch.Tensor:
        if self._mask is None:
            self._mask = self.run.layout.parameter_mask(self.run.model)
        return self._mask

    def _remember(self, round_: int, upload: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Push this round's upload in front of the client's memory, keep the newest M, persist."""
        cid = upload["client_id"]
        old = self.run.server_store.get(cid, round_)
        models = upload["weights"].unsqueeze(0)
        rounds = torch.tensor([round_], dtype=torch.int64)
        if old:  # the store keeps its tensors on the host; the server aggregates where it computes
            keep = self.params.memory - 1
            models = torch.cat([models, old["models"][:keep].to(models.device)])
            rounds = torch.cat([rounds, old["rounds"][:keep]])
        self.run.server_store.put(cid, round_, {"models": models, "rounds": rounds})
        return models, rounds

    def setup(self) -> None:
        rounds = self.run.train.rounds
        if rounds <= self.params.warmup_rounds:
            print(f"note: fedcda's warm-up ({self.params.warmup_rounds} rounds of FedAvg) covers all {rounds} rounds, "
                  "so no cross-round selection happens; lower method.warmup_rounds", file=sys.stderr, flush=True)

    def aggregate(self, round_, global_weights, uploads):
        memories = [self._remember(round_, u) for u in uploads]
        sizes = [u["num_samples"] for u in uploads]
        if round_ <= self.params.warmup_rounds:
            choice = [0] * len(uploads)
        else:
            block = self.params.block_size or math.ceil(len(uploads) / self.params.batches)
            choice = select_models([m for m, _ in memories], sizes, block, self.params.max_sweeps, self.mask)
        ages = [round_ - int(r[c]) for (_, r), c in zip(memories, choice)]
        self._last = {"fedcda_mean_age": sum(ages) / len(ages),
                      "fedcda_older_picks": float(sum(a > 0 for a in ages))}
        return sample_weighted_average([m[c] for (m, _), c in zip(memories, choice)], sizes)

    def evaluate(self, round_, global_weights):
        return {**super().evaluate(round_, global_weights), **self._last}
