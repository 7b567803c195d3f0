"""Opening a run: config -> validated settings -> data and partition -> run context + method.

The same calls on the server and on every client of every runtime (a pool's worker processes, Flower's
simulated and deployed SuperNodes): each side derives the identical data split, model and method from
the config alone, so no process ships another its data or its objects.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import torch

from fedguide.config import SECTION_KEYS, Config, DataSection, ResolvedConfig, build_config
from fedguide.core.device import (apply_algorithms, check_precision, computes_on_host, device_rules, free_bytes,
                                  is_gpu_like, resolve_device)
from fedguide.core.evaluation import Evaluator
from fedguide.core.seeding import derive_seed, numpy_rng
from fedguide.core.state import ClientStateStore
from fedguide.core.weights import WeightLayout
from fedguide.data.augment import build_augment, check_augment
from fedguide.data.device_data import SHARED_DECISION, DeviceData, bytes_needed, decide_on_device
from fedguide.data.federated import (FederatedData, public_pool, scored_test_subset, stratified_fraction,
                                     validation_part)
from fedguide.data.partition import PARTITIONS
from fedguide.data.scenarios import make_scenario
from fedguide.data.sources import DATASETS
from fedguide.extras import EMBEDDED_BACKBONES, require_extras, require_modules
from fedguide.fl.runtime import RUNTIMES
from fedguide.methods import METHODS, Method, RunContext
from fedguide.methods.compose import REGULARIZERS, Hooks, build_regularizers, with_regularizers
from fedguide.methods.server_optimizers import SERVER_OPTIMIZERS
from fedguide.models import MODELS, build_model
from fedguide.registry import ConfigError, Parsed


def resolve(cfg: Union[Config, ResolvedConfig]) -> ResolvedConfig:
    """Every named section parsed by its registry, once: the entries and their parameters that every later
    step takes as they are, and the config with every default written out. A resolved config is returned
    as it is."""
    if isinstance(cfg, ResolvedConfig):
        return cfg
    method = METHODS.get(cfg.method.name)
    # A missing optional layer is named with its pip command before any parameter is parsed or anything built.
    for section, entry in (("method", method), ("runtime", RUNTIMES.get(cfg.runtime.name))):
        require_extras(entry.obj.extras, f"{section}.name={entry.name}")
    regs = []
    for i, spec in enumerate(cfg.regularizers):
        spec = {"name": spec} if isinstance(spec, str) else dict(spec)
        if "name" not in spec:
            raise ConfigError(f"regularizers[{i}] has no name; write e.g. regularizers: [dw]")
        regs.append(REGULARIZERS.parse(spec.pop("name"), spec, f"regularizers[{i}]"))
    for name, options in cfg.method_options.items():  # a typo in another method's options fails here, not later
        METHODS.parse(name, options, f"method_options.{name}")
    data = DATASETS.parse(cfg.data.name, cfg.data.params_dict(), "data")
    sections = {
        "data": DataSection(data.entry, data.params, **{k: getattr(cfg.data, k) for k in SECTION_KEYS["data"]}),
        "partition": PARTITIONS.parse(cfg.partition.name, cfg.partition.params_dict(), "partition"),
        "model": MODELS.parse(cfg.model.name, cfg.model.params_dict(), "model"),
        "method": METHODS.parse(cfg.method.name, cfg.method.params_dict(), "method"),
        "runtime": RUNTIMES.parse(cfg.runtime.name, cfg.runtime.params_dict(), "runtime"),
        "server_optimizer": SERVER_OPTIMIZERS.parse(cfg.server_optimizer.name, cfg.server_optimizer.params_dict(),
                                                    "server_optimizer"),
    }
    check_model_requirements(sections["model"], [(f"method.name={method.name}", method.obj)]
                             + [(f"regularizers: [{r.entry.name}]", r.entry.obj) for r in regs])
    guided = "guidance" in method.obj.extras
    for key, extras in method.obj.option_extras(sections["method"].params).items():
        require_extras(extras, f"{key} of method.name={cfg.method.name}")
        guided = guided or "guidance" in extras
    if guided and cfg.guidance.model == "embedded":
        require_modules(EMBEDDED_BACKBONES, "guidance",
                        f"method.name={cfg.method.name} on guidance.model=embedded (its frozen backbones)")
    raw = cfg.model_dump(mode="json")
    raw["regularizers"] = [r.dump() for r in regs]
    if raw["guidance"]["device"] == "auto":  # the guidance model computes where the run does
        raw["guidance"]["device"] = raw["train"]["device"]
    raw.update({section: parsed.dump() for section, parsed in sections.items()})
    return ResolvedConfig(build_config(raw), regularizers=tuple(regs), **sections)


def check_model_requirements(model: Parsed, needs: list[tuple[str, Any]]) -> None:
    """Each method or regulariser's ``model_requirements`` against the model the config resolves to: a
    mismatch is an error naming the key to set, never a silent change of the network."""
    params = model.params.model_dump(mode="json")
    for who, obj in needs:
        for key, wanted in obj.model_requirements.items():
            shown = json.dumps(wanted)
            if key not in params:
                raise ConfigError(f"{who} needs model.{key}={shown}, which model.name={model.entry.name} does not "
                                  f"offer; choose a model that has {key}")
            if params[key] != wanted:
                raise ConfigError(f"{who} needs model.{key}={shown} (the config has {json.dumps(params[key])}); set "
                                  f"model.{key}: {shown} in the config, for every method compared with it, so "
                                  f"every row runs the same network")


@dataclass
class Prepared:
    """Everything that follows from the config alone (shared by --dry-run and a real run)."""

    resolved: ResolvedConfig
    data: FederatedData

    @property
    def config(self) -> Config:
        return self.resolved.config

    @property
    def method_cls(self) -> type[Method]:
        return self.resolved.method.entry.obj


def prepare(cfg: Union[Config, ResolvedConfig]) -> Prepared:
    resolved = resolve(cfg)
    cfg = resolved.config
    root = getattr(resolved.data.params, "root", None)
    # A run names its data: a data.root that does not exist must not fall back to another copy (the
    # download folder, $FEDGUIDE_DATA, a system folder) while config.yaml records the missing one.
    if root and not Path(root).expanduser().exists():
        raise ConfigError(f"data.root {root} does not exist; fix the path, or remove data.root to use "
                          "$FEDGUIDE_DATA and the default places")
    splits = resolved.data.entry.obj(resolved.data.params)
    # Seeded by a constant, not the run seed: runs of different seeds score the same test samples.
    splits, test_subset = scored_test_subset(splits, cfg.eval.test_subset, numpy_rng(0, "test_subset"))
    labels = splits.train_y.numpy()
    pool = np.arange(len(labels))
    public = public_pool(labels, resolved.data.public_fraction, resolved.data.public_seed)
    pool = np.setdiff1d(pool, public)
    used = pool[stratified_fraction(labels[pool], resolved.data.fraction, numpy_rng(cfg.seed, "data"))]
    # The validation split is a share of the training data the run uses (after data.fraction).
    val_fraction, val_from = resolved.data.val_fraction, resolved.data.val_from
    val: Optional[np.ndarray] = None
    if val_fraction > 0 and val_from == "server":
        val = used[validation_part(labels[used], val_fraction, numpy_rng(cfg.seed, "validation"))]
        used = np.setdiff1d(used, val)
    domains = splits.train_domains.numpy()[used] if splits.train_domains is not None else None
    part = make_scenario(resolved.partition, labels[used], cfg.clients.num, derive_seed(cfg.seed, "partition"),
                         domains, splits.domain_names, *splits.owner_groups(used))
    method_cls = resolved.method.entry.obj
    if not part.clients_labeled and method_cls.needs_client_labels:
        raise ConfigError(f"partition '{cfg.partition.name}' leaves the clients' data unlabeled, but method "
                          f"'{cfg.method.name}' trains on client labels; choose a method for unlabeled clients "
                          "or another partition")
    partition = [used[p] for p in part.clients]
    if val_fraction > 0 and val_from == "clients":
        held = [idx[validation_part(labels[idx], val_fraction, numpy_rng(cfg.seed, "validation", cid))]
                for cid, idx in enumerate(partition)]
        partition = [np.setdiff1d(idx, h) for idx, h in zip(partition, held)]
        val = np.sort(np.concatenate(held))
    if val is not None and len(val) == 0:
        raise ConfigError(f"data.val_fraction={val_fraction} holds out no sample (every class of every client is "
                          "too small); raise data.val_fraction or write data.val_from: server")
    client_indices = method_cls.federation(partition)
    try:  # an architecture that cannot take these inputs is a config error, found before any run dir exists
        model = build_model(cfg.model.name, resolved.model.params, splits.model_spec())
    except ValueError as err:
        raise ConfigError(str(err)) from None
    check_precision(cfg.train.precision, resolve_device(cfg.train.device))
    check_deterministic(cfg, model, method_cls, resolved.method.params)
    check_augment(cfg.train.augment, splits.input_shape, splits.train_x.dtype.is_floating_point,
                  splits.pixel_stats is not None)
    data = FederatedData(splits, client_indices, public_indices=public,
                         server_indices=None if part.server is None else used[part.server],
                         val_indices=val, clients_labeled=part.clients_labeled, test_subset=test_subset)
    if cfg.eval.client_classes:
        data.client_classes = {cid: np.unique(labels[idx]).tolist() for cid, idx in enumerate(partition)}
    if cfg.eval.mode != "global":
        if not method_cls.personal_evaluation:
            raise ConfigError(f"method '{cfg.method.name}' classifies without the run's model, so it has no "
                              "personalised model to score; write eval.mode: global")
        data.personal_test = data.personal_test_split(cfg.eval.personal_test_fraction,
                                                      numpy_rng(cfg.seed, "personal_test"))
    return Prepared(resolved, data)


# Layers whose backward has no deterministic CUDA kernel (adaptive pooling to one value per channel is a mean,
# which has one).
_NONDETERMINISTIC_LAYERS = (torch.nn.AdaptiveAvgPool2d, torch.nn.AdaptiveAvgPool3d, torch.nn.AdaptiveMaxPool2d,
                            torch.nn.FractionalMaxPool2d, torch.nn.ReflectionPad1d, torch.nn.ReflectionPad2d,
                            torch.nn.ReflectionPad3d, torch.nn.Upsample)


def check_deterministic(cfg: Config, model: torch.nn.Module, method_cls: type[Method], method_params: Any) -> None:
    """``train.deterministic: true`` on a GPU (or the simulated device) with an operation CUDA has no
    deterministic kernel for is refused now, naming the setting to change, instead of raising mid-run."""
    if not cfg.train.deterministic or not is_gpu_like(resolve_device(cfg.train.device)):
        return
    reasons = []
    if cfg.train.augment == "autoaugment":
        reasons.append("train.augment: autoaugment equalises histograms with a floating-point cumsum, which has no "
                       "deterministic CUDA kernel; write train.augment: crop_flip")
    for name, layer in model.named_modules():
        if isinstance(layer, _NONDETERMINISTIC_LAYERS) and getattr(layer, "output_size", None) not in (1, (1, 1)):
            reasons.append(f"model {cfg.model.name}'s layer {name} ({type(layer).__name__}) has no deterministic "
                           "CUDA backward; choose another model or input size")
            break
    why = method_cls.gpu_nondeterminism(method_params, cfg)
    if why:
        reasons.append(f"method {cfg.method.name}: {why}")
    if reasons:
        raise ConfigError("train.deterministic: true on a GPU cannot run these settings: " + "; ".join(reasons)
                          + " (or write train.deterministic: false)")


def open_run(prepared: Prepared, run_dir: Path, setup: bool = False) -> tuple[RunContext, Method]:
    """The run context (the one live model, its weight layout, the evaluator, the state stores) and the
    method (composed with the config's regularisers). ``setup=True`` also runs the method's set-up, as
    every client side does before its first round; the server runs it itself, after deciding between a
    fresh start and a resume."""
    cfg, train = prepared.config, prepared.config.train
    run_dir = Path(run_dir)
    spec = prepared.data.splits.model_spec()
    device = resolve_device(train.device)
    if setup:  # a client-side process computes under the simulated device's rules for its whole life
        device_rules(device).__enter__()
    memory_format = torch.channels_last if train.channels_last else torch.preserve_format

    def make_model():
        return build_model(cfg.model.name, prepared.resolved.model.params, spec).to(device, memory_format=memory_format)

    # The initial weights are drawn on the CPU and then moved: the same run on every device starts alike.
    torch.manual_seed(derive_seed(cfg.seed, "model"))
    model = make_model()
    if train.compile:
        model.compile()  # in place: the state_dict keeps its names, so weight vectors and checkpoints do not change
    layout = WeightLayout.of(model)
    splits = prepared.data.splits
    on_device = cfg.data.on_device
    if setup and os.environ.get(SHARED_DECISION) in ("0", "1"):  # decided by the server for every process
        on_device = os.environ[SHARED_DECISION] == "1"
    device_data = DeviceData(splits, device, on_device, free_bytes, build_augment(train.augment, splits.input_shape))
    ctx = RunContext(
        config=cfg,
        method_name=cfg.method.name,
        seed=cfg.seed,
        train=train,
        eval=cfg.eval,
        guidance=cfg.guidance,
        clients=cfg.clients,
        data_settings=cfg.data,
        model_name=cfg.model.name,
        model_params=prepared.resolved.model.params,
        data=prepared.data,
        model=model,
        make_model=make_model,
        layout=layout,
        initial_weights=layout.flatten(model),
        evaluator=Evaluator(model, layout, splits.test_x, splits.test_y, train.eval_batch_size,
                            splits.test_domains, splits.domain_names, device_data, prepared.data.client_classes,
                            train.precision, train.channels_last),
        store=ClientStateStore(run_dir / "client_state"),
        server_store=ClientStateStore(run_dir / "server_state"),
        run_dir=run_dir,
        device=device,
        device_data=device_data,
    )
    method = prepared.method_cls(prepared.resolved.method.params, ctx)
    if cfg.regularizers:
        method = with_regularizers(method, build_regularizers(prepared.resolved.regularizers, ctx))
    server_opt = prepared.resolved.server_optimizer
    if server_opt is not None:
        # It steps the trainable parameters; BatchNorm statistics take the aggregate (core.server_updates).
        method.server_optimizer = server_opt.entry.obj(server_opt.params, layout.parameter_mask(model).to(device))
    if setup:
        # a client-side process keeps the settings for its whole life, as the server's engine has them for the run
        apply_algorithms(train.deterministic, train.cudnn_benchmark)
        Hooks(method).setup()
    return ctx, method


def client_processes_on_device(ctx: RunContext, processes: int) -> Optional[str]:
    """The server's ``data.on_device`` decision for ``processes`` client-side processes sharing its device
    ("1"/"0", for ``SHARED_DECISION``), made once, with all their copies counted, so that they agree and a run
    that cannot fit says so before any of them starts; None where nothing is decided (the host, one process)."""
    if processes <= 1 or computes_on_host(ctx.device):
        return None
    cfg = ctx.config
    free = free_bytes(ctx.device)  # with the server's own copy already there
    fits = decide_on_device(bytes_needed(ctx.data.splits), free, cfg.data.on_device, ctx.device, copies=processes)
    return "1" if fits else "0"
