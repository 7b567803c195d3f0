"""The round loop of the in-process runtime.

Each round: sample clients, and for each (in ascending id order) build its payload, load its start
weights into the one live model, train, collect its upload; then aggregate, evaluate, checkpoint,
and only then commit client state. The engine knows the Method interface, never a method's name.
"""
from __future__ import annotations

import json
import math
import platform
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
import yaml

import fedguide
from fedguide.config import SECTION_KEYS, Config, build_config, to_yaml
from fedguide.data.federated import FederatedData, public_pool, stratified_fraction
from fedguide.data.partition import PARTITIONS
from fedguide.data.scenarios import make_scenario
from fedguide.data.sources import DATASETS
from fedguide.fl.atomic import write_json, write_jsonl, write_text
from fedguide.fl.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from fedguide.fl.context import RunContext
from fedguide.fl.evaluation import Evaluator
from fedguide.fl.seeding import derive_seed, numpy_rng, sample_clients
from fedguide.fl.state import ClientStateStore
from fedguide.fl.workers import InProcess, WorkerPool, resolve_workers
from fedguide.fl.weights import WeightLayout
from fedguide.methods import METHODS, Method, record_bytes
from fedguide.methods.compose import REGULARIZERS, Composed, build_regularizers
from fedguide.models import MODELS, build_model
from fedguide.registry import ConfigError

ROUND_ACCURACY_MARKS = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9)
# Per-round metrics that measure the machine, not the run: excluded when comparing runs for identity.
TIMING_METRICS = frozenset({"seconds", "train_seconds", "aggregate_seconds", "eval_seconds", "client_fit_seconds"})


def resolve(cfg: Config) -> tuple[Config, dict[str, Any]]:
    """Validate every named section against its registry and return the config with all defaults
    written out, plus the parsed parameter objects."""
    raw = cfg.model_dump(mode="json")
    regs, model_defaults = [], dict(METHODS.get(cfg.method.name).obj.model_defaults)
    for i, spec in enumerate(cfg.regularizers):
        spec = {"name": spec} if isinstance(spec, str) else dict(spec)
        if "name" not in spec:
            raise ConfigError(f"regularizers[{i}] has no name; write e.g. regularizers: [dw]")
        name = spec.pop("name")
        regs.append({"name": name, **REGULARIZERS.parse_params(name, spec, f"regularizers[{i}]").model_dump(mode="json")})
        model_defaults.update(REGULARIZERS.get(name).obj.model_defaults)
    raw["regularizers"] = regs
    parsed = {
        "data": DATASETS.parse_params(cfg.data.name, cfg.data.params_dict(), "data"),
        "partition": PARTITIONS.parse_params(cfg.partition.name, cfg.partition.params_dict(), "partition"),
        # Keys the method's paper fixes apply unless the config sets them explicitly.
        "model": MODELS.parse_params(cfg.model.name, {**model_defaults, **cfg.model.params_dict()}, "model"),
        "method": METHODS.parse_params(cfg.method.name, cfg.method.params_dict(), "method"),
    }
    for section, params in parsed.items():
        own = ("name", *SECTION_KEYS.get(section, ()))  # the section's own keys, not the entry's params
        raw[section] = {**{k: raw[section][k] for k in own if k in raw[section]},
                        **params.model_dump(mode="json")}
    return build_config(raw), parsed


def partition_label(cfg: Config) -> str:
    params = ", ".join(f"{k}={v}" for k, v in cfg.partition.params_dict().items() if k != "max_tries")
    return f"{cfg.partition.name}({params})" if params else cfg.partition.name


def git_commit() -> Optional[str]:
    src = Path(fedguide.__file__).resolve().parent
    try:
        out = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", str(src), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


@dataclass
class Prepared:
    """Everything that follows from the config alone (shared by --dry-run and a real run)."""

    config: Config
    params: dict[str, Any]
    data: FederatedData
    method_cls: type[Method]


def prepare(cfg: Config) -> Prepared:
    cfg, params = resolve(cfg)
    splits = DATASETS.get(cfg.data.name).obj(params["data"])
    labels = splits.train_y.numpy()
    pool = np.arange(len(labels))
    public = public_pool(labels, cfg.data.public_fraction, cfg.data.public_seed)
    pool = np.setdiff1d(pool, public)
    used = pool[stratified_fraction(labels[pool], cfg.data.fraction, numpy_rng(cfg.seed, "data"))]
    domains = splits.train_domains.numpy()[used] if splits.train_domains is not None else None
    part = make_scenario(cfg.partition.name, cfg.partition.params_dict(), labels[used], cfg.clients.num,
                         derive_seed(cfg.seed, "partition"), domains, splits.domain_names)
    method_cls = METHODS.get(cfg.method.name).obj
    if not part.clients_labeled and method_cls.needs_client_labels:
        raise ConfigError(f"partition '{cfg.partition.name}' leaves the clients' data unlabeled, but method "
                          f"'{cfg.method.name}' trains on client labels; choose a method for unlabeled clients "
                          "or another partition")
    client_indices = method_cls.federation([used[p] for p in part.clients])
    try:  # an architecture that cannot take these inputs is a config error, found before any run dir exists
        build_model(cfg.model.name, params["model"], splits.model_spec())
    except ValueError as err:
        raise ConfigError(str(err)) from None
    data = FederatedData(splits, client_indices, public_indices=public,
                         server_indices=None if part.server is None else used[part.server],
                         clients_labeled=part.clients_labeled)
    return Prepared(cfg, params, data, method_cls)


def round_line(m: dict[str, Any], rounds: int) -> str:
    loss = "—" if m["loss"] is None else f"{m['loss']:.4f}"
    return f"round {m['round']:>3}/{rounds}  acc {100 * m['accuracy']:6.2f}%  train loss {loss}  {m['seconds']:.1f} s"


class Experiment:
    def __init__(self, prepared: Prepared, run_dir: Path, log: Callable[[str], None] = print,
                 progress: Any = None):
        self.p = prepared
        self.cfg = prepared.config
        self.run_dir = Path(run_dir)
        self.log = log
        self.progress = progress  # a rich Progress or None

    # ---- set-up -------------------------------------------------------------------------------
    def build_context(self) -> tuple[RunContext, Method]:
        cfg = self.cfg
        spec = self.p.data.splits.model_spec()
        torch.manual_seed(derive_seed(cfg.seed, "model"))
        model = build_model(cfg.model.name, self.p.params["model"], spec)
        layout = WeightLayout.of(model)
        ctx = RunContext(
            config=cfg,
            data=self.p.data,
            model=model,
            make_model=lambda: build_model(cfg.model.name, self.p.params["model"], spec),
            layout=layout,
            initial_weights=layout.flatten(model),
            evaluator=Evaluator(model, layout, self.p.data.splits.test_x, self.p.data.splits.test_y,
                                cfg.train.eval_batch_size, self.p.data.splits.test_domains,
                                self.p.data.splits.domain_names),
            store=ClientStateStore(self.run_dir / "client_state"),
            server_store=ClientStateStore(self.run_dir / "server_state"),
            run_dir=self.run_dir,
        )
        method = self.p.method_cls(self.p.params["method"], ctx)
        if cfg.regularizers:
            method = Composed(method, build_regularizers(cfg.regularizers, ctx))
        return ctx, method

    def _write_static(self) -> None:
        cfg = self.cfg.model_copy(deep=True)
        cfg.meta = {"version": fedguide.__version__, "git_commit": git_commit(), "torch": torch.__version__,
                    "python": platform.python_version()}
        write_text(self.run_dir / "config.yaml", to_yaml(cfg))
        write_json(self.run_dir / "partition.json", self._partition_record())

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
        if not data.clients_labeled:
            record["clients_labeled"] = False
        return record

    # ---- the loop -----------------------------------------------------------------------------
    def make_clients(self, ctx, method, workers: int):
        """The executor that trains a round's clients (a deployment overrides this with its SuperNodes)."""
        if self.cfg.runtime.name == "flower":
            raise ConfigError("runtime.name=flower runs on a Flower deployment: start 'fedguide serve CONFIG' and "
                              "one 'fedguide client --partition-id I CONFIG' per client (README \"Running on "
                              "several machines\")")
        if self.cfg.runtime.name == "flower-sim":
            from fedguide.fl.flower import FlowerClients

            clients = FlowerClients(self.cfg, self.run_dir, ctx.num_clients)
            torch.set_num_threads(clients.threads)  # the server evaluates with the actors' thread count
            self.workers, self.threads = clients.actors, clients.threads
            return clients
        if workers > 1:
            return WorkerPool(self.p, self.run_dir, workers, self.threads, ctx.layout.numel)
        return InProcess(ctx, method, self.cfg)

    def run(self, resume: bool = False) -> dict[str, Any]:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        ctx, method = self.build_context()
        workers, threads = resolve_workers(self.cfg.runtime, min(self.cfg.clients.per_round, ctx.num_clients),
                                           ctx.layout.numel)
        # The server evaluates with the workers' thread count too: results then do not depend on how
        # many workers trained the clients.
        torch.set_num_threads(threads)
        self.workers, self.threads = workers, threads
        ckpt = load_checkpoint(self.run_dir / "checkpoints") if resume else None
        if ckpt is None:
            self._write_static()
            method.setup()
            global_w, metrics, start, wall0 = method.init_global(ctx.initial_weights.clone()), [], 1, 0.0
        else:
            saved = json.loads((self.run_dir / "partition.json").read_text())
            if saved["counts"] != self._partition_record()["counts"]:
                raise ConfigError(f"{self.run_dir}: the partition rebuilt from config.yaml differs from "
                                  "partition.json (the code or data changed); start a new run instead")
            method.setup()
            method.load_server_state(ckpt.method_state)
            ctx.store.recover(ckpt.round)
            ctx.server_store.recover(ckpt.round)
            global_w, metrics, start, wall0 = ckpt.global_weights, ckpt.metrics, ckpt.round + 1, ckpt.wall_seconds
            write_jsonl(self.run_dir / "metrics.jsonl", metrics)
            self.log(f"resuming {self.run_dir} after round {ckpt.round}")
        rounds = self.cfg.train.rounds
        t_run = time.perf_counter()
        task = self.progress.add_task("rounds", total=rounds, completed=start - 1) if self.progress else None
        clients = self.make_clients(ctx, method, workers)
        try:
            for r in range(start, rounds + 1):
                global_w, m = self._round(r, ctx, method, clients, global_w)
                metrics.append(m)
                save_checkpoint(self.run_dir / "checkpoints",
                                Checkpoint(r, global_w, method.server_state(), metrics,
                                           wall0 + time.perf_counter() - t_run))
                write_jsonl(self.run_dir / "metrics.jsonl", metrics)
                ctx.store.commit(r)
                ctx.server_store.commit(r)
                self.log(round_line(m, rounds))
                if task is not None:
                    self.progress.update(task, advance=1)
        finally:
            clients.close()
        return self._finish(ctx, global_w, metrics, wall0 + time.perf_counter() - t_run)

    def _round(self, r: int, ctx: RunContext, method: Method, clients, global_w: torch.Tensor):
        cfg = self.cfg
        t0 = time.perf_counter()
        chosen = sample_clients(cfg.seed, r, ctx.num_clients, min(cfg.clients.per_round, ctx.num_clients))
        jobs = [(cid, method.server_payload(r, cid, global_w)) for cid in chosen]
        down = sum(record_bytes(payload) for _, payload in jobs)
        results = clients.run_round(r, jobs, global_w)
        uploads = [{**res.upload, "client_id": res.client_id} for res in results]
        up = sum(record_bytes(res.upload) for res in results)
        # Inference-only clients (FedDISC, zero-shot) train nothing and report no loss (NaN): the round's
        # train loss is the mean over the clients that trained, null when none did (never NaN in the JSON).
        trained = [res for res in results if math.isfinite(res.loss)]
        n_sum = sum(res.num_samples for res in trained)
        loss = sum(res.loss * res.num_samples for res in trained) / max(n_sum, 1) if trained else None
        t_train = time.perf_counter()
        global_w = method.aggregate(r, global_w, uploads)
        t_agg = time.perf_counter()
        evaluation = method.evaluate(r, global_w)
        t_eval = time.perf_counter()
        m = {"round": r, "accuracy": evaluation["accuracy"], "loss": loss,
             "seconds": t_eval - t0, "train_seconds": t_train - t0, "aggregate_seconds": t_agg - t_train,
             "eval_seconds": t_eval - t_agg, "client_fit_seconds": sum(res.fit_seconds for res in results),
             "bytes_up": up, "bytes_down": down, "clients": chosen}
        m.update({k: v for k, v in evaluation.items() if k != "accuracy"})
        return global_w, m

    def _finish(self, ctx: RunContext, global_w: torch.Tensor, metrics: list[dict], wall: float) -> dict[str, Any]:
        from safetensors.torch import save_file

        from fedguide.fl.atomic import write_atomic

        ctx.layout.load(ctx.model, global_w)
        state = {k: v.contiguous() for k, v in ctx.model.state_dict().items()}
        write_atomic(self.run_dir / "model.safetensors", lambda tmp: save_file(state, tmp))
        curve = [m["accuracy"] for m in metrics]
        best = int(np.argmax(curve))
        summary = {
            # "+dw" marks a composed regulariser, so reports keep MOON and MOON+DW apart.
            "method": self.cfg.method.name + "".join(f"+{r['name']}" for r in self.cfg.regularizers),
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
            "accuracy_curve": curve,
            **({"domain_accuracy": metrics[-1]["domain_accuracy"]} if "domain_accuracy" in metrics[-1] else {}),
            "rounds_to_accuracy": {str(a): next((m["round"] for m in metrics if m["accuracy"] >= a), None)
                                   for a in ROUND_ACCURACY_MARKS},
            "wall_seconds": wall,
            "mean_round_seconds": float(np.mean([m["seconds"] for m in metrics])),
            "workers": self.workers,
            "threads_per_worker": self.threads,
            "bytes_up_total": int(sum(m["bytes_up"] for m in metrics)),
            "bytes_down_total": int(sum(m["bytes_down"] for m in metrics)),
        }
        write_json(self.run_dir / "summary.json", summary)
        return summary


def load_run_config(run_dir: Path) -> Config:
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"{run_dir} is not a fedguide run directory (no config.yaml); "
                          "pass the folder a 'fedguide run' created")
    return build_config(yaml.safe_load(path.read_text()))
