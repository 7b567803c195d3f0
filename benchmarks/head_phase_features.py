"""Head training on a frozen body: features computed once (``train_head``) against every step through the body.

Times, on the same opened run and the same client, FedRep's client round (τ_h head epochs, then the
representation) and FedBABU's personalisation (τ_f epochs of head fine-tuning) both ways: the shipped path,
and the path through the frozen body (``features_reusable`` forced false), alternating the two so drifts
of the machine hit both alike. Prints the best of ``--repeat`` times of each, their ratio, and the largest
difference between the two paths' weights (float rounding only).

    .venv/bin/python benchmarks/head_phase_features.py [--config configs/feddw_fmnist.yaml] [--repeat 3] [overrides ...]
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from _timing import synchronized_seconds  # noqa: E402

import fedguide.methods._personalise as personalise  # noqa: E402
from fedguide.config import load_config  # noqa: E402
from fedguide.fl.client_step import run_client  # noqa: E402
from fedguide.fl.setup import open_run, prepare  # noqa: E402
from fedguide.methods.compose import Hooks  # noqa: E402


@contextlib.contextmanager
def through_the_body():
    """The path before features were reused: every head step runs the frozen body."""
    reusable = personalise.features_reusable
    personalise.features_reusable = lambda *_: False
    try:
        yield
    finally:
        personalise.features_reusable = reusable


def fedrep_round(ctx, method, client: int):
    cfg = ctx.config
    payload = Hooks(method).server_payload(1, client, ctx.initial_weights)
    res = run_client(ctx, method, cfg.train, cfg.seed, 1, client, payload)
    return res.upload["shared"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", type=Path, default=REPO / "configs/feddw_fmnist.yaml")
    ap.add_argument("--client", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    cases = {"fedrep client round": (["method.name=fedrep"], fedrep_round),
             "fedbabu personalisation": (["method.name=fedbabu"],
                                         lambda ctx, m, c: m.personal_model(1, c, ctx.initial_weights))}
    print(f"config {args.config.name} {' '.join(args.overrides)}; client {args.client}; "
          f"torch threads {torch.get_num_threads()}")
    for name, (variant, step) in cases.items():
        with tempfile.TemporaryDirectory() as tmp:
            ctx, method = open_run(prepare(load_config(args.config, [*args.overrides, *variant])), Path(tmp), setup=True)
            fast_w = step(ctx, method, args.client)  # also the warm-up
            with through_the_body():
                slow_w = step(ctx, method, args.client)
            fast, slow = [], []
            for _ in range(args.repeat):
                fast.append(synchronized_seconds(lambda: step(ctx, method, args.client)))
                with through_the_body():
                    slow.append(synchronized_seconds(lambda: step(ctx, method, args.client)))
            diff = float((fast_w - slow_w).abs().max())
            print(f"{name}: features once {min(fast):.2f} s, through the body {min(slow):.2f} s, "
                  f"ratio {min(fast) / min(slow):.2f}, max |weight difference| {diff:.1e}")


if __name__ == "__main__":
    main()
