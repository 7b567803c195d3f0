"""The round loop, the same for every runtime.

Each round: sample clients, build each one's payload, let the runtime's executor train them (in
ascending id order of results), aggregate, evaluate, checkpoint, and only then commit client state.
The engine knows the Method and Executor interfaces, never a method's or a runtime's name.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
from fedguide.config import Config, partition_label as label_of_partition
from fedguide.core import simulated
from fedguide.core.device import device_rules, deterministic, resolve_device, to_device
from fedguide.core.evaluation import first_best, rounds_since_best
from fedguide.core.records import record_bytes
from fedguide.fl.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from fedguide.fl.evaluation import (personal_summary, personal_test_record, readings_summary, round_evaluation,
                                   validation_evaluator)
from fedguide.fl.participation import participation
from fedguide.fl.loggers import MetricLoggers, check_available, open_loggers
from fedguide.fl.run_folder import RunFolder, pinned_config
from fedguide.fl.runtime import Executor, RunHandle, Runtime, runtime_of
from fedguide.data.device_data import SHARED_DECISION
from fedguide.fl.setup import Prepared, client_processes_on_device, open_run
from fedguide.methods import Method, RunContext
from fedguide.methods.compose import Hooks
from fedguide.registry import ConfigError

# Per-round metrics that measure the machine, not the run: excluded when comparing runs for identity.
TIMING_METRICS = frozenset({"seconds", "train_seconds", "aggregate_seconds", "eval_seconds", "client_fit_seconds"})


def partition_label(cfg: Config) -> str:
    return label_of_partition(cfg.partition.name, cfg.partition.params_dict())


def _restore_env(name: str, value: Optional[str]) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def round_line(m: dict[str, Any], rounds: int, eval_mode: str = "global") -> str:
    """One round as the console shows it; with eval.mode both, the clients' personal accuracy beside the global
    one (in the rounds that score it), and with personal, the accuracy is named as the personal one."""
    loss = "—" if m["loss"] is None else f"{m['loss']:.4f}"
    acc = f"{'personal ' if eval_mode == 'personal' else ''}acc {100 * m['accuracy']:6.2f}%"
    if eval_mode == "both" and m.get("personal_accuracy") is not None:
        acc += f"  personal {100 * m['personal_accuracy']:6.2f}%"
    if m.get("val_accuracy") is not None:
        acc += f"  val {100 * m['val_accuracy']:6.2f}%"
    return f"round {m['round']:>3}/{rounds}  {acc}  train loss {loss}  {m['seconds']:.1f} s"


def stale_rounds(metrics: list[dict[str, Any]]) -> int:
    """Rounds since the best validation accuracy so far (0 when the last round is the best)."""
    return rounds_since_best(m["val_accuracy"] for m in metrics)


class Experiment:
    """One run's round loop: opened with ``fl.setup``, its clients trained by ``runtime`` (default: the
    runtime the config names, from the registry), everything it keeps written through its ``RunFolder``."""

    def __init__(self, prepared: Prepared, run_dir: Path, log: Callable[[str], None] = print,
                 progress: Any = None, runtime: Optional[Runtime] = None):
        self.p = prepared
        self.cfg = prepared.config
        self.folder = RunFolder(run_dir)
        self.run_dir = self.folder.path
        self.log = log
        self.progress = progress  # a rich Progress or None
        self.runtime = runtime if runtime is not None else runtime_of(prepared)
        check_available(self.cfg.logging)  # a missing optional package is named before the run starts

    def _write_static(self) -> None:
        self.folder.write_config(self.cfg)
        self.folder.write_partition(self._partition_record())

    def _partition_record(self) -> dict[str, Any]:
        data = self.p.data
        record = {"num_classes": data.num_classes, "class_names": data.splits.class_names,
                  "counts": data.class_counts().tolist()}
        domain_counts = data.domain_counts()
        if domain_counts is not None:
            record.update(domain_names=data.splits.domain_names, domain_counts=domain_counts.tolist())
        if len(data.public_indices):
            record["public_samples"] = int(len(data.public_indices))
        if data.server_indices is not None:
            record["server_samples"] = int(len(data.server_indices))
        if data.val_indices is not None:
            record["val_samples"] = int(len(data.val_indices))
        if not data.clients_labeled:
            record["clients_labeled"] = False
        if data.test_subset is not None:
            record["test_subset"] = {"samples": int(len(data.test_subset)), "indices": data.test_subset.tolist()}
        record.update(personal_test_record(data))
        record.update(data.group_record())  # a natural partition: the groups (writers, domains) each client owns
        return record

    # ---- the loop -----------------------------------------------------------------------------
    def run(self, resume: bool = False) -> dict[str, Any]:
        """Run (or, with ``resume``, continue from its last checkpoint) holding the run folder's lock."""
        with self.folder.lock():
            if not resume:
                self.folder.check_fresh()
            else:
                self.folder.open_for_resume()
            train = self.cfg.train
            with deterministic(train.deterministic, train.cudnn_benchmark), device_rules(resolve_device(train.device)):
                return self._run(resume)

    def _run(self, resume: bool) -> dict[str, Any]:
        t_setup = time.perf_counter()  # set-up: the run context, the method's set-up (extraction, generation, ...)
        ctx, method = open_run(self.p, self.run_dir)
        # The hooks its regularisers take part in, their records merged in (methods.compose).
        self.hooks = hooks = Hooks(method)
        self.val_evaluator = validation_evaluator(ctx)  # data.val_fraction: scored every round
        # The server sets up and evaluates with the clients' thread count: results then do not depend on
        # how many processes trained the clients.
        workers, threads = self.runtime.resources(min(self.cfg.clients.per_round, ctx.num_clients),
                                                  ctx.layout.numel, ctx.device)
        torch.set_num_threads(threads)
        ckpt = load_checkpoint(self.folder.checkpoints) if resume else None
        notes: dict[str, Any] = {}
        if ckpt is None:
            hooks.setup()
            self._write_static()  # after a set-up that can refuse: a refused run leaves no run behind
            global_w, metrics, start, wall0 = method.init_global(ctx.initial_weights.clone()), [], 1, 0.0
        else:
            notes = self._check_resumable(ckpt)
            hooks.setup()
            hooks.load_server_state(to_device(ckpt.method_state, ctx.device if method.on_device else "cpu"))
            global_w, metrics, start, wall0 = (ckpt.global_weights.to(ctx.device), ckpt.metrics, ckpt.round + 1,
                                               ckpt.wall_seconds)
            self.folder.write_metrics(metrics)
            self.log(f"resuming {self.run_dir} after round {ckpt.round}")
        rounds = self.cfg.train.rounds
        t_run = time.perf_counter()
        # Every process's set-up counts (a resumed run sets up again): the notes keep the sum in the checkpoint.
        notes["setup_seconds"] = notes.get("setup_seconds", 0.0) + (t_run - t_setup)
        task = self.progress.add_task("rounds", total=rounds, completed=start - 1) if self.progress else None
        # Client-side processes sharing this device keep the data where the server decides for all of them.
        shared = client_processes_on_device(ctx, workers)
        before = os.environ.get(SHARED_DECISION)
        if shared is not None:
            os.environ[SHARED_DECISION] = shared
        try:
            clients = self.runtime.start(RunHandle(self.p, ctx, method, self.run_dir, self.log, workers, threads,
                                                   ckpt))
        except BaseException:
            _restore_env(SHARED_DECISION, before)
            raise
        self.device_counts = simulated.Counters()  # the clients' work under train.device: simulated
        pinned = pinned_config(self.cfg)
        loggers = MetricLoggers()
        try:
            loggers = open_loggers(self.cfg.logging, self.run_dir, self.cfg, metrics)
            if ckpt is not None:  # the executor may have moved client state elsewhere (ctx.store)
                ctx.store.recover(ckpt.round)
                ctx.server_store.recover(ckpt.round)
            for r in range(start, rounds + 1):
                try:
                    global_w, m = self._round(r, ctx, method, clients, global_w, metrics)
                except FloatingPointError as err:
                    # Recorded in the run folder, so a report shows the run as diverged, not as running.
                    self.folder.write_stopped({"reason": "diverged", "after_round": r - 1, "message": str(err)})
                    raise FloatingPointError(f"{err}. The run stopped after round {r - 1} (its last checkpoint), "
                                             "from which it would diverge again; to go on with other settings, "
                                             f"start a new run: fedguide run {self.run_dir / 'config.yaml'} "
                                             "--out NEW_FOLDER train.lr=<lower>") from None
                metrics.append(m)
                save_checkpoint(self.folder.checkpoints,
                                Checkpoint(r, global_w, hooks.server_state(), metrics,
                                           wall0 + time.perf_counter() - t_run, pinned, notes))
                self.folder.write_metrics(metrics)
                ctx.store.commit(r)
                ctx.server_store.commit(r)
                loggers.log(m, metrics)
                self.log(round_line(m, rounds, self.cfg.eval.mode))
                if task is not None:
                    self.progress.update(task, advance=1)
                patience = self.cfg.eval.early_stop
                if patience is not None and r < rounds and stale_rounds(metrics) >= patience:
                    notes["stopped_early"] = {"after_round": r, "patience": patience}
                    self.log(f"stopping early after round {r}: validation accuracy has not improved for {patience} "
                             "rounds (eval.early_stop)")
                    break
            return self._finish(ctx, clients, global_w, metrics, wall0 + time.perf_counter() - t_run, notes)
        finally:
            try:
                clients.close()
            finally:
                loggers.close()
                _restore_env(SHARED_DECISION, before)

    def _check_resumable(self, ckpt: Checkpoint) -> dict[str, Any]:
        """Refuse a resume whose data or config.yaml no longer describe the checkpointed run; its notes."""
        saved = self.folder.read_partition()
        if saved is None or saved["counts"] != self._partition_record()["counts"]:
            raise ConfigError(f"{self.run_dir}: the partition rebuilt from config.yaml differs from "
                              "partition.json (the code or data changed); start a new run instead")
        return self.folder.resume_notes(ckpt.config, self.p.resolved, ckpt.notes, self.log)

    def _round(self, r: int, ctx: RunContext, method: Method, clients: Executor, global_w: torch.Tensor,
               past: list[dict[str, Any]]):
        cfg = self.cfg
        t0 = time.perf_counter()
        part = participation(cfg.seed, r, ctx.num_clients, cfg.clients)
        chosen = part.sampled
        jobs = [(cid, self.hooks.server_payload(r, cid, global_w)) for cid in part.training]
        down = sum(record_bytes(payload) for _, payload in jobs)
        results = clients.run_round(r, jobs, global_w)
        for res in results:
            if res.device_counts is not None:
                self.device_counts.add(res.device_counts)
        # Uploads from other processes arrive on the CPU; the server aggregates where it computes.
        where = ctx.device if method.on_device else torch.device("cpu")
        uploads = [{**to_device(res.upload, where), "client_id": res.client_id} for res in results]
        up = sum(record_bytes(res.upload) for res in results)
        # The round's train loss is the mean over the clients whose fit trained the run's model (inference-only
        # clients report None), null when none did.
        trained = [res for res in results if res.loss is not None]
        n_sum = sum(res.num_samples for res in trained)
        loss = sum(res.loss * res.num_samples for res in trained) / max(n_sum, 1) if trained else None
        t_train = time.perf_counter()
        global_w = self.hooks.aggregate(r, global_w, uploads)
        t_agg = time.perf_counter()
        evaluation = round_evaluation(cfg, ctx, method, r, global_w, self.val_evaluator,
                                      [m["val_accuracy"] for m in past if "val_accuracy" in m])
        t_eval = time.perf_counter()
        m = {"round": r, "accuracy": evaluation["accuracy"], "loss": loss,
             "seconds": t_eval - t0, "train_seconds": t_train - t0, "aggregate_seconds": t_agg - t_train,
             "eval_seconds": t_eval - t_agg, "client_fit_seconds": sum(res.fit_seconds for res in results),
             "bytes_up": up, "bytes_down": down, "clients": chosen}
        m.update({k: v for k, v in evaluation.items() if k != "accuracy"})
        if cfg.clients.dropout > 0:
            m["dropped_clients"] = part.dropped
        if cfg.clients.stragglers > 0:
            m["straggler_clients"] = part.stragglers
        if cfg.train.schedule.name != "constant":
            m["lr"] = cfg.train.at_round(r).lr
        m.update(clients.round_metrics(r))
        return global_w, m

    def _finish(self, ctx: RunContext, clients: Executor, global_w: torch.Tensor, metrics: list[dict],
                wall: float, notes: dict[str, Any]) -> dict[str, Any]:
        ctx.layout.load(ctx.model, global_w)
        self.folder.write_model({k: v.cpu().contiguous() for k, v in ctx.model.state_dict().items()})
        curve = [m["accuracy"] for m in metrics]
        best = int(np.argmax(curve))
        last_k = self.cfg.report.last_k_for(len(curve))
        server_label = getattr(self.hooks.server_optimizer, "label", "")
        summary = {
            # "+dw" marks a composed regulariser, so reports keep MOON and MOON+DW apart; "+server_adam" a server
            # optimiser (FedAvg + server Adam is FedAdam).
            "method": self.cfg.method.name + "".join(f"+{r['name']}" for r in self.cfg.regularizers)
            + (f"+{server_label}" if server_label else ""),
            "method_params": self.cfg.method.params_dict(),
            "regularizers": self.cfg.regularizers,
            "dataset": self.cfg.data.name,
            "partition": partition_label(self.cfg),
            "model": self.cfg.model.name,
            "num_clients": ctx.num_clients,
            "clients_per_round": min(self.cfg.clients.per_round, ctx.num_clients),
            "rounds": self.cfg.train.rounds,
            "seed": self.cfg.seed,
            "final_accuracy": curve[-1],
            "best_accuracy": curve[best],
            "best_round": metrics[best]["round"],
            # The number to compare: under label skew accuracy oscillates with period 2, so a final round
            # mostly measures the phase (README, "Results").
            "accuracy_last_k": float(np.mean(curve[-last_k:])),
            "last_k": last_k,
            "accuracy_curve": curve,
            **{key: metrics[-1][key] for key in ("domain_accuracy", "client_class_accuracy") if key in metrics[-1]},
            "rounds_to_accuracy": {str(a): next((m["round"] for m in metrics if m["accuracy"] >= a), None)
                                   for a in self.cfg.report.rounds_to},
            # The run's cost is its set-up and its rounds; the rounds alone are training_seconds.
            "wall_seconds": notes.get("setup_seconds", 0.0) + wall,
            "setup_seconds": notes.get("setup_seconds", 0.0),
            "training_seconds": wall,
            "mean_round_seconds": float(np.mean([m["seconds"] for m in metrics])),
            "workers": clients.workers,
            "threads_per_worker": clients.threads,
            "bytes_up_total": int(sum(m["bytes_up"] for m in metrics)),
            "bytes_down_total": int(sum(m["bytes_down"] for m in metrics)),
        }
        for key, total in (("dropped_clients", "client_dropouts"), ("straggler_clients", "client_stragglers")):
            if key in metrics[-1]:  # the simulated failures and late returns of the whole run
                summary[total] = int(sum(len(m.get(key, [])) for m in metrics))
        if "val_accuracy" in metrics[-1]:
            # The round a run without the test set would pick: the best validation accuracy (the first on ties),
            # and the test accuracy there; best_accuracy is picked with the test set and is optimistic.
            picked = first_best(m["val_accuracy"] for m in metrics)
            summary.update(best_val_accuracy=metrics[picked]["val_accuracy"], best_val_round=metrics[picked]["round"],
                           accuracy_at_best_val=curve[picked], final_val_accuracy=metrics[-1]["val_accuracy"])
        summary.update(personal_summary(self.cfg, metrics))
        summary.update(readings_summary(self.cfg, metrics))
        summary.update({k: v for k, v in notes.items() if k != "setup_seconds"})
        summary.update(clients.finish(metrics))
        if simulated.current() is not None:
            summary["device_check"] = simulated.device_check_summary(self.device_counts)
        self.folder.write_summary(summary)
        return summary
