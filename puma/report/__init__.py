"""A visual evaluation report of a training run (what ``jobs/report.py`` runs).

``build_report(cfg, ReportOptions(...))`` evaluates the run's checkpoint through the index exactly
as ``jobs/evaluate.py`` does (embedding the test split first when there is no index yet) and writes
one HTML page with its PNGs and report.json (default ``<run folder>/report``):

    data.py        the numbers: checkpoint, metrics through the index, zero-shot, history, other runs,
                   a sweep's trials.csv, few-shot results; the header's commit and versions
    embeddings.py  from the index's stored embeddings: retrieval grids, t-SNE maps; prompt-pool weights
    figures.py     PNGs with matplotlib (Agg)
    page.py        the HTML page
    build.py       gathers, draws and writes

The top layer of the import graph: it uses eval, inference, index, checkpoint, train.recovery,
models, data, config, storage and console; no other puma module imports it.
"""

from __future__ import annotations

from puma.report.build import ReportOutcome, build_report
from puma.report.data import NoRunError, ReportInputError, ReportOptions, SweepFileError

__all__ = ["NoRunError", "ReportInputError", "ReportOptions", "ReportOutcome", "SweepFileError",
           "build_report"]
