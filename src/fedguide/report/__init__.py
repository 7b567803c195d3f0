"""Reports over finished (or still running) run directories: results tables and PNG plots.

    from fedguide.report import report
    result = report([Path("runs/sweep")], vs="fedavg", rows="method", cols="partition")
    print(result.markdown)
"""
from fedguide.report.discover import find_run_dirs
from fedguide.report.document import ReportOptions, ReportResult, report
from fedguide.report.paired import bootstrap_interval, paired_comparisons, paired_table
from fedguide.report.pivot import pivot_data, pivot_table
from fedguide.report.plots import make_plots
from fedguide.report.runs import RunRecord, load_run, load_runs
from fedguide.report.tables import results_table, rounds_to_table

__all__ = ["ReportOptions", "ReportResult", "RunRecord", "bootstrap_interval", "find_run_dirs", "load_run", "load_runs",
           "make_plots", "paired_comparisons", "paired_table", "pivot_data", "pivot_table", "report",
           "results_table", "rounds_to_table"]
