"""FedDW's Fig. 8: the global soft-label (SL) matrix next to the class-relation (CR) matrix
softmax(ω ωᵀ) of the final classification layer, for runs that carried the "dw" regulariser."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from fedguide.fl.run_folder import MODEL_FILE, RunFolder
from fedguide.report.runs import RunRecord

SL_KEY = "dw.sl"  # the dw regulariser's server state in the checkpoint


def dw_matrices(run: RunRecord) -> tuple[np.ndarray, np.ndarray] | None:
    """(SL, CR) of a finished run, or None when the run has no dw state. Both files are read verified (a
    damaged one is an error naming it, never a figure drawn from altered numbers)."""
    folder = RunFolder(run.path)
    if not (folder.checkpoints.is_dir() and (run.path / MODEL_FILE).is_file()):
        return None
    ckpt = folder.read_checkpoint()
    if ckpt is None or SL_KEY not in ckpt.method_state:
        return None
    sl = ckpt.method_state[SL_KEY].double().numpy()
    omega = folder.read_model()["head.weight"].double().numpy()
    logits = omega @ omega.T
    cr = np.exp(logits - logits.max(axis=1, keepdims=True))
    return sl, cr / cr.sum(axis=1, keepdims=True)


def plot_dw_matrices(run: RunRecord, path: Path, save_atomic, new_figure) -> Path | None:
    mats = dw_matrices(run)
    if mats is None:
        return None
    sl, cr = mats
    fig = new_figure((11.0, 4.8))
    names = (run.partition or {}).get("class_names")
    for i, (mat, title) in enumerate(((sl, "global soft-label matrix Ω"), (cr, "class relations softmax(ωωᵀ)"))):
        ax = fig.add_subplot(1, 2, i + 1)
        im = ax.imshow(mat, vmin=0.0, vmax=max(1e-9, float(max(sl.max(), cr.max()))), cmap="magma")
        ax.set_title(title, fontsize="medium")
        ax.set_xlabel("class j")
        ax.set_ylabel("class i")
        if isinstance(names, list) and len(names) == mat.shape[0] <= 20:
            ax.set_xticks(range(len(names)), [str(n) for n in names], rotation=60, ha="right", fontsize="x-small")
            ax.set_yticks(range(len(names)), [str(n) for n in names], fontsize="x-small")
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.suptitle(f"FedDW matrices, {run.name}: ‖Ω − CR‖²_F / C² = {np.square(sl - cr).sum() / sl.shape[0] ** 2:.4f}")
    return save_atomic(fig, path)
