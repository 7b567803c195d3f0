"""The L2 norm of each class's classification-layer row against that class's share of the data (FedDW
Fig. 4: ‖ω_c‖ is negatively correlated with the proportion of class c).

What is measured
- The final global model: ‖ω_c‖ of model.safetensors' head against the class's share of all clients'
  training data (partition.json counts summed over the clients), when the run trained a global model.
- Client models, where the run keeps them: each client's personalised model where the method keeps one
  (``Method.personal_model`` overridden: FedRep's and FedPer's personal heads, FedBABU, ...), else a client's
  last local model as the methods that hold one store it in the client's state (``CLIENT_MODEL_KEYS``: Local
  and FedProto without shared weights keep ``weights``, MOON keeps ``prev_weights``), against that client's
  own class shares. A global head that never left its initialisation (the method keeps heads on the clients)
  is not drawn.
- Per model: the norms, the relative norms ‖ω_c‖ / Σ_i ‖ω_i‖ (the numbers under FedDW Fig. 4's circles)
  and Spearman's rank correlation between norm and share (null when the shares are all equal, as under IID).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch

from fedguide.analysis.figure import FIGURES, Figure
from fedguide.analysis.output import new_figure, save_numbers, save_png
from fedguide.methods.base import Method

if TYPE_CHECKING:
    from fedguide.analysis.opened import AnalysisRun

# Keys of client state holding the client's own last local model as a flat weight vector.
CLIENT_MODEL_KEYS = ("weights", "prev_weights")


def row_norms(weight: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(‖ω_c‖₂ per row, the same divided by their sum)."""
    norms = torch.linalg.norm(weight.double(), dim=1).numpy()
    return norms, norms / max(norms.sum(), 1e-300)


def shares(counts: np.ndarray) -> np.ndarray:
    counts = np.asarray(counts, dtype=np.float64)
    return counts / max(counts.sum(), 1.0)


def rank_correlation(a: np.ndarray, b: np.ndarray) -> Optional[float]:
    from scipy.stats import spearmanr

    if len(np.unique(a)) < 2 or len(np.unique(b)) < 2:
        return None
    return float(spearmanr(a, b).statistic)


def model_entry(weight: torch.Tensor, counts: np.ndarray) -> dict[str, Any]:
    norms, relative = row_norms(weight)
    share = shares(counts)
    return {"norms": norms, "relative_norms": relative, "class_share": share, "counts": np.asarray(counts),
            "spearman": rank_correlation(norms, share)}


def keeps_personal_models(run: AnalysisRun) -> bool:
    """Whether the method keeps a model of each client's own (FedRep's and FedPer's personal heads, FedBABU's
    fine-tuned models, ...): it overrides ``Method.personal_model``."""
    return type(run.built_method).personal_model is not Method.personal_model


def client_models(run: AnalysisRun) -> list[tuple[int, str, torch.Tensor]]:
    """(client, where it came from, flat weights) of every client with a model of its own: the method's
    personalised model of the last round where it keeps one, else the last local model a client's state holds."""
    ctx, out = run.ctx, []
    if keeps_personal_models(run):
        method, last = run.method(), int(run.summary.get("rounds") or run.config.train.rounds)
        return [(cid, "personal_model", method.personal_model(last, cid, run.final_weights.to(run.device)))
                for cid in range(ctx.num_clients)]
    for cid in range(ctx.num_clients):
        state = ctx.store.get(cid)
        for key in CLIENT_MODEL_KEYS:
            value = state.get(key)
            if isinstance(value, torch.Tensor) and value.ndim == 1 and value.numel() == ctx.layout.numel:
                out.append((cid, key, value))
                break
    return out


def head_of(run: AnalysisRun, weights: torch.Tensor) -> torch.Tensor:
    """The classification layer of a flat weight vector of the run's architecture."""
    model = run.ctx.make_model()
    run.ctx.layout.load(model, weights.cpu())
    return model.head.weight.detach().float()


@FIGURES.register(
    "weight_norms",
    summary="norm of each class's classifier row against the class's share of the data (global, clients)")
class WeightNorms(Figure):
    order = 30

    def applies(self, run: AnalysisRun) -> Optional[str]:
        if run.head_weight() is None:
            return (f"the model's head is not one linear layer with a row per class (model '{run.config.model.name}'), "
                    "so there are no per-class weight rows")
        if not run.trained and not client_models(run):
            return run.untrained_reason + ", and the run folder keeps no client models"
        return None

    def make(self, run: AnalysisRun, points: int, seed: int) -> list[Path]:
        counts = run.class_counts()
        numbers: dict[str, Any] = {
            "figure": "‖ω_c‖ of each class's classification-layer row against the class's share of the data (FedDW Fig. 4)",
            "run": str(run.run_dir), "method": run.method_label, "class_names": run.class_names,
            "used": [], "global": None, "clients": [],
        }
        initial_head = head_of(run, run.ctx.initial_weights)
        if run.trained and not torch.equal(run.head_weight().cpu(), initial_head.cpu()):
            numbers["global"] = model_entry(run.head_weight(), counts.sum(axis=0))
            numbers["used"].append("the final global head (model.safetensors) against the class shares of all clients' "
                                   "training data (partition.json counts)")
        elif run.trained:  # FedRep, FedPer: the server averages the body; each client keeps and trains its own head
            numbers["used"].append("not the global head: it is the untouched initial one (the method keeps the "
                                   "classification layer on the clients)")
        stored = client_models(run)
        for cid, key, weights in stored:
            numbers["clients"].append({"client": cid, "state_key": key, **model_entry(head_of(run, weights), counts[cid])})
        if stored:
            numbers["used"].append(f"{len(stored)} client models: each client's last local model as its state keeps it "
                                   f"(client_state, key {' or '.join(sorted({k for _, k, _ in stored}))}) against that "
                                   "client's own class shares")
        else:
            numbers["used"].append("no client models: the run folder keeps none (only methods that hold a client's "
                                   "last model in its state do)")
        if numbers["global"] is not None and numbers["global"]["spearman"] is None:
            numbers["used"].append("every class has the same share of the clients' data together, so the global panel "
                                   "cannot show the relation; FedDW Fig. 4's is within one client's skewed data (the "
                                   "client panels, for methods that keep client models)")
        png = save_png(draw(numbers), run.out_dir / "weight_norms.png")
        return [png, save_numbers(run.out_dir / "weight_norms.json", numbers)]


def draw(numbers: dict):
    panels = [("global model", [numbers["global"]])] if numbers["global"] is not None else []
    if numbers["clients"]:
        panels.append((f"{len(numbers['clients'])} client models", numbers["clients"]))
    fig = new_figure((5.2 * len(panels), 4.4))
    for i, (title, entries) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        for k, entry in enumerate(entries):
            share, rel = np.asarray(entry["class_share"]), np.asarray(entry["relative_norms"])
            label = f"client {entry['client']}" if "client" in entry else None
            ax.scatter(share, rel, s=22, alpha=0.8, label=label, color=None if label else "black")
            if label is None:
                for c, (x, y) in enumerate(zip(share, rel)):
                    ax.annotate(str(c), (x, y), fontsize="x-small", xytext=(3, 3), textcoords="offset points")
        rhos = [e["spearman"] for e in entries if e["spearman"] is not None]
        rho = f", Spearman ρ {np.mean(rhos):+.2f}" + (" (mean)" if len(entries) > 1 else "") if rhos else ""
        if not rhos:  # every point on one vertical line: say why instead of leaving a puzzle
            rho = "\n(every class has the same share: no relation to show)"
        ax.set_title(title + rho, fontsize="medium")
        ax.set_xlabel("share of the class in the data")
        ax.set_ylabel("‖ω_c‖ / Σ_i ‖ω_i‖")
        if len(entries) > 1 and len(entries) <= 12:
            ax.legend(fontsize="x-small")
    fig.suptitle(f"classification-layer row norms vs class share, {numbers['method']}", fontsize="medium")
    return fig
