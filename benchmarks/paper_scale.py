"""Cost projection of a paper config without its data: a few rounds on stand-in data of its dataset's shape.

The config's data section becomes ``data: {name: standin, like: <its dataset>}`` with the same image size,
domains, classes and caps (``fedguide.data.sources.standin``); model, method, partition, clients and train
settings stay. ``--fraction F`` draws F of both splits (the stand-in's ``scale``), so a CPU can time a
round of a GPU-sized config. Measured in one process:

  setup_s          everything before round 1 trains: drawing the data, partition, model, the method's
                   one-off set-up (FedDifRC's feature extraction, ...), at the measured fraction;
  s_per_round      a round's wall time (train, aggregate, evaluate, checkpoint) at the measured fraction,
                   the mean of rounds 2.. (round 1 warms up kernels and allocators; with --rounds 1, round 1);
  peak_gpu_gib     torch.cuda.max_memory_allocated over the run (n/a on a CPU);
  projected_hours  the config's train.rounds at full size: each measured round's training and evaluation
                   time divided by the fraction of training and test data drawn (linear in the data: exact at
                   --fraction 1), the rest (aggregation, checkpoint) as measured; rounds beyond the measured
                   ones cost the mean of rounds 2..; round 1 costs that mean plus first_round_extra_s, unscaled
                   (kernel selection and cuDNN's search per batch shape do not grow with the data); set-up
                   excluded;
  first_round_extra_s  round 1's wall time beyond the mean of rounds 2.. at the measured fraction (n/a with
                   --rounds 1);
  ratio_vs_floor   the timed rounds' training time over a bare PyTorch loop taking the same optimiser steps
                   (the same mini-batch sizes) on the same model, device, precision and memory format, data
                   already on the device, no augmentation (the floor). n/a for a method that trains its own way
                   (its ``fit`` is not the standard local loop: one-shot methods).

Guidance models given as hub ids cannot load offline: ``--guidance embedded`` swaps them for fedguide's
embedded models, ``--guidance tiny`` for a tiny random pipeline of the same layout (no package beyond
diffusers and transformers needed), ``--guidance sd-widths`` for a random pipeline with Stable Diffusion
1.5's channel widths (SD_WIDTHS: UNet 320-640-1280-1280 with one layer per block instead of two, VAE
128-256-512-512, a two-layer 768-wide text encoder), so that features taken from its UNet have SD's sizes
(FedDifRC's decoder layers 2-4: 1280, 640 and 320 channels, enough for fused_dim 512); either way the output
says so, and the guided costs are then those of the substitute, not of Stable Diffusion. The feature cache is a temporary folder, so set-up is measured,
not read from an earlier run's cache.

    .venv/bin/python benchmarks/paper_scale.py CONFIG [--rounds 2] [--device D] [--fraction F]
        [--guidance keep|embedded|tiny|sd-widths] [--feature-cache DIR] [overrides ...]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from _timing import synchronized_seconds
from bare_loop import batch_sizes

from fedguide.config import SECTION_KEYS, DataConfig, TrainConfig, apply_overrides, build_config, load_raw
from fedguide.core.training import make_optimizer
from fedguide.data.sources.standin import StandinParams, plan, standin_section
from fedguide.fl.engine import Experiment
from fedguide.fl.setup import prepare
from fedguide.methods import Method
from fedguide.models import build_model
from fedguide.registry import ConfigError

HUB_FREE = ("embedded", None)
# guidance_real_size.py's SD-1.5 sizes with one layer per block and two text layers: SD's feature widths at
# about two thirds of its UNet's parameters, built in seconds (random weights cost what trained ones do).
SD_WIDTHS = dict(image=512, unet=dict(block_out_channels=(320, 640, 1280, 1280), layers_per_block=1,
                                      attention_head_dim=8, cross_attention_dim=768),
                 text=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=2, num_attention_heads=12,
                           hidden_act="quick_gelu"),
                 vae=dict(block_out_channels=(128, 256, 512, 512), layers_per_block=1))
PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16}


# ---- the config: the paper's, on stand-in data ----------------------------------------------------

def standin_raw(path: Path, rounds: int, fraction: float, device: Optional[str], guidance: str, overrides: list[str],
                work: Path, say, feature_cache: Optional[Path] = None) -> tuple[dict[str, Any], int]:
    """(the raw config to run, the paper config's own train.rounds)."""
    raw = load_raw(path)
    data = dict(raw.get("data") or {"name": DataConfig().name})
    own = {k: data.pop(k) for k in SECTION_KEYS["data"] if k in data}  # data.fraction, ...: kept as they are
    raw["data"] = {**own, **standin_section(data.pop("name", DataConfig().name), data),
                   **({"scale": fraction} if fraction < 1 else {})}
    paper_rounds = int((raw.get("train") or {}).get("rounds", TrainConfig().rounds))
    raw.setdefault("train", {})["rounds"] = rounds
    if device is not None:
        if "device" not in TrainConfig.model_fields:
            if device != "cpu":
                raise ConfigError(f"--device {device}: this fedguide has no train.device setting; it trains on the CPU")
        else:
            raw["train"]["device"] = device
    guided = "guidance" in raw  # the paper configs of guided methods name their guidance model
    g = raw.setdefault("guidance", {})
    # A fresh cache: the set-up is measured, not read from an earlier run (unless a cache is given).
    g["feature_cache"] = str(feature_cache or work / "feature-cache")
    if feature_cache is not None and guided:
        say(f"feature cache: {feature_cache} (features an earlier run left there are not recomputed: setup_s "
            "leaves them out)")
    model = g.get("model", "embedded")  # only a hub id or a folder is swapped: the embedded models load offline
    if guidance == "embedded" and model not in HUB_FREE:
        g.update(model="embedded", image_encoder=None)
        say(f"guidance: {model} swapped for embedded (--guidance embedded): the guided costs below are the "
            "embedded models', not the paper's")
    elif guidance == "tiny" and model not in HUB_FREE:
        from fedguide.guidance.tiny import build_tiny_pipeline

        folder = build_tiny_pipeline(work / "tiny-guidance", seed=0, unclip="unclip" in str(model))
        g.update(model=str(folder), image_encoder=None)
        say(f"guidance: {model} swapped for a tiny random pipeline of the same layout (--guidance tiny): the "
            "guided costs below are not the paper's")
    elif guidance == "sd-widths" and model not in HUB_FREE:
        from guidance_real_size import build_pipeline

        folder = build_pipeline(work / "sd-widths-guidance", SD_WIDTHS, unclip=False)
        g.update(model=str(folder), image_encoder=None)
        say(f"guidance: {model} swapped for a random pipeline of Stable Diffusion 1.5's channel widths with one "
            "layer per block (--guidance sd-widths): feature sizes are SD's, the UNet's cost about two thirds of it")
    return apply_overrides(raw, overrides), paper_rounds


def offline_hub_model(path: Path) -> bool:
    """Whether the config names its guidance model by a hub id (no local folder of that name)."""
    with contextlib.suppress(ConfigError, AttributeError):
        model = (load_raw(path).get("guidance") or {}).get("model", "embedded")
        return model not in HUB_FREE and not Path(str(model)).expanduser().is_dir()
    return False


def check_memory(params: StandinParams, fraction: float) -> None:
    """Refuse, with the fraction that fits, a stand-in larger than the free host memory (uint8 while drawn,
    float32 once normalised)."""
    p = plan(params)
    per_sample = 8 * p.size if p.channels == 0 else 5 * p.channels * p.size ** 2
    need = (sum(p.train) + sum(p.test)) * per_sample
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return
    if need > 0.8 * free:
        raise ConfigError(f"the stand-in data needs about {need / 2**30:.1f} GiB and {free / 2**30:.1f} GiB are free; "
                          f"pass --fraction {max(0.001, fraction * 0.8 * free / need):.3f} or less")


# ---- the floor: the same steps in a bare loop --------------------------------------------------------

class Floor:
    """One model and optimiser, random mini-batches gathered from one tensor already on the device."""

    def __init__(self, prepared, device: torch.device, precision: str, channels_last: bool, seed: int = 0):
        cfg = prepared.config
        splits = prepared.data.splits
        torch.manual_seed(seed)
        self.model = build_model(cfg.model.name, prepared.resolved.model.params, splits.model_spec()).to(device)
        self.format = torch.channels_last if channels_last and splits.train_x.dim() == 4 else torch.contiguous_format
        self.model = self.model.to(memory_format=self.format)
        self.opt = make_optimizer(self.model, cfg.train)
        self.x, self.y = splits.train_x.to(device), splits.train_y.to(device)
        self.device = device
        self.dtype = PRECISIONS.get(precision)
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
        self.gen = torch.Generator(device=device).manual_seed(seed)

    def steps(self, sizes: list[int]) -> None:
        self.model.train()
        cast = (torch.autocast(self.device.type, dtype=self.dtype) if self.dtype is not None
                else contextlib.nullcontext())
        for b in sizes:
            idx = torch.randint(0, len(self.y), (b,), generator=self.gen, device=self.device)
            x = self.x[idx].contiguous(memory_format=self.format)
            with cast:
                loss = F.cross_entropy(self.model(x), self.y[idx])
            self.opt.zero_grad(set_to_none=True)
            if self.scaler is not None:
                self.scaler.scale(loss).backward()
                self.scaler.step(self.opt)
                self.scaler.update()
            else:
                loss.backward()
                self.opt.step()

    def seconds(self, sizes: list[int]) -> float:
        return synchronized_seconds(lambda: self.steps(sizes))


def standard_loop(method_cls: type) -> bool:
    """Whether the method's clients train with the standard local loop (regularisers add their terms to its
    loss), so that the floor takes the same steps."""
    return method_cls.fit is Method.fit


def round_sizes(prepared, clients: list[int]) -> list[int]:
    """The mini-batch sizes the standard local loop takes for these clients in one round."""
    train = prepared.config.train
    if train.local_steps is None:
        return batch_sizes(prepared, clients)
    return [min(train.batch_size, len(prepared.data.client_indices[c])) for c in clients
            for _ in range(train.local_steps)]


# ---- measuring -----------------------------------------------------------------------------------

def run_device(cfg) -> torch.device:
    spec = getattr(cfg.train, "device", "cpu")
    try:
        from fedguide.core.device import resolve_device
    except ImportError:
        return torch.device("cpu")
    return resolve_device(spec)


def measure(cfg, work: Path) -> dict[str, Any]:
    """One run: set-up, per-round walls (from the engine's round log lines), rows, peak GPU memory."""
    device = run_device(cfg)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    prepared = prepare(cfg)
    t_prepared = time.perf_counter()
    ends: list[float] = []

    def log(line: str) -> None:
        print(f"  | {line}", flush=True)
        if line.startswith("round "):
            if cuda:
                torch.cuda.synchronize(device)
            ends.append(time.perf_counter())

    t_run = time.perf_counter()
    summary = Experiment(prepared, work / "run", log=log).run()
    rows = [json.loads(x) for x in (work / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    walls = [b - a for a, b in zip(ends, ends[1:])]
    # Bookkeeping after a round (checkpoint, metrics file) is in the walls of rounds 2.., not in round 1's
    # engine time: add the same to round 1, the rest before it is set-up.
    extra = statistics.fmean(w - r["seconds"] for w, r in zip(walls, rows[1:])) if walls else 0.0
    walls = [rows[0]["seconds"] + extra] + walls
    setup = (t_prepared - t0) + (ends[0] - t_run - walls[0])
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
    return {"prepared": prepared, "rows": rows, "walls": walls, "setup": setup, "peak": peak, "device": device,
            "summary": summary}


def projected_hours(rows: list[dict], walls: list[float], train_share: float, test_share: float,
                    paper_rounds: int) -> float:
    """Hours for ``paper_rounds`` rounds at full size (see the module docstring)."""
    full = [w + r["train_seconds"] * (1 / train_share - 1) + r["eval_seconds"] * (1 / test_share - 1)
            for w, r in zip(walls, rows)]
    steady = statistics.fmean(full[1:]) if len(full) > 1 else full[0]
    if len(full) > 1:  # round 1: a later round plus its own extra, which does not grow with the data
        full[0] = steady + max(0.0, walls[0] - statistics.fmean(walls[1:]))
    total = sum(full[:paper_rounds]) + max(0, paper_rounds - len(full)) * steady
    return total / 3600


def shares(data_section: dict[str, Any]) -> tuple[float, float, int, int, int, int]:
    """(train share, test share, train drawn, test drawn, train full, test full) of the stand-in."""
    params = StandinParams(**{k: v for k, v in data_section.items() if k in StandinParams.model_fields})
    drawn, full = plan(params), plan(params.model_copy(update={"scale": 1.0}))
    tr, te, ftr, fte = sum(drawn.train), sum(drawn.test), sum(full.train), sum(full.test)
    return min(1.0, tr / ftr), min(1.0, te / fte), tr, te, ftr, fte


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", type=Path)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default=None, help="train.device for the run and the floor (default: the config's)")
    ap.add_argument("--fraction", type=float, default=1.0, help="share of both splits drawn (0 < F <= 1)")
    ap.add_argument("--guidance", choices=("keep", "embedded", "tiny", "sd-widths"), default="keep")
    ap.add_argument("--feature-cache", type=Path, default=None,
                    help="reuse and fill this guidance feature cache (default: a fresh one, so set-up is measured)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides applied last, e.g. method.name=fedavg")
    args = ap.parse_intermixed_args(argv)
    if args.rounds < 1 or not 0 < args.fraction <= 1:
        ap.error("--rounds must be >= 1 and --fraction in (0, 1]")
    say = print
    try:
        with tempfile.TemporaryDirectory(prefix="paper-scale-") as tmp:
            work = Path(tmp)
            raw, paper_rounds = standin_raw(args.config, args.rounds, args.fraction, args.device, args.guidance,
                                            args.overrides, work, say, args.feature_cache)
            cfg = build_config(raw)
            data = cfg.data.model_dump()
            check_memory(StandinParams(**{k: v for k, v in data.items() if k in StandinParams.model_fields}),
                         args.fraction)
            train_share, test_share, tr, te, ftr, fte = shares(data)
            say(f"paper_scale: {args.config} as {cfg.method.name} / {cfg.model.name} on stand-in like={data['like']} "
                f"(train {tr} of {ftr}, test {te} of {fte}), {args.rounds} of {paper_rounds} rounds, "
                f"torch {torch.__version__}")
            m = measure(cfg, work)
            prepared, rows, walls = m["prepared"], m["rows"], m["walls"]
            device = m["device"]
            timed = rows[1:] if len(rows) > 1 else rows
            train_cfg = prepared.config.train
            precision = getattr(train_cfg, "precision", "fp32")
            channels_last = bool(getattr(train_cfg, "channels_last", False))
            say(f"device: {device}" + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
                + f", precision {precision}, channels_last {channels_last}, augment "
                f"{getattr(train_cfg, 'augment', 'none')}, {m['summary']['workers']} worker(s) x "
                f"{m['summary']['threads_per_worker']} thread(s)")
            for r, w in zip(rows, walls):
                say(f"round {r['round']}: wall {w:.3f} s (train {r['train_seconds']:.2f}, aggregate "
                    f"{r['aggregate_seconds']:.2f}, eval {r['eval_seconds']:.2f}), accuracy {r['accuracy']:.4f}")
            if standard_loop(prepared.method_cls):
                floor = Floor(prepared, device, precision, channels_last, seed=prepared.config.seed)
                floor.steps(round_sizes(prepared, rows[0]["clients"])[:50])  # warm-up, like round 1
                sizes = [b for r in timed for b in round_sizes(prepared, r["clients"])]
                bare = floor.seconds(sizes)
                engine = sum(r["train_seconds"] for r in timed)
                say(f"floor: {len(sizes)} steps in {bare:.2f} s ({1e3 * bare / max(1, len(sizes)):.2f} ms/step); "
                    f"fedguide trained the same rounds in {engine:.2f} s")
                ratio = f"{engine / bare:.4f}" if bare > 0 else "n/a"
            else:
                ratio = "n/a"
                say(f"floor: n/a ({cfg.method.name} trains its own way, not with the standard local loop)")
            say(f"setup_s={m['setup']:.2f}")
            steady = statistics.fmean(walls[1:] if len(walls) > 1 else walls)
            say(f"s_per_round={steady:.3f}")
            # What the first round costs beyond a later one (kernel selection, cuDNN's search per new shape,
            # lazy initialisation); n/a with a single round. Kept out of the projection's per-round time.
            say(f"first_round_extra_s={walls[0] - steady:.3f}" if len(walls) > 1 else "first_round_extra_s=n/a")
            say(f"peak_gpu_gib={'n/a' if m['peak'] is None else format(m['peak'], '.3f')}")
            say(f"projected_hours={projected_hours(rows, walls, train_share, test_share, paper_rounds):.3f}")
            say(f"ratio_vs_floor={ratio}")
    except ConfigError as err:
        print(f"paper_scale: {err}", file=sys.stderr)
        if args.guidance == "keep" and offline_hub_model(args.config):
            print("paper_scale: a hub model that cannot load offline: pass --guidance embedded, tiny or sd-widths",
                  file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
