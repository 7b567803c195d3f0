"""What the evaluator's CPU chunking buys: one test-set evaluation (``Evaluator.evaluate``, the pass every round
makes for the global model and, in personalised runs, for every client's model) of the configs' own models and
test sets, in chunks of ``core.evaluation.CPU_CHUNK`` images and in whole eval batches (the baseline), in the
same process, interleaved, at 1 and 2 threads. Then what ``Evaluator.encoder_reuse`` buys: ten clients' models
that share one body and keep their own heads (FedRep's clients under the averaged body) scored within it and
without it, at 1 thread.

    .venv/bin/python benchmarks/eval_chunks.py [--repeats 5] [--configs configs/feddw_fmnist.yaml configs/demo.yaml]

Prints the median seconds per evaluation, ``ratio=`` (chunked / whole) and whether the accuracies agree and how
far the test losses are apart; then the seconds for the ten clients, the ratio, and whether every score agrees.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def evaluator_of(config: Path):
    from fedguide.config import load_config
    from fedguide.fl.setup import prepare
    from fedguide.models import build_model
    from fedguide.core.evaluation import Evaluator
    from fedguide.core.weights import WeightLayout

    prepared = prepare(load_config(config))
    splits, cfg = prepared.data.splits, prepared.config
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model.name, prepared.resolved.model.params, splits.model_spec())
    layout = WeightLayout.of(model)
    return Evaluator(model, layout, splits.test_x, splits.test_y, cfg.train.eval_batch_size), layout.flatten(model)


def main() -> None:
    from fedguide.core import evaluation

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--configs", nargs="+", type=Path,
                    default=[REPO / "configs/feddw_fmnist.yaml", REPO / "configs/demo.yaml"])
    args = ap.parse_args()
    chunk = evaluation.CPU_CHUNK
    print(f"CPU_CHUNK={chunk}; median seconds per evaluation of the test set, {args.repeats} repeats, interleaved")
    print(f"{'config':<22} {'images':>7} {'batch':>6} {'threads':>7} {'chunked':>8} {'whole':>8} {'ratio':>6}"
          f" {'same acc':>8} {'|d loss|':>9}")
    for config in args.configs:
        evaluator, weights = evaluator_of(config)
        for threads in (1, 2):
            torch.set_num_threads(threads)
            times: dict[int, list[float]] = {chunk: [], 10 ** 9: []}
            scores = {}
            for _ in range(args.repeats + 1):  # the first round warms both up and is not timed
                for size in times:
                    evaluation.CPU_CHUNK = size
                    t0 = time.perf_counter()
                    scores[size] = evaluator.evaluate(weights)
                    times[size].append(time.perf_counter() - t0)
            evaluation.CPU_CHUNK = chunk
            a, b = (statistics.median(times[s][1:]) for s in times)
            same = scores[chunk]["accuracy"] == scores[10 ** 9]["accuracy"]
            gap = abs(scores[chunk]["test_loss"] - scores[10 ** 9]["test_loss"])
            print(f"{config.name:<22} {len(evaluator.y):>7} {evaluator.batch_size:>6} {threads:>7} {a:>8.3f} {b:>8.3f}"
                  f" {a / b:>6.2f} {str(same):>8} {gap:>9.2e}", flush=True)
    print("\nten clients under one body, each with its own head; median seconds for all ten, 1 thread")
    print(f"{'config':<22} {'reused':>8} {'alone':>8} {'ratio':>6} {'same scores':>11}")
    torch.set_num_threads(1)
    for config in args.configs:
        evaluator, weights = evaluator_of(config)
        head = evaluator.layout.span("head.")
        clients = []
        for cid in range(10):
            w = weights.clone()
            w[head] = torch.randn(head.stop - head.start, generator=torch.Generator().manual_seed(cid)) * 0.05
            clients.append(w)

        def reused():
            with evaluator.encoder_reuse():
                return [evaluator.evaluate(w) for w in clients]
        ways = {"reused": reused, "alone": lambda: [evaluator.evaluate(w) for w in clients]}
        times: dict[str, list[float]] = {name: [] for name in ways}
        scores = {}
        for _ in range(args.repeats + 1):
            for name, fn in ways.items():
                t0 = time.perf_counter()
                scores[name] = fn()
                times[name].append(time.perf_counter() - t0)
        a, b = statistics.median(times["reused"][1:]), statistics.median(times["alone"][1:])
        same = scores["reused"] == scores["alone"]
        print(f"{config.name:<22} {a:>8.2f} {b:>8.2f} {a / b:>6.2f} {str(same):>11}", flush=True)


if __name__ == "__main__":
    main()
