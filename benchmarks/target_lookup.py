"""Per-batch lookup of cached per-sample targets (FedDifRC's TDCL/NDCR features, SemanticFL's visual features) on
a GPU-like device: before, a memory-mapped gather on the host and a copy per batch; now, the client's rows moved to
the device once per round and a gather there by the batch's device indices (``ClientTargets``).

Runs on the simulated device (the CPU under CUDA's rules), which counts the bytes each way copies per batch, and
prints the host time per batch of each (median over one client's epoch, after a warm-up epoch), the once-per-round
cost of the new way, and the ratio. On a CPU the copy is a memcpy; on a GPU the old way's per-batch copy from
pageable memory also waits for the transfer.

    .venv/bin/python benchmarks/target_lookup.py [--samples 20000] [--client 5000] [--prompts 10] [--dim 128]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from fedguide.core.simulated import SIMULATED, SimulatedDevice
from fedguide.methods.diffusion_guided._diffusion_features import ClientTargets, RowLookup, lookup


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=20000)
    ap.add_argument("--client", type=int, default=5000)
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "features.npy"
        array = np.lib.format.open_memmap(path, mode="w+", dtype=np.float16,
                                          shape=(args.samples, args.prompts, args.dim))
        array[:] = rng.standard_normal(array.shape).astype(np.float16)
        array.flush()
        features = np.load(path, mmap_mode="r")
        rows = RowLookup(np.arange(args.samples))
        client = torch.as_tensor(np.sort(rng.choice(args.samples, args.client, replace=False)))
        device = SIMULATED
        sim = SimulatedDevice().__enter__()

        def epoch(step, own: torch.Tensor) -> list[float]:
            order = own[torch.randperm(len(own), generator=torch.Generator().manual_seed(1)).to(own.device)]
            times = []
            for start in range(0, len(order), args.batch):
                batch = order[start:start + args.batch]
                t0 = time.perf_counter()
                step(batch)
                times.append(time.perf_counter() - t0)
            return times

        def before(batch):
            return lookup(features, rows(batch)).to(device)

        ctx = SimpleNamespace(data=SimpleNamespace(indices=client), batch_indices=None, batch_device_indices=None)
        device_client = client.to(device)
        t0 = time.perf_counter()
        targets = ClientTargets(features, rows, ctx, args.samples, device)
        setup = time.perf_counter() - t0

        def after(batch):
            ctx.batch_device_indices = batch
            return targets(ctx)

        assert torch.equal(before(client[:7]).cpu(), after(device_client[:7]).cpu())  # the same rows, bit for bit
        for step, order in ((before, client), (after, device_client)):
            epoch(step, order)  # warm-up: the page cache, the allocator
        copied = {}
        for name, step, order in (("before", before, client), ("after", after, device_client)):
            start = sim.counters.h2d_bytes
            copied[name] = (statistics.median(epoch(step, order)) * 1e3,
                            (sim.counters.h2d_bytes - start) / -(-len(client) // args.batch))
        (old, old_bytes), (new, new_bytes) = copied["before"], copied["after"]
        sim.__exit__(None, None, None)
    print(f"# benchmarks/target_lookup.py --samples {args.samples} --client {args.client} --prompts {args.prompts} "
          f"--dim {args.dim} --batch {args.batch}  (float16 cache, 1 torch thread)")
    print(f"before: memmap gather + copy per batch   {old:.3f} ms/batch, {old_bytes:.0f} bytes host->device per batch")
    print(f"after:  device gather per batch         {new:.3f} ms/batch, {new_bytes:.0f} bytes host->device per batch (the epoch's index order) "
          f"(+ {setup * 1e3:.1f} ms once per round for the client's {args.client} rows)")
    print(f"ratio before/after={old / new:.2f}")


if __name__ == "__main__":
    main()
