"""The papers' analysis figures of a finished run (``fedguide analyze``), written as PNG + JSON into
RUN/analysis/: t-SNE of learned features, diffusion-feature maps, weight norms against class shares,
FedDW's SL/CR matrices, FLOPs of a local step, and generated images beside client originals. Each figure
is a module in figures/, registered in ``FIGURES`` (figure.py).

    from fedguide.analysis import analyze
    result = analyze("runs/demo-fedavg-s0", ["tsne", "sl_cr"])
    print(result.written, result.skipped)
"""
from fedguide.analysis.dispatch import AnalysisResult, analyze
from fedguide.analysis.figure import FIGURES, Figure

__all__ = ["FIGURES", "AnalysisResult", "Figure", "analyze"]
