"""A finished run opened for analysis: its config, data and final global model, and (when a figure needs
it) its method set up as a resumed server sets it up.

The run is rebuilt from its folder alone (``fl.setup.prepare`` / ``open_run`` on RUN/config.yaml), so the
data split, the model and the method are the ones the run had. Nothing is written into the run folder
except under ``analysis/``; a method's set-up reads its fitted bases from the run folder and its features
from the feature cache, and recomputes only what the cache no longer holds.
"""
from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from fedguide.fl.checkpoint import Checkpoint, load_checkpoint
from fedguide.fl.run_folder import RunFolder
from fedguide.fl.setup import Prepared, open_run, prepare
from fedguide.methods import Method, RunContext
from fedguide.methods.compose import Hooks
from fedguide.models.split import SplitModel
from fedguide.registry import ConfigError

OUT_FOLDER = "analysis"


class AnalysisRun:
    def __init__(self, run_dir: Path | str):
        run_dir = Path(run_dir)
        if not run_dir.is_dir():
            raise ConfigError(f"{run_dir} is not a folder; pass the run folder that 'fedguide run' created")
        folder = RunFolder(run_dir)
        self.config = folder.read_config()  # a sentence when there is no config.yaml, or a damaged one
        missing = [name for name in ("summary.json", "model.safetensors") if not (run_dir / name).is_file()]
        if missing:
            why = ("it stopped before its last round (stopped.json)" if (run_dir / "stopped.json").is_file()
                   else f"it has no {' and no '.join(missing)}")
            raise ConfigError(f"{run_dir} is not a finished run ({why}); finish it with 'fedguide resume {run_dir}' "
                              "and analyze it then")
        self.run_dir = run_dir
        self.out_dir = run_dir / OUT_FOLDER
        self.summary: dict[str, Any] = folder.read_summary() or {}  # JSON errors name the file
        self.partition: dict[str, Any] = folder.read_partition() or {}
        self._folder = folder
        self._method_ready = False

    # ---- what the config rebuilds -----------------------------------------------------------------
    @cached_property
    def prepared(self) -> Prepared:
        prepared = prepare(self.config)
        saved = self.partition.get("counts")
        if saved is not None and saved != prepared.data.class_counts().tolist():
            raise ConfigError(f"{self.run_dir}: the partition rebuilt from config.yaml differs from partition.json "
                              "(the code or the data changed since the run), so its clients' data cannot be "
                              "rebuilt; analyze it with the fedguide version and data it was made with")
        return prepared

    @cached_property
    def _opened(self) -> tuple[RunContext, Method]:
        ctx, method = open_run(self.prepared, self.run_dir)
        state = self._folder.read_model()  # verified: a damaged model is refused, never drawn from
        try:
            ctx.model.load_state_dict(state)
        except RuntimeError as err:
            raise ConfigError(f"{self.run_dir / 'model.safetensors'} does not fit the model config.yaml builds "
                              f"({str(err).splitlines()[0]}); the code or the config changed since the run") from None
        ctx.model.eval()
        return ctx, method

    @property
    def ctx(self) -> RunContext:
        return self._opened[0]

    @property
    def model(self) -> SplitModel:
        """The run's final global model (model.safetensors), in eval mode."""
        return self.ctx.model

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @cached_property
    def final_weights(self) -> torch.Tensor:
        return self.ctx.layout.flatten(self.model).clone()

    @cached_property
    def trained(self) -> bool:
        """False when the run's model never left its seeded initialisation: methods that train another model
        (a head on a frozen image encoder, zero-shot) or aggregate nothing (local training) leave it so."""
        return not torch.equal(self.final_weights.cpu(), self.ctx.initial_weights.cpu())

    @property
    def untrained_reason(self) -> str:
        return (f"the run's global model is its untouched initialisation ({self.summary.get('method')} trains no "
                "global model of the config's architecture), so its features and head say nothing")

    @cached_property
    def checkpoint(self) -> Optional[Checkpoint]:
        return load_checkpoint(self.run_dir / "checkpoints")

    @property
    def built_method(self) -> Method:
        """The run's method as built, not set up (enough to ask which hooks it overrides)."""
        return self._opened[1]

    def method(self) -> Method:
        """The run's method, set up and holding its server state of the last round (as a resume has it)."""
        ctx, method = self._opened
        if not self._method_ready:
            from fedguide.core.device import to_device

            hooks = Hooks(method)
            hooks.setup()
            if self.checkpoint is not None:  # where the engine puts it on resume
                hooks.load_server_state(to_device(self.checkpoint.method_state,
                                                   ctx.device if method.on_device else torch.device("cpu")))
            ctx.layout.load(ctx.model, self.final_weights)  # a set-up may have used the live model
            ctx.model.eval()
            self._method_ready = True
        return method

    # ---- data -------------------------------------------------------------------------------------
    @property
    def splits(self):
        return self.prepared.data.splits

    def client_samples(self) -> np.ndarray:
        """Sorted global indices of every training sample some client holds."""
        parts = [np.asarray(c, dtype=np.int64) for c in self.prepared.data.client_indices if len(c)]
        return np.unique(np.concatenate(parts)) if parts else np.empty(0, np.int64)

    def class_counts(self) -> np.ndarray:
        """[K, C] training samples per client and class (partition.json, else rebuilt from the config)."""
        counts = self.partition.get("counts")
        return np.asarray(counts, dtype=np.int64) if counts is not None else self.prepared.data.class_counts()

    @property
    def class_names(self) -> list[str]:
        return list(self.splits.class_names)

    @property
    def method_label(self) -> str:
        return str(self.summary.get("method") or self.config.method.name)

    @torch.no_grad()
    def outputs(self, x: torch.Tensor, batch_size: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(z, logits) of the final global model for inputs ``x``, on the CPU."""
        batch_size = batch_size or self.config.train.eval_batch_size
        zs, logits = [], []
        for start in range(0, len(x), batch_size):
            z, out = self.model.forward_features(x[start: start + batch_size].to(self.device))
            zs.append(z.float().cpu())
            logits.append(out.float().cpu())
        if not zs:
            return torch.empty(0), torch.empty(0)
        return torch.cat(zs), torch.cat(logits)

    def head_weight(self) -> Optional[torch.Tensor]:
        """The classification layer ω [C, k] when the head is one linear map of z, else None."""
        weight = getattr(self.model.head, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.ndim != 2 or weight.shape[0] != self.splits.num_classes:
            return None
        return weight.detach().float().cpu()
