"""Reports over finished (or still running) run directories: a Markdown results table and PNG plots.

    from fedguide.report import report
    result = report([Path("runs/fedavg-s0"), Path("runs/fedavg-s1")])
    print(result.markdown)
"""
from fedguide.report.document import ReportResult, report
from fedguide.report.plots import make_plots
from fedguide.report.runs import RunRecord, load_run
from fedguide.report.tables import results_table

__all__ = ["RunRecord", "ReportResult", "load_run", "make_plots", "report", "results_table"]
