"""fedguide's GPU checks as a plain script: no pytest, no data set files (stand-in data only), so that a GPU
host with nothing but PyTorch and the carried wheels runs them (scripts/device-check.sh).
tests/gpu/test_cuda.py asserts the same with plain pytest on a CUDA machine.

    python benchmarks/gpu_checks.py [--device cuda|simulated] [--quick] [--seconds S] [--json PATH] [--only NAME ...]
                                    [--checks agreement transfers determinism precision]

One line per result, ``<check> <name>: ok | FAILED | not run - <why>``, and a last line with the counts:

- ``agreement``: every registered method for one round on --device and the same run on the CPU (same config,
  seed and stand-in data). Passes when the first round's training loss agrees within LOSS_TOL and every
  float tensor of the final global model within WEIGHT_TOL (elementwise |d| <= atol + rtol * |w_cpu|).
  TF32 is off and the guidance models compute in float32 for these runs, so that only the order of float32
  sums differs; the random draws come from generators on the host, so they are the same on both devices
  (a method that draws on the device is named in DEVICE_DRAWN, and only its loss is compared, loosely; one
  that amplifies rounding by design, measured on the CPU, is named in LOOSE with what is compared instead).
  The CPU runs go in a process of their own, alongside the device's.
- ``transfers``: FedAvg, two rounds, data kept on the device. Host syncs and host-to-device bytes inside the
  training steps (per optimiser step) and over the run. On CUDA they are counted by torch.cuda's sync debug
  mode and by wrapping the host-to-device routes (``.to``, ``.cuda``, ``copy_``, tensor factories, host
  indices into device tensors); the same run on the simulated device gives what fedguide expects. Passes
  when CUDA's per-step counts are at most the simulated device's and round 2 copies no more than each
  epoch's index order (8 bytes a sample) plus 64 KiB.
- ``determinism``: train.deterministic=true with crop_flip drawn on the device, the same run in two fresh
  processes: identical metrics and final weights.
- ``precision``: bf16 and fp16 (channels_last on CUDA): every loss and every final weight finite.

--device simulated (``train.device: simulated``, the CPU under CUDA's rules) runs every check on a machine
without a GPU: a dry run of this script, not a measurement of a GPU. --quick keeps the stand-in data and the
list of methods small (FedAvg only; the others are listed as not run). --seconds bounds the whole:
a method not started in time is listed as not run. Before each method a line ``agreement <name>: running``
says which one a time cap from outside stopped.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import math
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from fedguide.config import SECTION_KEYS, apply_overrides, build_config, load_raw  # noqa: E402
from fedguide.data.sources.standin import standin_section  # noqa: E402
from fedguide.fl.engine import TIMING_METRICS, Experiment  # noqa: E402
from fedguide.fl.setup import prepare  # noqa: E402
from fedguide.methods import METHODS  # noqa: E402
from method_defaults import requirement_overrides  # noqa: E402  (a sibling script)

LOSS_TOL = dict(atol=1e-4, rtol=1e-3)
WEIGHT_TOL = dict(atol=1e-4, rtol=1e-3)
DEVICE_DRAWN_LOSS_RTOL = 0.1
# Methods that draw random numbers on the run's device: CUDA's stream is not the CPU's, so their weights
# cannot agree; their first-round loss is compared within DEVICE_DRAWN_LOSS_RTOL.
DEVICE_DRAWN = {"fedema": "its BYOL views are drawn on the run's device (methods/personalised/_ssl_views.py)"}
# Methods whose result amplifies rounding by design, measured by two CPU runs that differ only in their
# thread count (every other method's final weights then differ by under 2e-6). FedDF's server distils with
# Adam (lr 1e-3, METHOD_SIZES' 20 steps): Adam's normalised steps turn rounding in near-zero gradients into
# whole steps of +-lr, so those two runs differ by up to 0.013 in parameters and 6% in BatchNorm statistics,
# and 0.1% in test loss. Compared instead: parameters within 2 * lr * steps (Adam moves a weight at most about
# lr a step), the round's test loss within 1%; BatchNorm statistics not.
# pFedMe takes K = 5 gradient steps per batch on its inner problem (η_p 0.09, λ 15) before each step of w: a
# perturbation of every forward pass's logits at float32's rounding (2^-23 relative,
# benchmarks/rounding_sensitivity.py) moved its final weights by 1.35e-5 to 1.6e-4 on the CPU (0.13 to 1.46 times
# WEIGHT_TOL, by the draw), against at most 7.2e-7 for every other method
# (benchmarks/results/rounding_sensitivity.md). On an H200 its parameters were 2.6e-4 from the CPU's (head.weight) where every other
# method's were within 1.7e-5. Compared instead: parameters within 1e-3 (about four times that measurement),
# the round's test loss within 1%.
LOOSE = {"feddf": {"why": "its server's Adam distillation amplifies rounding", "param_atol": 2 * 1e-3 * 20,
                   "metric": "test_loss", "metric_rtol": 0.01},
         "pfedme": {"why": "its K inner steps per batch amplify rounding", "param_atol": 1e-3,
                    "metric": "test_loss", "metric_rtol": 0.01}}
CHECKS = ("agreement", "transfers", "determinism", "precision")
BUFFERS = ("running_mean", "running_var", "num_batches_tracked")
# Smaller than behaviour_hashes.py's where its sizes cost the CPU half of the check tens of seconds: the
# agreement needs each code path once, not the numbers. FedEMA: the every-method sweeps' heads
# (tests/methods); FedDifRC at the tiny pipeline's 32 px, not the paper's 224 px (49 times the UNet work);
# the generating methods with fewer images, denoising steps and epochs; SemanticFL with a z its PCA can fill.
METHOD_SIZES = {"fedema": ["method.hidden_dim=64", "method.projection_dim=32", "method.probe_samples=200"],
                "feddifrc": ["method.image_size=pipeline"],
                "feddda": ["method.pool_per_class=2", "method.steps=2"],
                "fedcado": ["method.images_per_class=2", "method.steps=2", "method.edit_steps=1",
                            "method.local_epochs=2", "method.agg_epochs=2"],
                "sd_gen": ["method.images_per_class=2", "method.steps=2", "method.agg_epochs=2"],
                "feddf": ["method.local_epochs=2", "method.distill_steps=20"],
                "feddisc": ["method.steps=2", "method.head_epochs=10"],
                # the tiny pipeline's blocks pool to 448 features, fewer than the CNN's 512-d z
                "semanticfl": ["model.feature_dim=64"]}
QUICK_METHODS = ("fedavg",)  # device-check.sh runs FedDifRC in its own step
# Stand-in scale per dataset shape: full (a GPU host) and quick (a CPU dry run).
SCALES = {"fmnist": (0.02, 0.002), "digits_domains": (0.1, 0.03), "cifar10": (0.02, 0.004)}
SYNC_WARNING = "synchronizing"
Result = tuple  # (status: "ok" | "FAILED" | "not run", a sentence, numbers for --json)


def _hashes():
    spec = importlib.util.spec_from_file_location("behaviour_hashes", REPO / "benchmarks/behaviour_hashes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HASHES = _hashes()


# ---- configs: behaviour_hashes.py's per method, on stand-in data and random tiny pipelines -----------------

class Pipelines:
    """The tiny random SD and unCLIP pipelines and CLIP model, built once (the embedded guidance models need
    backbones too large to carry to a GPU host)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._built: dict[str, Path] = {}

    def get(self, kind: str) -> Path:
        if kind not in self._built and (self.folder / kind / "done").is_file():  # built by another process
            self._built[kind] = self.folder / kind
        if kind not in self._built:
            from fedguide.guidance.tiny import build_tiny_clip, build_tiny_pipeline

            path = self.folder / kind
            if kind == "clip":
                build_tiny_clip(path, seed=2)
            else:
                build_tiny_pipeline(path, seed=0 if kind == "sd" else 1, unclip=kind == "unclip")
            (path / "done").touch()
            self._built[kind] = path
        return self._built[kind]

    def build_all(self) -> None:
        for kind in ("sd", "unclip", "clip"):
            self.get(kind)


def guided(name: str) -> bool:
    """Whether ``name`` runs on a guidance pipeline (method_overrides gives it a tiny one)."""
    config, overrides = HASHES.SPECIAL.get(name, (HASHES.SMOKE, []))
    return (any(o.startswith("guidance.model=") for o in overrides)
            or config.name in ("fedcado_smoke.yaml", "feddisc_smoke.yaml"))


def standin_raw(config: Path, quick: bool) -> dict[str, Any]:
    """The config with its data section swapped for a stand-in of the same shape, at the check's scale."""
    raw = load_raw(config)
    data = dict(raw.get("data") or {})
    own = {k: data.pop(k) for k in SECTION_KEYS["data"] if k in data}
    own.pop("fraction", None)  # the stand-in's scale sizes it
    section = standin_section(data.pop("name"), data)
    section["scale"] = SCALES.get(section["like"], (0.02, 0.004))[1 if quick else 0]
    raw["data"] = {**own, **section}
    return raw


def method_overrides(name: str, pipelines: Pipelines) -> tuple[Path, list[str]]:
    """(config, overrides) of ``name``: behaviour_hashes.py's, the embedded guidance models replaced by tiny
    random pipelines of Stable Diffusion's layout (unCLIP and a CLIP model for the FedDISC family)."""
    config, overrides = HASHES.SPECIAL.get(name, (HASHES.SMOKE, []))
    out = [o for o in overrides if not o.startswith("guidance.model=")]
    if not any(o.startswith("method.name=") for o in out):
        out.append(f"method.name={name}")
    if config.name == "feddisc_smoke.yaml":
        out += [f"guidance.model={pipelines.get('unclip')}", f"guidance.image_encoder={pipelines.get('clip')}"]
    elif any(o.startswith("guidance.model=") for o in overrides) or config.name == "fedcado_smoke.yaml":
        out.append(f"guidance.model={pipelines.get('sd')}")
    # What the method requires of the network (FedBN: batch_norm) is the comparison's to set, never the name's.
    return config, out + requirement_overrides(name) + METHOD_SIZES.get(name, [])


def build(config: Path, overrides: list[str], quick: bool):
    return build_config(apply_overrides(standin_raw(config, quick), overrides))


# ---- one run --------------------------------------------------------------------------------------------

def run(cfg, run_dir: Path, log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """One run: its summary, metrics rows without timings and final global weights."""
    Experiment(prepare(cfg), run_dir, log=log).run()
    return read_run(run_dir)


def read_run(run_dir: Path) -> dict[str, Any]:
    rows = [{k: v for k, v in json.loads(x).items() if k not in TIMING_METRICS}
            for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    weights = {}
    if (run_dir / "model.safetensors").is_file():
        from safetensors.torch import load_file

        weights = load_file(str(run_dir / "model.safetensors"))
    return {"summary": json.loads((run_dir / "summary.json").read_text()), "rows": rows, "weights": weights}


@contextlib.contextmanager
def no_tf32():
    """fp32 matmuls and convolutions in fp32 (CUDA's default lets cuDNN use TF32 for convolutions)."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def first_loss(rows: list[dict]) -> Optional[float]:
    return rows[0].get("loss") if rows else None


def within(a: float, b: float, tol: dict) -> bool:
    return abs(a - b) <= tol["atol"] + tol["rtol"] * abs(b)


def weight_gap(dev: dict, cpu: dict) -> tuple[float, str, bool]:
    """(largest |d|, the tensor it is in, whether every element is within WEIGHT_TOL)."""
    worst, where, ok = 0.0, "", True
    if dev.keys() != cpu.keys():
        return math.inf, f"different tensors: {sorted(dev.keys() ^ cpu.keys())[:3]}", False
    for key, c in cpu.items():
        d = dev[key].cpu()
        if not c.is_floating_point():
            if not torch.equal(d, c):
                return math.inf, key, False
            continue
        d, c = d.double(), c.double()
        gap = (d - c).abs()
        if not torch.isfinite(d).all():
            return math.inf, key, False
        ok &= bool((gap <= WEIGHT_TOL["atol"] + WEIGHT_TOL["rtol"] * c.abs()).all())
        if gap.numel() and gap.max().item() > worst:
            worst, where = gap.max().item(), key
    return worst, where, ok


# ---- the checks -----------------------------------------------------------------------------------------

class Report:
    """Prints each result line as it comes and keeps them for --json (rewritten after each line)."""

    def __init__(self, json_path: Optional[Path]):
        self.json_path = json_path
        self.results: list[dict[str, Any]] = []
        self.since = time.monotonic()

    def add(self, check: str, name: str, status: str, detail: str, numbers: Optional[dict] = None) -> None:
        seconds, self.since = time.monotonic() - self.since, time.monotonic()
        print(f"{check} {name}: {status} ({seconds:.1f} s)" + (f" - {detail}" if detail else ""), flush=True)
        self.results.append({"check": check, "name": name, "status": status, "detail": detail,
                             "seconds": round(seconds, 2), **(numbers or {})})
        if self.json_path is not None:
            self.json_path.write_text(json.dumps(self.results, indent=1, default=str))

    def counts(self) -> dict[str, int]:
        out = {"ok": 0, "FAILED": 0, "not run": 0}
        for r in self.results:
            out[r["status"]] = out.get(r["status"], 0) + 1
        return out


def why(err: BaseException) -> str:
    text = str(err).splitlines()[0] if str(err) else ""
    if isinstance(err, ModuleNotFoundError):
        return f"needs the {err.name} package, which this host lacks ({text})"
    return f"{type(err).__name__}: {text}"[:400]


def missing_package(err: BaseException) -> bool:
    """An import that failed, directly or as the ConfigError fedguide raises for a missing extra."""
    return isinstance(err, ModuleNotFoundError) or "pip install" in str(err)


def agreement_run(name: str, where: str, pipelines: Pipelines, work: Path, quick: bool) -> dict[str, Any]:
    """``name``'s one-round run on ``where`` (the device or the CPU), TF32 off, guidance in float32."""
    config, overrides = method_overrides(name, pipelines)  # builds the tiny pipelines: needs diffusers
    extra = ["train.rounds=1", "runtime.workers=1", "guidance.dtype=float32", f"train.device={where}",
             f"guidance.feature_cache={work / name / where / 'cache'}"] + (["guidance.device=cpu"] if where == "cpu" else [])
    with no_tf32():
        return run(build(config, overrides + extra, quick), work / name / where / "run")


def failure(err: BaseException, where: str) -> Result:
    if isinstance(err, KeyboardInterrupt):
        raise err
    if isinstance(err, ReferenceFailed):
        return err.status, err.detail, {}
    if missing_package(err):
        return "not run", why(err), {}
    return "FAILED", f"on {where}: {why(err)}", {}


def agreement(name: str, device: str, pipelines: Pipelines, work: Path, quick: bool,
              references: Optional["References"] = None) -> Result:
    """``name`` one round on ``device`` and on the CPU, compared (module docstring). The CPU run comes from
    ``references`` (a process running them alongside) when given, else it runs here after the device's."""
    results = {}
    for where in (device, "cpu"):
        try:
            if where == "cpu" and references is not None:
                results[where] = references.get(name)
            else:
                results[where] = agreement_run(name, where, pipelines, work, quick)
        except BaseException as err:  # every method gets its line; KeyboardInterrupt still stops the script
            return failure(err, where)
    dev, cpu = results[device], results["cpu"]
    l_dev, l_cpu = first_loss(dev["rows"]), first_loss(cpu["rows"])
    problems = []
    if (l_dev is None) != (l_cpu is None):
        problems.append(f"loss reported on one device only ({l_dev} vs {l_cpu})")
    loss_text = "no training loss (the method trains no round loop)"
    if l_dev is not None and l_cpu is not None:
        if name in DEVICE_DRAWN:
            ok = math.isfinite(l_dev) and abs(l_dev - l_cpu) <= DEVICE_DRAWN_LOSS_RTOL * abs(l_cpu)
            loss_text = (f"first-round loss {l_dev:.6g} vs CPU {l_cpu:.6g} (within {DEVICE_DRAWN_LOSS_RTOL:.0%}: "
                         f"{DEVICE_DRAWN[name]})")
        else:
            ok = math.isfinite(l_dev) and within(l_dev, l_cpu, LOSS_TOL)
            loss_text = (f"first-round loss {l_dev:.6g} vs CPU {l_cpu:.6g} (|d| {abs(l_dev - l_cpu):.2e}, "
                         f"allowed {LOSS_TOL['atol']:g} + {LOSS_TOL['rtol']:g}*|loss|)")
        if not ok:
            problems.append("loss")
    numbers = {"loss_device": l_dev, "loss_cpu": l_cpu}
    if name in DEVICE_DRAWN:
        finite = all(torch.isfinite(t).all() for t in dev["weights"].values() if t.is_floating_point())
        weights_text = "weights finite, not compared" if finite else "weights NOT finite"
        if not finite:
            problems.append("weights")
    elif not cpu["weights"]:
        weights_text = "no model.safetensors to compare"
    elif name in LOOSE:
        spec = LOOSE[name]
        params = [k for k in cpu["weights"] if not k.endswith(BUFFERS)]
        gap = max((float((dev["weights"][k].cpu().double() - cpu["weights"][k].double()).abs().max()) for k in params
                   if k in dev["weights"] and cpu["weights"][k].is_floating_point()), default=math.inf)
        m_dev, m_cpu = dev["rows"][0].get(spec["metric"]), cpu["rows"][0].get(spec["metric"])
        ok = (gap <= spec["param_atol"] and m_dev is not None and m_cpu is not None
              and abs(m_dev - m_cpu) <= spec["metric_rtol"] * abs(m_cpu))
        numbers["weights_max_abs_diff"] = gap
        weights_text = (f"{spec['why']}: parameters max |d| {gap:.2e} (allowed {spec['param_atol']:g}), "
                        f"{spec['metric']} {m_dev} vs CPU {m_cpu} (allowed {spec['metric_rtol']:.0%})")
        if not ok:
            problems.append("weights")
    else:
        gap, where_, ok = weight_gap(dev["weights"], cpu["weights"])
        numbers["weights_max_abs_diff"] = gap
        weights_text = (f"final weights max |d| {gap:.2e}{' in ' + where_ if where_ else ''} (allowed "
                        f"{WEIGHT_TOL['atol']:g} + {WEIGHT_TOL['rtol']:g}*|w|)")
        if not ok:
            problems.append("weights")
    return "FAILED" if problems else "ok", f"{loss_text}; {weights_text}", numbers


class ReferenceFailed(Exception):
    """The CPU reference run of a method failed: its status and sentence, as the reference process wrote them."""

    def __init__(self, status: str, detail: str):
        super().__init__(detail)
        self.status, self.detail = status, detail


class References:
    """The agreement check's CPU runs, in a process of their own while this one runs the device's: the
    whole check then takes about the longer of the two halves, not their sum."""

    def __init__(self, names: list[str], work: Path, pipelines: Pipelines, quick: bool, deadline: float):
        self.work, self.deadline = work, deadline
        self.log = work / "references.log"
        cmd = [sys.executable, __file__, "--reference-child", str(work), "--pipelines", str(pipelines.folder),
               *(["--quick"] if quick else []), *names]
        self.proc = subprocess.Popen(cmd, stdout=self.log.open("w"), stderr=subprocess.STDOUT)

    def get(self, name: str) -> dict[str, Any]:
        folder = self.work / name / "cpu"
        while True:
            if (folder / "done").is_file():
                return read_run(folder / "run")
            if (folder / "error.json").is_file():
                err = json.loads((folder / "error.json").read_text())
                if err["status"] == "not run":
                    raise ModuleNotFoundError(err["detail"])
                raise ReferenceFailed(err["status"], err["detail"])
            if self.proc.poll() is not None:
                tail = self.log.read_text().strip().splitlines()[-1:] or [""]
                raise RuntimeError(f"the CPU reference process ended (exit {self.proc.returncode}) before {name}: "
                                   f"{tail[0][:200]}")
            if time.monotonic() > self.deadline:
                raise TimeoutError(f"the CPU reference run of {name} had not finished by the check's time budget")
            time.sleep(0.2)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def reference_child(work: Path, names: list[str], pipelines_folder: Path, quick: bool) -> None:
    """The CPU half of the agreement check, method by method: work/NAME/cpu/run and a done marker, or
    error.json with the status and sentence the parent reports."""
    pipelines = Pipelines(pipelines_folder)
    for name in names:
        folder = work / name / "cpu"
        try:
            agreement_run(name, "cpu", pipelines, work, quick)
            (folder / "done").touch()
        except Exception as err:
            status, detail, _ = failure(err, "cpu")
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "error.json").write_text(json.dumps({"status": status, "detail": detail}))


# -- transfers ------------------------------------------------------------------------------------------

class Counts:
    """Host syncs and host-to-device bytes, in total and inside optimiser steps; marks of the round ends."""

    def __init__(self):
        self.syncs = self.h2d = self.steps = self.step_syncs = self.step_h2d = 0
        self.in_step = False
        self.rounds: list[tuple[int, int]] = []  # (syncs, h2d) when each round was logged

    @contextlib.contextmanager
    def step(self):
        outer, self.in_step = self.in_step, True
        try:
            yield
        finally:
            self.in_step = outer
        if not outer:
            self.steps += 1

    def sync(self) -> None:
        self.syncs += 1
        self.step_syncs += self.in_step

    def copy(self, nbytes: int) -> None:
        self.h2d += nbytes
        if self.in_step:
            self.step_h2d += nbytes


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@contextlib.contextmanager
def counting_on_cuda(counts: Counts):
    """Counts what a CUDA run syncs and copies to the device: the training loop's step marks
    (``simulated.step``, a no-op off the simulated device) delimit the optimiser steps."""
    from fedguide.core import simulated

    saved: list[tuple[Any, str, Any]] = []

    def patch(owner, attr, make):
        original = getattr(owner, attr)
        saved.append((owner, attr, original))
        setattr(owner, attr, make(original))

    def host(t) -> bool:
        return isinstance(t, torch.Tensor) and t.device.type == "cpu"

    def wrap_move(original):
        def moved(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            if host(self) and isinstance(out, torch.Tensor) and out.is_cuda:
                counts.copy(_nbytes(self))
            return out
        return moved

    def wrap_copy(original):
        def copy_(self, src, *args, **kwargs):
            if self.is_cuda and host(src) and src.dim() > 0:
                counts.copy(_nbytes(src))
            return original(self, src, *args, **kwargs)
        return copy_

    def wrap_factory(original):
        def factory(data, *args, **kwargs):
            out = original(data, *args, **kwargs)
            if isinstance(out, torch.Tensor) and out.is_cuda and not (isinstance(data, torch.Tensor) and data.is_cuda):
                counts.copy(_nbytes(out))
            return out
        return factory

    def host_indices(self, index) -> int:
        items = index if isinstance(index, tuple) else (index,)
        return sum(_nbytes(i) for i in items if host(i) and i.dim() > 0) if self.is_cuda else 0

    def wrap_getitem(original):
        def getitem(self, index):
            counts.copy(host_indices(self, index)) if isinstance(self, torch.Tensor) else None
            return original(self, index)
        return getitem

    def wrap_setitem(original):
        def setitem(self, index, value):
            if isinstance(self, torch.Tensor) and self.is_cuda:
                counts.copy(host_indices(self, index) + (_nbytes(value) if host(value) and value.dim() > 0 else 0))
            return original(self, index, value)
        return setitem

    patch(simulated, "step", lambda _: counts.step)
    for attr in ("to", "cuda"):
        patch(torch.Tensor, attr, wrap_move)
    patch(torch.Tensor, "copy_", wrap_copy)
    patch(torch.Tensor, "__getitem__", wrap_getitem)
    patch(torch.Tensor, "__setitem__", wrap_setitem)
    for attr in ("tensor", "as_tensor"):
        patch(torch, attr, wrap_factory)
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            show = warnings.showwarning

            def counted(message, category, filename, lineno, file=None, line=None):
                if SYNC_WARNING in str(message):
                    counts.sync()
                else:
                    show(message, category, filename, lineno, file, line)

            warnings.showwarning = counted
            yield
    finally:
        torch.cuda.set_sync_debug_mode(mode)
        for owner, attr, original in reversed(saved):
            setattr(owner, attr, original)


def transfers(device: str, work: Path, quick: bool) -> Result:
    """FedAvg's syncs and copies on ``device`` against the simulated device's (module docstring)."""
    overrides = ["method.name=fedavg", "train.rounds=2", "data.on_device=true", "runtime.workers=1"]
    try:
        cfg = build(HASHES.SMOKE, overrides + ["train.device=simulated"], quick)
        expected = run(cfg, work / "transfers-simulated")["summary"]["device_check"]
        counts = Counts()
        if device == "cuda":
            def log(line):  # the engine logs each round once it is done: the counts so far mark its end
                if line.startswith("round "):
                    counts.rounds.append((counts.syncs, counts.h2d))
            with counting_on_cuda(counts):
                run(build(HASHES.SMOKE, overrides + ["train.device=cuda"], quick), work / "transfers-cuda", log)
            round2_h2d = counts.rounds[1][1] - counts.rounds[0][1] if len(counts.rounds) > 1 else counts.h2d
            measured = {"steps": counts.steps, "host_syncs_per_step": counts.step_syncs / max(counts.steps, 1),
                        "h2d_bytes_per_step": counts.step_h2d / max(counts.steps, 1), "host_syncs": counts.syncs,
                        "h2d_bytes": counts.h2d, "round2_h2d_bytes": round2_h2d}
        else:  # the dry run: the simulated device's own counters are the measurement
            measured = dict(expected, round2_h2d_bytes=None)
    except BaseException as err:
        if isinstance(err, KeyboardInterrupt):
            raise
        return "not run" if missing_package(err) else "FAILED", why(err), {}
    prepared_indices = sum(len(i) for i in prepare(cfg).data.client_indices) * cfg.train.epochs
    index_bytes = 8 * prepared_indices
    problems = []
    if measured["host_syncs_per_step"] > expected["host_syncs_per_step"]:
        problems.append("more host syncs per step than the simulated device counts")
    if measured["h2d_bytes_per_step"] > expected["h2d_bytes_per_step"]:
        problems.append("more host-to-device bytes per step than the simulated device counts")
    if measured["round2_h2d_bytes"] is not None and measured["round2_h2d_bytes"] > index_bytes + 64 * 1024:
        problems.append(f"round 2 copied {measured['round2_h2d_bytes']} bytes to the device, more than its index "
                        f"order ({index_bytes} bytes) + 64 KiB")
    detail = (f"{device}: {measured['steps']} steps, {measured['host_syncs_per_step']:.3f} host syncs and "
              f"{measured['h2d_bytes_per_step']:.0f} H2D bytes per step, {measured['host_syncs']} syncs and "
              f"{measured['h2d_bytes']} H2D bytes in all"
              + (f", round 2: {measured['round2_h2d_bytes']} H2D bytes" if measured["round2_h2d_bytes"] is not None
                 else "")
              + f"; simulated device: {expected['host_syncs_per_step']:.3f} syncs and "
              f"{expected['h2d_bytes_per_step']:.0f} bytes per step, {expected['host_syncs']} syncs and "
              f"{expected['h2d_bytes']} bytes in all")
    return ("FAILED" if problems else "ok", detail + ("; " + "; ".join(problems) if problems else ""),
            {"measured": measured, "simulated": expected})


# -- determinism (two fresh processes) and precision ---------------------------------------------------------

def small_cnn_raw(device: str, quick: bool, **train) -> list[str]:
    """CIFAR-10-shaped stand-in, a narrow ResNet-10 (an MLP with --quick: fp16 convolutions crawl on a CPU)."""
    model = ["model.name=mlp"] if quick else ["model.name=resnet10", "model.width=8"]
    return ["data.name=standin", "data.like=cifar10", f"data.scale={SCALES['cifar10'][1 if quick else 0]}",
            *model, f"train.device={device}", "runtime.workers=1"] + [f"train.{k}={v}" for k, v in train.items()]


def determinism_child(device: str, quick: bool, out: Path) -> None:
    cfg = load_small(small_cnn_raw(device, quick, rounds=2, deterministic="true", augment="crop_flip"))
    result = run(cfg, out / "run")
    digest = hashlib.sha256()
    for key in sorted(result["weights"]):
        digest.update(key.encode() + result["weights"][key].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    print(json.dumps({"rows": result["rows"], "weights": digest.hexdigest()}))


def load_small(overrides: list[str]):
    raw = load_raw(HASHES.SMOKE)
    raw["data"] = {}
    return build_config(apply_overrides(raw, overrides))


def start_determinism(device: str, quick: bool, work: Path) -> list[subprocess.Popen]:
    procs = []
    for k in range(2):
        (work / f"det{k}").mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, __file__, "--determinism-child", str(work / f"det{k}"), "--device", device] + \
            (["--quick"] if quick else [])
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def finish_determinism(procs: list[subprocess.Popen], deadline: float) -> Result:
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=None if math.isinf(deadline) else max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            return "FAILED", "a run did not finish in the time budget", {}
        if p.returncode != 0:
            tail = err.strip().splitlines()[-1] if err.strip() else f"exit {p.returncode}"
            return "FAILED", f"a run failed: {tail}", {}
        outs.append(json.loads(out.strip().splitlines()[-1]))
    a, b = outs
    same_rows, same_weights = a["rows"] == b["rows"], a["weights"] == b["weights"]
    detail = (f"two fresh processes, 2 rounds: metrics {'identical' if same_rows else 'DIFFER'}, final weights "
              f"{'identical' if same_weights else 'DIFFER'} (sha256 {a['weights'][:12]}"
              f"{'' if same_weights else ' vs ' + b['weights'][:12]})")
    if not same_rows:
        first = next(i for i, (x, y) in enumerate(zip(a["rows"], b["rows"])) if x != y)
        keys = [k for k in a["rows"][first] if a["rows"][first].get(k) != b["rows"][first].get(k)]
        detail += f"; round {first + 1} differs in {', '.join(keys[:5])}"
    return "ok" if same_rows and same_weights else "FAILED", detail, {}


def precision(p: str, device: str, work: Path, quick: bool) -> Result:
    """One round in ``p`` (bf16 or fp16): every loss and every final weight finite."""
    try:
        # channels_last on CUDA only: bf16 with channels_last aborts in the backward pass on PyTorch's CPU
        # kernels (2.13, resnet10 with mixed batch sizes, outside fedguide too), which the dry run runs on.
        cfg = load_small(small_cnn_raw(device, quick, rounds=1, precision=p,
                                       channels_last=str(device == "cuda").lower()))
        result = run(cfg, work / f"precision-{p}")
    except BaseException as err:
        if isinstance(err, KeyboardInterrupt):
            raise
        return "FAILED", why(err), {}
    losses = [r.get("loss") for r in result["rows"]]
    finite_loss = all(v is not None and math.isfinite(v) for v in losses)
    finite_w = all(bool(torch.isfinite(t).all()) for t in result["weights"].values() if t.is_floating_point())
    return ("ok" if finite_loss and finite_w else "FAILED",
            f"losses {', '.join(f'{v:.4f}' if v is not None else 'None' for v in losses)}"
            f"{'' if finite_loss else ' NOT finite'}; final weights {'finite' if finite_w else 'NOT finite'}; "
            f"accuracy {result['rows'][-1].get('accuracy')}", {"losses": losses})


def run_checks(args, names: list[str], chosen: list[str], pipelines: Pipelines, work: Path, deadline: float,
               report: Report) -> None:
    """transfers, precision and the agreement of each chosen method, each with its line."""
    if any(guided(n) for n in chosen):
        try:  # once, before the reference process starts using them; a failure is each method's to report
            pipelines.build_all()
        except Exception as err:
            print(f"gpu_checks: the tiny guidance pipelines could not be built: {why(err)}", flush=True)
    references = References(chosen, work, pipelines, args.quick, deadline) if chosen else None
    try:
        checks_in_order(args, names, chosen, pipelines, work, deadline, report, references)
    finally:
        if references is not None:
            references.close()


def checks_in_order(args, names, chosen, pipelines, work, deadline, report, references) -> None:
    if "transfers" in args.checks:
        report.add("transfers", "fedavg", *transfers(args.device, work, args.quick))
    if "precision" in args.checks:
        for p in ("bf16", "fp16"):
            report.add("precision", p, *precision(p, args.device, work, args.quick))
    for name in chosen:
        # No run is stopped half-way (an exception thrown into PyTorch mid-operation is not safe): a method
        # starts only while time is left, and device-check.sh's time cap names the one that was running.
        if deadline - time.monotonic() < 10:
            report.add("agreement", name, "not run", "the check's time budget was spent")
            continue
        print(f"agreement {name}: running", flush=True)
        report.since = time.monotonic()
        report.add("agreement", name, *agreement(name, args.device, pipelines, work, args.quick, references))
    for name in names if "agreement" in args.checks else []:
        if name not in chosen:
            report.add("agreement", name, "not run",
                       "--quick runs " + ", ".join(QUICK_METHODS) + " only" if args.quick else "not in --only")


# ---- main -------------------------------------------------------------------------------------------------

def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "simulated"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seconds", type=float, default=150.0)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--only", nargs="*", default=None, help="methods of the agreement check")
    ap.add_argument("--checks", nargs="+", choices=CHECKS, default=list(CHECKS),
                    help="which checks run (default: all); e.g. --checks agreement --only NAME ... to rerun some")
    ap.add_argument("--determinism-child", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--reference-child", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--pipelines", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("names", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.determinism_child is not None:
        determinism_child(args.device, args.quick, args.determinism_child)
        return 0
    if args.reference_child is not None:
        reference_child(args.reference_child, args.names, args.pipelines, args.quick)
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_checks: --device cuda, but torch cannot use CUDA here (--device simulated runs the dry run)")
        return 2
    start = time.monotonic()
    deadline = start + args.seconds
    report = Report(args.json)
    names = METHODS.names()
    chosen = [n for n in names if (args.only is None or n in args.only) and (not args.quick or n in QUICK_METHODS)
              and "agreement" in args.checks]
    unknown = sorted(set(args.only or []) - set(names))
    if unknown:
        ap.error(f"--only names no registered method: {', '.join(unknown)}")
    with tempfile.TemporaryDirectory(prefix="gpu-checks-") as tmp:
        work = Path(tmp)
        pipelines = Pipelines(work / "pipelines")
        # in parallel with the rest
        procs = start_determinism(args.device, args.quick, work) if "determinism" in args.checks else []
        # Stopped from outside (a time cap's SIGTERM): leave no determinism run behind.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        try:
            run_checks(args, names, chosen, pipelines, work, deadline, report)
        except BaseException:
            for p in procs:
                p.kill()
            raise
        if procs:
            report.add("determinism", "crop_flip", *finish_determinism(procs, deadline))
    c = report.counts()
    print(f"gpu_checks: {c['ok']} ok, {c['FAILED']} FAILED, {c['not run']} not run on {args.device} in "
          f"{time.monotonic() - start:.0f} s", flush=True)
    return 1 if c["FAILED"] else 0


if __name__ == "__main__":
    sys.exit(main())
