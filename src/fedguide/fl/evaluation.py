"""What a round scores (``eval.mode``): the method's evaluation of the global model, and each client's
personalised model (``Method.personal_model``) on the client's own test split; and what of it goes into
partition.json and summary.json."""
from __future__ import annotations

from typing import Any

import torch

from fedguide.config import Config
from fedguide.core.evaluation import evaluate_personal
from fedguide.data.federated import FederatedData
from fedguide.methods import Method, RunContext

PERSONAL_KEYS = ("personal_accuracy", "personal_accuracy_min", "personal_accuracy_bottom10")


def round_evaluation(cfg: Config, ctx: RunContext, method: Method, round_: int, global_weights: torch.Tensor
                     ) -> dict[str, Any]:
    """The round's test metrics. ``global``: the method's ``evaluate``; ``personal``: the personal metrics, the
    round's ``accuracy`` being the personal accuracy (the global test set is not scored); ``both``: the two
    (the personal ones every ``eval.personal_every`` rounds and at the last)."""
    mode = cfg.eval.mode
    out = method.evaluate(round_, global_weights) if mode != "personal" else {}
    if cfg.eval.personal_round(round_, cfg.train.rounds):
        out = {**out, **evaluate_personal(ctx.evaluator, ctx.data.personal_test,
                                          lambda cid: method.personal_model(round_, cid, global_weights))}
        if mode == "personal":
            out["accuracy"] = out["personal_accuracy"]
    return out


def personal_test_record(data: FederatedData) -> dict[str, Any]:
    """partition.json's ``personal_test``: every client's test split (indices into the source's test set,
    also under eval.test_subset) and its class counts."""
    if data.personal_test is None:
        return {}
    labels = data.splits.test_y.numpy()
    counts = [[int((labels[idx] == c).sum()) for c in range(data.num_classes)] for idx in data.personal_test]
    origin = data.personal_test if data.test_subset is None else [data.test_subset[i] for i in data.personal_test]
    return {"personal_test": {"counts": counts, "indices": [idx.tolist() for idx in origin]}}


def personal_summary(cfg: Config, metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """summary.json's personal entries: the final values (the last round always scores) under ``final_``
    names, the best personal accuracy with its round, and the clients' final accuracies."""
    scored = [m for m in metrics if "personal_accuracy" in m]
    if cfg.eval.mode == "global" or not scored:
        return {}
    best = max(scored, key=lambda m: m["personal_accuracy"])
    return {"eval_mode": cfg.eval.mode, **{f"final_{k}": scored[-1][k] for k in PERSONAL_KEYS},
            "best_personal_accuracy": best["personal_accuracy"], "best_personal_round": best["round"],
            "personal_client_accuracy": scored[-1]["personal_client_accuracy"]}
