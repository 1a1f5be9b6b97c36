"""`memtrain compare`: one self-contained HTML report (plus a markdown summary) comparing
training runs recorded in MLflow, itself logged as a "comparison" MLflow run.

    runs.py     which runs (experiments, filter, ids) and what is read of each from MLflow
    summary.py  the numbers: differing params, final/best metrics with protocols, speed, sweeps
    plots.py    the figures (matplotlib Figure + Agg, no pyplot), as PNG bytes
    report.py   report.html (images as data: URIs, nothing external) and report.md
    cli.py      `main_compare(argv)`, and logging the report to a new MLflow run

Never imports torch: comparing runs must not cost a training stack's start-up.
"""
