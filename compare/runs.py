"""Which runs a comparison holds, and what is read of each from MLflow.

    client = open_store("sqlite:///runs/mlflow.db")     # or http://host:5000
    sel = select(client, experiments=["memtrain"], filter_string="params.model.mem_len = '32'")
    sel.runs       # RunData of every compared run, oldest first (run i is "#i+1" everywhere)
    sel.left_out   # LeftOut(who, reason) of everything that was asked for but is not compared

A selection is the union of experiment searches (--experiment, --filter) and explicit run
ids (--run-ids). Nothing in it may crash the report: an unknown experiment or id, a run of
another project (tag model_type is not memory-augmented-lm), a deleted run, a run beyond
--max-runs is *left out* with its reason; a run that lacks metrics or its eval report is
kept and its `problems` say what is missing. Only an unusable store or a selection with
nothing to compare is an error (SelectionError), because then there is no report to write.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from train.run_dir import RunDir, probe_server

MODEL_TYPE = "memory-augmented-lm"      # tag of every training run (train/trainer.py)
KIND_TAG = "memtrain.kind"              # "comparison" on the runs `memtrain compare` logs
# Metrics read as whole histories (plus valid_<reported metric>); of the others only the
# last value counts.
CURVES = ("loss", "valid_loss", "tokens_per_s", "peak_mem_mb")
# How a corpus is reported (eval_report.json's main.metric): bpc for characters, ppl for
# words, accuracy for tasks; anything else is shown as the loss in nats.
REPORTED = ("bpc", "ppl", "accuracy")
# Memory-length sweeps: the MLflow step of these is the evaluation mem_len, not a train step.
SWEEP = re.compile(r"^sweep_(?P<split>.+)_loss_tgt(?P<tgt>\d+)$")
# BABILong accuracies (evaluation/babilong_report.py): the step of these is the context
# length in tokens; the task is the last part of the name (qa1, qa2, ...).
BABILONG = re.compile(r"^babilong_(?P<split>.+)_(?P<task>[^_]+)$")
# One-off `memtrain eval` results (evaluation/cli.py names them this way).
ONE_OFF = re.compile(r"^eval_(?P<split>.+)_m(?P<mem>-?\d+)_l(?P<tgt>\d+)_loss$")
# Expected of a finished run; each one missing makes the run "incomplete" in the report.
EXPECTED = {"loss": "training loss", "valid_loss": "validation loss",
            "final_loss": "final evaluation", "tokens_per_s": "throughput",
            "peak_mem_mb": "peak memory"}
SEARCH_PAGE = 1000        # runs per search_runs request (MLflow's default page size)
MAX_SEARCHED = 10_000     # stop paging there: a store that big needs a --filter anyway
READERS = 8               # runs read at once from a server (each is ~8 small requests)


class SelectionError(Exception):
    """The store cannot be used or nothing is left to compare; the message is for the user."""


@dataclass
class LeftOut:
    who: str       # "run 1a2b… (name)", "experiment 'x'", ...
    reason: str


@dataclass
class RunData:
    run_id: str
    name: str
    experiment: str
    status: str
    start_time: int | None                  # ms since the epoch, as MLflow keeps it
    params: dict[str, str]
    tags: dict[str, str]
    latest: dict[str, float]                # last logged value of every metric
    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # step -> value
    eval_report: dict | None = None         # the run's eval_report.json artifact
    problems: list[str] = field(default_factory=list)

    @property
    def mechanism(self) -> str:
        return self.tags.get("mechanism") or self.params.get("model.mechanism") or "?"

    @property
    def reported_metric(self) -> str:
        """"bpc", "ppl", "accuracy" or "nats" (the loss itself, comparable for any corpus)."""
        main = (self.eval_report or {}).get("main")
        metric = main.get("metric") if isinstance(main, dict) else None
        if metric not in REPORTED and "final_accuracy" in self.latest:
            metric = "accuracy"
        return metric if metric in REPORTED else "nats"

    @property
    def steps(self) -> int | None:
        loss = self.curves.get("loss")
        return loss[-1][0] if loss else None


@dataclass
class Selection:
    runs: list[RunData]
    left_out: list[LeftOut]


# ---------------------------------------------------------------------------- the store
def open_store(uri: str):
    """An MlflowClient on `uri` after checking that a store is there: MLflow itself would
    create an empty sqlite file for a mistyped path, or retry a dead server for minutes."""
    # One tqdm bar per downloaded eval_report.json would bury the command's own output.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    if uri.startswith("sqlite:///"):
        db = Path(uri[len("sqlite:///"):])
        if not db.is_file():
            raise SelectionError(f"no MLflow store at {uri}: {db} does not exist (training "
                                 "runs share <runs root>/mlflow.db, e.g. runs/mlflow.db; "
                                 "--runs-root or --tracking-uri name another)")
    elif uri.startswith(("http://", "https://")):
        _probe(uri)
    elif uri.startswith("file:") or "://" not in uri:
        folder = Path(uri.removeprefix("file://").removeprefix("file:"))
        if not folder.is_dir():
            raise SelectionError(f"no MLflow store at {uri}: {folder} is not a directory")
    # mlflow takes ~1.5 s to import: only once the store is known to exist
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _probe(uri: str) -> None:
    # A dead server should cost seconds, not MLflow's minutes of retries with backoff; a
    # user's explicit setting of these variables wins.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
    try:
        probe_server(uri)  # any HTTP answer (an auth proxy, say): let MLflow talk to it
    except ConnectionError as err:
        cause = err.__cause__
        raise SelectionError(f"no MLflow server answers at {uri} "
                             f"({getattr(cause, 'reason', cause)})") from err


# ---------------------------------------------------------------------------- selection
def select(client, *, experiments=(), filter_string: str = "", run_ids=(),
           max_runs: int = 40, skip_experiment: str | None = None) -> Selection:
    """The runs to compare, read from the store. Experiments are searched when named, when a
    filter is given, or when no run ids are (then all of them but `skip_experiment`, where
    comparisons are logged); explicit run ids are added whatever the filter says."""
    left: list[LeftOut] = []
    names: dict[str, str] = {}   # experiment id -> name, filled as experiments are met
    found: dict[str, object] = {}
    if experiments or filter_string or not run_ids:
        exp_ids = _experiment_ids(client, experiments, skip_experiment, names, left)
        for run in _search(client, exp_ids, filter_string):
            found.setdefault(run.info.run_id, run)
    for run_id in dict.fromkeys(run_ids):
        run = _get_run(client, run_id, left)
        if run is not None:
            found.setdefault(run.info.run_id, run)

    kept = []
    for run in sorted(found.values(), key=lambda r: r.info.start_time or 0):
        why = _not_comparable(run)
        if why:
            left.append(LeftOut(_who(run), why))
        else:
            kept.append(run)
    if len(kept) > max_runs:  # the newest ones are usually the point of a comparison
        left += [LeftOut(_who(r), f"beyond --max-runs {max_runs} (the newest {max_runs} "
                                  "are compared)") for r in kept[:-max_runs]]
        kept = kept[-max_runs:]
    if not kept:
        why = "; ".join(f"{x.who}: {x.reason}" for x in left[:10]) or "no run matches"
        raise SelectionError(f"nothing to compare ({why})")

    exps = [_experiment_name(client, r.info.experiment_id, names) for r in kept]
    remote = str(getattr(client, "tracking_uri", "")).startswith(("http://", "https://"))
    with tempfile.TemporaryDirectory(prefix="memtrain-compare-") as scratch:
        def read(run, exp):
            return read_run(client, run, exp, Path(scratch))

        if remote:  # a server's latency, not its work, is the cost: read several runs at once
            with ThreadPoolExecutor(READERS) as pool:
                runs = list(pool.map(read, kept, exps))
        else:       # a sqlite store's connections are not meant to be shared across threads
            runs = [read(r, e) for r, e in zip(kept, exps, strict=True)]
    return Selection(runs, left)


def _experiment_ids(client, wanted, skip: str | None, names: dict, left: list) -> list[str]:
    if not wanted:
        exps = [e for e in client.search_experiments() if e.name != skip]
    else:
        exps = []
        for name in dict.fromkeys(wanted):
            exp = client.get_experiment_by_name(name)
            if exp is None or exp.lifecycle_stage == "deleted":
                left.append(LeftOut(f"experiment {name!r}", "no such experiment in the store"))
            else:
                exps.append(exp)
    names.update({e.experiment_id: e.name for e in exps})
    return [e.experiment_id for e in exps]


def _search(client, exp_ids: list[str], filter_string: str) -> list:
    from mlflow.exceptions import MlflowException  # lazily, as in open_store

    runs, token = [], None
    while exp_ids and len(runs) < MAX_SEARCHED:
        try:
            page = client.search_runs(exp_ids, filter_string, max_results=SEARCH_PAGE,
                                      order_by=["attributes.start_time DESC"],
                                      page_token=token)
        except MlflowException as err:
            if err.error_code == "INVALID_PARAMETER_VALUE":
                raise SelectionError(f"invalid --filter {filter_string!r}: {_line(err)} (e.g. "
                                     "--filter \"params.model.mechanism = 'xl'\")") from err
            raise SelectionError(f"searching the runs failed: {_line(err)}") from err
        runs += list(page)
        token = page.token
        if not token:
            break
    return runs


def _get_run(client, run_id: str, left: list):
    from mlflow.exceptions import MlflowException  # lazily, as in open_store

    try:
        return client.get_run(run_id)
    except MlflowException as err:
        reason = ("no such run in the store" if err.error_code == "RESOURCE_DOES_NOT_EXIST"
                  else f"cannot be read: {_line(err)}")
        left.append(LeftOut(f"run {run_id}", reason))
        return None


def _not_comparable(run) -> str | None:
    tags = run.data.tags
    if run.info.lifecycle_stage == "deleted":
        return "deleted run"
    if tags.get(KIND_TAG) == "comparison":
        return "a `memtrain compare` report, not a training run"
    if tags.get("model_type") != MODEL_TYPE:
        found = tags.get("model_type")
        return (f"not a memtrain training run (tag model_type is {found!r}, not {MODEL_TYPE!r})"
                if found else "not a memtrain training run (no model_type tag)")
    return None


def _who(run) -> str:
    name = run.info.run_name or run.data.tags.get("mlflow.runName")
    return f"run {run.info.run_id}" + (f" ({name})" if name else "")


def _experiment_name(client, exp_id: str, names: dict) -> str:
    if exp_id not in names:  # runs given by id may live in experiments never searched
        try:
            names[exp_id] = client.get_experiment(exp_id).name
        except Exception:  # a name is decoration: never fail a report for it
            names[exp_id] = exp_id
    return names[exp_id]


# ---------------------------------------------------------------------------- one run
def read_run(client, run, experiment: str, scratch: Path) -> RunData:
    """Everything the report shows of one run. What cannot be read becomes a line of
    `problems`: one unreadable metric must not cost the run, nor one run the report."""
    info, data = run.info, run.data
    out = RunData(run_id=info.run_id, name=info.run_name or info.run_id[:8],
                  experiment=experiment, status=info.status, start_time=info.start_time,
                  params=dict(data.params), tags=dict(data.tags),
                  latest={k: v for k, v in data.metrics.items() if _finite(v)})
    out.eval_report = _eval_report(client, info.run_id, scratch, out.problems)
    wanted = {*CURVES, f"valid_{out.reported_metric}"}
    for key in sorted(data.metrics):
        if key in wanted or SWEEP.match(key) or BABILONG.match(key):
            try:
                out.curves[key] = _by_step(client.get_metric_history(info.run_id, key))
            except Exception as err:
                out.problems.append(f"metric {key} unreadable: {_line(err)}")
    out.problems += [f"no {what} ({key}) logged" for key, what in EXPECTED.items()
                     if key not in out.latest]
    if out.problems and info.status != "FINISHED":  # often the reason: say it first
        out.problems.insert(0, f"run {info.status}")
    return out


def _by_step(history) -> list[tuple[int, float]]:
    """(step, value) sorted by step; at a step logged twice the later value wins (a run
    resumed from an older checkpoint logs some steps again). NaN/inf are dropped."""
    points: dict[int, float] = {}
    for m in sorted(history, key=lambda m: (m.step, m.timestamp)):
        if _finite(m.value):
            points[int(m.step)] = float(m.value)
    return sorted(points.items())


def _eval_report(client, run_id: str, scratch: Path, problems: list[str]) -> dict | None:
    name = RunDir.EVAL_REPORT  # logged by the training run under the same name as its file
    try:
        if name not in {a.path for a in client.list_artifacts(run_id)}:
            problems.append(f"no {name} artifact")
            return None
        local = client.download_artifacts(run_id, name, str(scratch / run_id))
        report = json.loads(Path(local).read_text())
    except Exception as err:
        problems.append(f"{name} unreadable: {_line(err)}")
        return None
    if not isinstance(report, dict):
        problems.append(f"{name} is not a JSON object")
        return None
    return report


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _line(err: BaseException) -> str:
    """An error as one short line: a server may answer with a whole HTML page."""
    return " ".join(str(err).split())[:300] or type(err).__name__
