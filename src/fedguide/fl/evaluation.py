"""What a round scores (``eval.mode``): the method's evaluation of the global model, and each client's
personalised model (``Method.personal_model``) on the client's own test split; and what of it goes into
partition.json and summary.json."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from fedguide.config import Config
from fedguide.core.evaluation import Evaluator, evaluate_personal, rounds_since_best
from fedguide.data.federated import FederatedData
from fedguide.methods import Method, RunContext
from fedguide.registry import ConfigError

PERSONAL_KEYS = ("personal_accuracy", "personal_accuracy_min", "personal_accuracy_bottom10")


class _ValidationData:
    """The validation samples (training indices) served as a test set, through the run's device data: the same
    inputs a training batch gets, without augmentation."""

    def __init__(self, device_data: Any, indices: torch.Tensor):
        self.device_data, self.indices = device_data, indices
        self.used = False  # whether a scoring pass read it (a method may score without the run's evaluator)

    def test_batch(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.used = True
        return self.device_data.train_batch(self.device_data.indices(self.indices[start:stop]), augment=False)

    def test_batch_at(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.used = True
        return self.device_data.train_batch(self.device_data.indices(self.indices[idx]), augment=False)


def validation_evaluator(ctx: RunContext) -> Optional[Evaluator]:
    """An evaluator like the run's, over its validation split (``data.val_fraction``); None without one."""
    val = ctx.data.val_indices
    if val is None:
        return None
    test = ctx.evaluator
    indices = torch.from_numpy(val)
    return Evaluator(test.model, test.layout, None, ctx.data.splits.train_y[indices], test.batch_size,
                     device_data=_ValidationData(ctx.device_data, indices), precision=test.precision,
                     channels_last=test.channels_last)


def validation_accuracy(ctx: RunContext, method: Method, round_: int, global_weights: torch.Tensor,
                        val: Evaluator) -> float:
    """The method's own evaluation (as ``evaluate`` scores the test set) on the validation split: the run's
    evaluator is the validation one for the call."""
    val.device_data.used = False
    refusal = ConfigError(f"method '{ctx.method_name}' scores the test set without the run's evaluator (its own "
                          "features or classifier), so it cannot be scored on a validation split; remove "
                          "data.val_fraction")
    test, ctx.evaluator = ctx.evaluator, val
    try:
        accuracy = method.evaluate(round_, global_weights)["accuracy"]
    except Exception:
        if not val.device_data.used:  # e.g. test-set predictions scored against the validation labels
            raise refusal from None
        raise
    finally:
        ctx.evaluator = test
    if not val.device_data.used:
        raise refusal
    return accuracy


def round_evaluation(cfg: Config, ctx: RunContext, method: Method, round_: int, global_weights: torch.Tensor,
                     val: Optional[Evaluator] = None, past_val: Sequence[float] = ()) -> dict[str, Any]:
    """The round's test metrics. ``global``: the method's ``evaluate``; ``personal``: the personal metrics, the
    round's ``accuracy`` being the personal accuracy (the global test set is not scored); ``both``: the two
    (the personal ones every ``eval.personal_every`` rounds, in the last ``report.last_k``, and, under
    ``eval.early_stop``, in the rounds after which the run could stop within the last k: ``past_val``, the
    earlier rounds' validation accuracies, says how stale this one is). With a validation split (``val``),
    ``val_accuracy``: the method's evaluation on it."""
    mode = cfg.eval.mode
    out = method.evaluate(round_, global_weights) if mode != "personal" else {}
    stale = None
    if val is not None:
        out["val_accuracy"] = validation_accuracy(ctx, method, round_, global_weights, val)
        stale = rounds_since_best([*past_val, out["val_accuracy"]])
    if cfg.eval.personal_round(round_, cfg.train.rounds, cfg.report.last_k_for(cfg.train.rounds), stale):
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


def readings_summary(cfg: Config, metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """summary.json's entries of the other readings of the global accuracy a method reports beside ``accuracy``
    (its ``evaluate``'s ``readings``: name -> accuracy, e.g. FedRep's ``last_local``): for each name
    ``final_<name>_accuracy``, ``<name>_accuracy_last_k`` (over the run's last_k window), ``best_<name>_accuracy``
    and ``best_<name>_round``."""
    out: dict[str, Any] = {}
    names = [n for m in metrics for n in m.get("readings", {})]
    for name in dict.fromkeys(names):
        scored = [(m["round"], m["readings"][name]) for m in metrics if name in m.get("readings", {})]
        k = cfg.report.last_k_for(len(scored))
        best = max(scored, key=lambda rv: rv[1])
        out.update({f"final_{name}_accuracy": scored[-1][1],
                    f"{name}_accuracy_last_k": sum(v for _, v in scored[-k:]) / k,
                    f"best_{name}_accuracy": best[1], f"best_{name}_round": best[0]})
    return out
