"""How much a method's one-round result moves under a perturbation at float32's rounding: the evidence behind
benchmarks/gpu_checks.py's LOOSE (methods whose GPU run cannot match the CPU's to WEIGHT_TOL by design).

Each method runs gpu_checks' agreement run (its config, sizes and stand-in data, one round on the CPU) twice:
as it is, and with every cross-entropy's logits multiplied by (1 + 2^-23 * N(0, 1)), a rounding-sized change
in every forward pass, as another device's kernels make. It prints the first-round loss difference, the largest
parameter difference, and that difference as a share of gpu_checks' WEIGHT_TOL (1 = at the tolerance).

    .venv/bin/python benchmarks/rounding_sensitivity.py [NAME ...]      (default: every method outside the
                                                                          guided ones, which need pipelines)
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_checks as checks  # noqa: E402

PLAIN_CROSS_ENTROPY = F.cross_entropy


def perturbed(generator: torch.Generator):
    def cross_entropy(logits, *args, **kwargs):
        noise = torch.randn(logits.shape, generator=generator).to(logits.device, logits.dtype)
        return PLAIN_CROSS_ENTROPY(logits * (1 + 2 ** -23 * noise), *args, **kwargs)
    return cross_entropy


def sensitivity(name: str, work: Path, pipelines: checks.Pipelines) -> str:
    results = []
    for tag, loss in (("plain", PLAIN_CROSS_ENTROPY), ("perturbed", perturbed(torch.Generator().manual_seed(0)))):
        F.cross_entropy = loss
        try:
            results.append(checks.agreement_run(name, "cpu", pipelines, work / tag, False))
        finally:
            F.cross_entropy = PLAIN_CROSS_ENTROPY
    a, b = results
    params = [k for k, t in a["weights"].items() if t.is_floating_point() and not k.endswith(checks.BUFFERS)]
    gap = {k: float((a["weights"][k] - b["weights"][k]).abs().max()) for k in params}
    share = {k: float(((a["weights"][k] - b["weights"][k]).abs()
                       / (checks.WEIGHT_TOL["atol"] + checks.WEIGHT_TOL["rtol"] * a["weights"][k].abs())).max())
             for k in params}
    la, lb = checks.first_loss(a["rows"]), checks.first_loss(b["rows"])
    worst = max(gap, key=gap.get, default=None)
    loss = "n/a" if la is None or lb is None else f"{abs(la - lb):.2e}"
    if worst is None:
        return f"| {name} | {loss} | n/a | n/a |"
    return f"| {name} | {loss} | {gap[worst]:.2e} ({worst}) | {max(share.values()):.3f} |"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*")
    args = ap.parse_args(argv)
    names = args.names or [n for n in checks.METHODS.names() if not checks.guided(n)]
    unknown = sorted(set(names) - set(checks.METHODS.names()))
    if unknown:
        ap.error(f"not registered methods: {', '.join(unknown)}")
    print("rounding sensitivity: one round on the CPU, plain vs logits x (1 + 2^-23 N(0,1)), "
          f"torch {torch.__version__}")
    print("| method | first-round loss, abs. difference | largest parameter difference | share of WEIGHT_TOL |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="rounding-") as tmp:
        pipelines = checks.Pipelines(Path(tmp) / "pipelines")
        for name in names:
            print(sensitivity(name, Path(tmp) / name, pipelines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
