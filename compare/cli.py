"""`memtrain compare`: compare training runs recorded in MLflow in one HTML report.

    memtrain compare                       # every run in runs/mlflow.db, the default store
    memtrain compare --runs-root /scratch/me/runs --experiment memtrain
    memtrain compare --tracking-uri http://127.0.0.1:5000 --filter "params.model.mechanism = 'xl'"
    memtrain compare --run-ids 1a2b... 3c4d... --out runs/compare-xl-vs-lamemo --no-log

Writes <out>/report.html (self-contained: plots inside, nothing loaded from elsewhere),
<out>/report.md with the PNGs it shows, and logs them as artifacts of a new MLflow run in
the experiment --log-experiment, tagged with the compared run ids. Runs that cannot be
compared are listed in the report with the reason; a store that cannot be opened or a
selection with nothing to compare exits with code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from train.run_dir import artifact_location, shared_store_uri

from .runs import KIND_TAG, SelectionError, open_store, select

LOG_EXPERIMENT = "memtrain-compare"
MAX_TAG_VALUE = 8000     # MLflow's tag value limit (mlflow.utils.validation)
RUNS_ROOT = "runs"       # where run directories go by default (run_dir: runs/{name})


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="memtrain compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tracking-uri", help="MLflow store: sqlite:///path/mlflow.db or a "
                   "server URL (default: env MLFLOW_TRACKING_URI, else the store training "
                   "runs share, <runs-root>/mlflow.db)")
    p.add_argument("--runs-root", help="folder holding the run directories and their "
                   f"shared mlflow.db (default {RUNS_ROOT}/; wins over MLFLOW_TRACKING_URI)")
    p.add_argument("--experiment", action="append", default=[], metavar="NAME",
                   help="search this experiment (repeatable; default: all experiments "
                   "unless --run-ids is given)")
    p.add_argument("--filter", default="", metavar="EXPR", help="MLflow search filter, "
                   "e.g. \"params.model.mechanism = 'xl'\" or \"metrics.final_loss < 2\"")
    p.add_argument("--run-ids", nargs="+", default=[], metavar="ID",
                   help="compare these runs too (added to any experiment search)")
    p.add_argument("--max-runs", type=int, default=40, help="compare at most this many runs, "
                   "the newest (default 40: plots stay readable up to there)")
    p.add_argument("--out", help="output directory (default: "
                   "<runs-root>/compare-<timestamp>)")
    p.add_argument("--title", help="report title (default: comparison of N runs)")
    p.add_argument("--log-experiment", default=LOG_EXPERIMENT, help="MLflow experiment of "
                   f"the comparison run (default {LOG_EXPERIMENT})")
    p.add_argument("--no-log", action="store_true", help="only write the files; no MLflow run")
    return p


def _selection_text(args) -> str:
    parts = []
    if args.experiment:
        parts.append("experiments " + ", ".join(repr(e) for e in args.experiment))
    elif args.filter or not args.run_ids:
        parts.append("all experiments" + (f" but {args.log_experiment!r}"
                                          if args.log_experiment else ""))
    if args.filter:
        parts.append(f"filter {args.filter!r}")
    if args.run_ids:
        parts.append("run ids " + ", ".join(args.run_ids))
    return "; ".join(parts)


def main_compare(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # The default is the store training writes to when no URI is set (train/tracking.py).
    root = Path(args.runs_root or RUNS_ROOT)
    uri = args.tracking_uri or (args.runs_root and shared_store_uri(root)) or \
        os.environ.get("MLFLOW_TRACKING_URI") or shared_store_uri(root)
    if args.max_runs < 1:
        print("memtrain compare: --max-runs must be at least 1", file=sys.stderr)
        return 2
    # mlflow takes ~1.5 s to import: not for --help or a bad option
    from mlflow.exceptions import MlflowException

    try:
        client = open_store(uri)
        sel = select(client, experiments=args.experiment, filter_string=args.filter,
                     run_ids=args.run_ids, max_runs=args.max_runs,
                     skip_experiment=args.log_experiment)
    except SelectionError as err:
        print(f"memtrain compare: {err}", file=sys.stderr)
        return 2
    except (MlflowException, OSError) as err:  # the store failed mid-way (OSError: network)
        msg = " ".join(str(err).split())[:500]
        print(f"memtrain compare: reading the runs at {uri} failed ({type(err).__name__}: "
              f"{msg})", file=sys.stderr)
        return 2

    # Imported after the selection: matplotlib is not needed to report a bad selection.
    from .report import write_report

    out = Path(args.out or root / f"compare-{time.strftime('%Y%m%d-%H%M%S')}")
    files = write_report(sel, out, title=args.title, source=uri,
                         selection=_selection_text(args))
    incomplete = sum(1 for r in sel.runs if r.problems)
    n = len(sel.runs)
    print(f"compared {n} run{'s' * (n != 1)} ({incomplete} incomplete, {len(sel.left_out)} "
          "left out: see the report's last section)")
    print(f"report: {files.html.absolute()}")
    print(f"summary: {files.markdown.absolute()}")
    if args.no_log:
        return 0
    try:
        run_id = log_comparison(client, uri, args.log_experiment, files,
                                [r.run_id for r in sel.runs], _selection_text(args))
    except Exception as err:  # the report is written; say why it is not in MLflow
        msg = " ".join(str(err).split())[:500]
        print(f"memtrain compare: the report is written but could not be logged to MLflow at "
              f"{uri} ({type(err).__name__}: {msg}); --no-log skips logging", file=sys.stderr)
        return 1
    print(f"comparison run: {run_id} (experiment {args.log_experiment!r} at {uri})")
    return 0


def log_comparison(client, uri: str, experiment: str, files, run_ids: list[str],
                   selection: str) -> str:
    """A new, finished MLflow run holding the report files as artifacts; its description is
    the markdown summary, so the MLflow UI shows the tables on the run's page."""
    exp_id = _experiment_id(client, uri, experiment)
    ids = ",".join(run_ids)
    tags = {KIND_TAG: "comparison", "memtrain.compared_run_ids": _clip(ids),
            "memtrain.compared_runs": str(len(run_ids)), "memtrain.selection": _clip(selection),
            "mlflow.note.content": _clip(files.markdown.read_text(encoding="utf-8"))}
    run = client.create_run(exp_id, run_name=f"compare-{len(run_ids)}-runs", tags=tags)
    run_id = run.info.run_id
    try:
        for path in files.all:
            client.log_artifact(run_id, str(path))
    except Exception:
        client.set_terminated(run_id, "FAILED")
        raise
    client.set_terminated(run_id, "FINISHED")
    return run_id


def _experiment_id(client, uri: str, name: str) -> str:
    exp = client.get_experiment_by_name(name)
    if exp is None:
        # As train/tracking.py: a sqlite store keeps artifacts beside its db file.
        return client.create_experiment(name, artifact_location=artifact_location(uri))
    if exp.lifecycle_stage == "deleted":
        client.restore_experiment(exp.experiment_id)
    return exp.experiment_id


def _clip(text: str) -> str:
    return text if len(text) <= MAX_TAG_VALUE else text[: MAX_TAG_VALUE - 15] + "...[truncated]"
