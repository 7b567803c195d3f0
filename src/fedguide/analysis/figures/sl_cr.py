"""FedDW's soft-label (SL) and class-relation (CR) matrices of any finished run (FedDW Fig. 8 compares
FedAvg under IID and non-IID data with FedDW), computed from the final global model with FedDW's own
functions (methods/classic/feddw.py):

- SL (Eq. 4, aggregated as Eq. 7): Ω[i, :] = mean of softmax(f(x)) over the training samples of class i.
  Eq. 7 weighs each client's Ω_k[i, :] by its count of class i, which is the mean over all the clients'
  samples of class i: computed here from the final model on every sample some client holds, with the
  samples' true labels (also where the clients themselves hold no labels);
- CR: softmax_rows(ω ωᵀ) of the final classification layer ω (a bias, if the head has one, is not part of it);
- their distance L_reg = ‖Ω − CR‖²_F / C² (Eq. 11).
A run that carried FedDW's regulariser also has the server's own aggregated SL matrix in its checkpoint
(``dw.sl``): it is shown beside the recomputed one, with its own distance.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch

from fedguide.analysis.figure import FIGURES, Figure
from fedguide.analysis.output import new_figure, save_numbers, save_png
from fedguide.methods.classic.feddw import class_relation, dw_loss, soft_label_matrix

if TYPE_CHECKING:
    from fedguide.analysis.opened import AnalysisRun

STATE_KEY = "dw.sl"  # the dw regulariser's server state in a checkpoint


def soft_labels(logits: torch.Tensor, labels: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(Ω [C, C], counts [C]) of the model outputs ``logits`` of samples of ``labels``."""
    return soft_label_matrix(torch.softmax(logits.double(), dim=1), labels.long(), num_classes)


@FIGURES.register("sl_cr", summary="FedDW's soft-label and class-relation matrices of the final model")
class SoftLabelsClassRelations(Figure):
    order = 40

    def applies(self, run: AnalysisRun) -> Optional[str]:
        if not run.trained:
            return run.untrained_reason
        if run.head_weight() is None:
            return (f"the model's head is not one linear layer with a row per class (model '{run.config.model.name}'), "
                    "so there is no class-relation matrix ωωᵀ")
        return None

    def make(self, run: AnalysisRun, points: int, seed: int) -> list[Path]:
        samples = run.client_samples()
        index = torch.from_numpy(samples)
        _, logits = run.outputs(run.splits.train_x[index])
        c = run.splits.num_classes
        sl, counts = soft_labels(logits, run.splits.train_y[index], c)
        omega = run.head_weight().double()
        cr = class_relation(omega)
        numbers: dict[str, Any] = {
            "figure": "FedDW's soft-label matrix Ω (Eq. 4/7) and class relations softmax(ωωᵀ) of the final model (FedDW Fig. 8)",
            "run": str(run.run_dir), "method": run.method_label, "class_names": run.class_names,
            "samples": int(len(samples)), "class_counts": counts,
            "sl": sl, "cr": cr, "l_reg": float(dw_loss(sl, omega)),
            "head_bias_ignored": getattr(run.model.head, "bias", None) is not None,
            "absent_classes": [i for i in range(c) if int(counts[i]) == 0],  # their SL rows are zero
        }
        stored = (run.checkpoint.method_state if run.checkpoint is not None else {}).get(STATE_KEY)
        if stored is not None:
            numbers["sl_server"] = stored.double()
            numbers["l_reg_server"] = float(dw_loss(stored.double(), omega))
        png = save_png(draw(numbers), run.out_dir / "sl_cr.png")
        return [png, save_numbers(run.out_dir / "sl_cr.json", numbers)]


def draw(numbers: dict):
    mats = [(np.asarray(numbers["sl"]), f"soft labels Ω (final model, {numbers['samples']} client samples)"),
            (np.asarray(numbers["cr"]), "class relations softmax(ωωᵀ)")]
    if "sl_server" in numbers:
        mats.insert(1, (np.asarray(numbers["sl_server"]), "Ω aggregated by the server (dw state)"))
    fig = new_figure((5.3 * len(mats), 4.8))
    top = max(1e-9, max(float(m.max()) for m, _ in mats))
    names = numbers["class_names"]
    for i, (mat, title) in enumerate(mats):
        ax = fig.add_subplot(1, len(mats), i + 1)
        im = ax.imshow(mat, vmin=0.0, vmax=top, cmap="magma")
        ax.set_title(title, fontsize="small")
        ax.set_xlabel("class j")
        ax.set_ylabel("class i")
        if len(names) == mat.shape[0] <= 20:
            ax.set_xticks(range(len(names)), [str(n) for n in names], rotation=60, ha="right", fontsize="x-small")
            ax.set_yticks(range(len(names)), [str(n) for n in names], fontsize="x-small")
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.suptitle(f"SL vs CR, {numbers['method']}: ‖Ω − CR‖²_F / C² = {numbers['l_reg']:.4f}", fontsize="medium")
    return fig
