"""Rank-0 experiment tracking: MLflow when it works, a local metrics.jsonl always.

    tracker = Tracker(run_dir, enabled=rank == 0, params=cfg.to_dict(), tags={...})
    tracker.log_metrics({"train/loss": 2.1, "lr": 2.5e-4}, step=10)
    tracker.close("FINISHED")   # plots run_dir/loss_curve.png and logs it first

Tracking is a side show of training and must never stop it: every MLflow call is wrapped,
the first failure is warned about once (naming the URI and the error), and from then on the
tracker is local-only. `run_dir/metrics.jsonl` gets every log_metrics call regardless, so
the numbers of a run survive a dead server, a full MLflow database or a missing package.

Where the run goes: `tracking_uri`, else env MLFLOW_TRACKING_URI, else one sqlite store
shared by every run under the same runs root, beside the run directory: `<run_dir>/../mlflow.db`
(`runs/mlflow.db`, artifacts in `runs/mlartifacts/`). So the runs of a project can be compared
in one place (`memtrain compare`, `mlflow ui --backend-store-uri sqlite:///runs/mlflow.db`).
A per-run store is one setting away: tracking_uri="sqlite:///runs/<name>/mlflow.db".
The run id and URI are kept in `run_dir/tracking.json`; a restarted job on the same run dir
and URI continues the same MLflow run, so one training run is one MLflow run across
preemptions. Without an explicit URI, a run whose tracking.json names a sqlite store that
exists keeps it: runs made when each run had its own `runs/<name>/mlflow.db` are still found.
mlflow is imported lazily: non-zero ranks (enabled=False) never pay its ~2 s import.

A sqlite store needs file locks where it lives (sqlite's own POSIX locks, and the flock of
`_sqlite_lock`); Lustre mounted without `-o flock` (or an NFS without lockd) refuses both.
Before touching such a store the tracker tries both on a probe file in its directory
(`_lock_problem`); where they fail it does not start MLflow at all and warns, naming the
directory, where the run's numbers go instead and how to get MLflow back.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import tempfile
import time
import warnings
from pathlib import Path

from .loss_curve import plot_loss_curve
from .run_dir import RunDir, artifact_location, atomic_write_json, probe_server, shared_store_uri

log = logging.getLogger(__name__)

# MLflow's limits (mlflow.utils.validation), copied so that disabled trackers import nothing.
MAX_PARAMS_PER_BATCH = 100
MAX_METRICS_PER_BATCH = 1000
MAX_PARAM_VALUE = 6000
MAX_TAG_VALUE = 8000
TRUNCATED = "...[truncated]"
STATUSES = ("FINISHED", "FAILED", "KILLED")


class TrackingWarning(UserWarning):
    """Tracking degraded (MLflow unreachable or failing, run not resumable); training goes on."""


def flatten_params(tree: dict, prefix: str = "") -> dict[str, str]:
    """{"model": {"mem_len": 4, "cutoffs": [1, 2]}} -> {"model.mem_len": "4", ...}.

    Lists and tuples become JSON (unambiguous, re-parsable); other leaves, None included,
    become str() as mlflow.log_params would render them. An empty dict stays visible as "{}".
    """
    out: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            out.update(flatten_params(value, name))
        elif isinstance(value, dict):
            out[name] = "{}"
        elif isinstance(value, (list, tuple)):
            out[name] = json.dumps(list(value), default=str)
        else:
            out[name] = str(value)
    return out


def _clip(value: str, limit: int) -> str:
    return value if len(value) <= limit else value[: limit - len(TRUNCATED)] + TRUNCATED


def _warn(msg: str) -> None:
    warnings.warn(msg, TrackingWarning, stacklevel=3)


def _param_key(key: str) -> str:
    # MLflow accepts only these characters in param, metric and tag names.
    return re.sub(r"[^/\w.\- :]", "_", key)


def recorded_store(run_dir: str | Path) -> str | None:
    """The sqlite store run_dir/tracking.json names, if that store exists (a run made with a
    per-run store, or by an older version that made one by default), else None."""
    uri = RunDir(run_dir).read_tracking().get("tracking_uri")
    if isinstance(uri, str) and uri.startswith("sqlite:///") and \
            Path(uri[len("sqlite:///"):]).is_file():
        return uri
    return None


class Tracker:
    """One training run's tracking; see the module docstring. Methods never raise."""

    def __init__(self, run_dir: str | Path, *, enabled: bool = True,
                 experiment: str = "memtrain", run_name: str | None = None,
                 tracking_uri: str | None = None, params: dict | None = None,
                 tags: dict | None = None, use_mlflow: bool = True):
        self.enabled = enabled
        self.run_dir = Path(run_dir).absolute()
        self.run = RunDir(self.run_dir)
        self.experiment = experiment
        self.run_id: str | None = None
        self.tracking_uri = ""
        self._client = None          # MlflowClient while MLflow works; None = local-only
        self._warned_local = False
        self._closed = False
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run.metrics
        if not use_mlflow:  # tracking.enabled: false -> metrics.jsonl and the plot only
            return
        self.tracking_uri = (tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
                             or recorded_store(self.run_dir)
                             or shared_store_uri(self.run.runs_root))
        problem = _lock_problem(self.tracking_uri)
        if problem is not None:   # sqlite would fail there, or corrupt the store: local-only
            self._no_locks(problem)
            return
        try:
            with _sqlite_lock(self.tracking_uri):
                self._start(run_name, params or {}, tags or {})
        except Exception as err:  # tracking must never stop training
            self._fail(err)

    # ------------------------------------------------------------------ starting / resuming
    def _start(self, run_name: str | None, params: dict, tags: dict) -> None:
        uri = self.tracking_uri
        if uri.startswith(("http://", "https://")):
            # MLflow's own client retries with backoff for minutes by default; these make a
            # dead server cost seconds. setdefault: a user's explicit choice wins.
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
            probe_server(uri)
        from mlflow import MlflowClient  # lazily: see the module docstring

        client = MlflowClient(tracking_uri=uri)
        flat = {_param_key(k): v for k, v in flatten_params(params).items()}
        run = self._resumable_run(client)
        resumed = run is not None
        if not resumed:
            run = client.create_run(self._experiment_id(client), run_name=run_name)
        self.run_id, self._client = run.info.run_id, client
        if not resumed:
            self._write_state()
        elif run.info.status != "RUNNING":  # a finished run continues: show it as running
            client.update_run(self.run_id, status="RUNNING")
        self._log_params(flat, run.data.params)
        self.set_tags(tags)

    def _resumable_run(self, client):
        """The run recorded in tracking.json, if it is on this URI and still alive."""
        state = self.run.read_tracking()
        old_id, old_uri = state.get("run_id"), state.get("tracking_uri")
        if not old_id or not old_uri:
            return None
        if old_uri != self.tracking_uri:
            _warn(f"tracking URI changed from {old_uri} to {self.tracking_uri}: "
                  f"starting a new MLflow run instead of continuing run {old_id}")
            return None
        from mlflow.exceptions import MlflowException  # lazily: see the module docstring

        try:
            run = client.get_run(old_id)
        except MlflowException as err:
            if err.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise  # a server error, not a missing run: go local-only
            run = None
        if run is None or run.info.lifecycle_stage == "deleted":
            _warn(f"MLflow run {old_id} no longer exists at {old_uri}: starting a new one")
            return None
        if state.get("experiment", self.experiment) != self.experiment:
            _warn(f"continuing run {old_id} in its experiment {state['experiment']!r}, "
                  f"not {self.experiment!r}")
        return run

    def _experiment_id(self, client) -> str:
        exp = client.get_experiment_by_name(self.experiment)
        if exp is None:
            # A sqlite store keeps artifacts beside its db file (for the shared store:
            # runs/mlartifacts), not in ./mlruns of whatever directory the job happened to
            # start in, which is MLflow's default. A server chooses its own location.
            where = artifact_location(self.tracking_uri)
            try:
                return client.create_experiment(self.experiment, artifact_location=where)
            except Exception:
                # Another run (a sweep element, a parallel job) created it a moment ago.
                exp = client.get_experiment_by_name(self.experiment)
                if exp is None:
                    raise
        if exp.lifecycle_stage == "deleted":
            client.restore_experiment(exp.experiment_id)
        return exp.experiment_id

    def _log_params(self, flat: dict[str, str], logged: dict[str, str]) -> None:
        """Log the params not yet in the run (`logged`: all of them for a new run). MLflow
        refuses to change a logged param, so a resumed run keeps its first values and a changed
        value becomes the tag `memtrain.resumed_param.<key>`, with a warning."""
        from mlflow.entities import Param  # lazily: see the module docstring

        clipped = {k: _clip(v, MAX_PARAM_VALUE) for k, v in flat.items()}
        new = [Param(k, v) for k, v in clipped.items() if k not in logged]
        self._log_batch("params", new, MAX_PARAMS_PER_BATCH)
        long = sorted(p.key for p in new if p.value != flat[p.key])
        if long:
            note = f"{', '.join(long)} cut to {MAX_PARAM_VALUE} characters (MLflow's limit)"
            log.warning("MLflow params %s", note)
            self.set_tags({"memtrain.truncated_params": note})
        changed = {k: v for k, v in clipped.items() if k in logged and logged[k] != v}
        if changed:
            _warn(f"resumed run {self.run_id} with changed params {', '.join(sorted(changed))}; "
                  "recorded as memtrain.resumed_param.* tags (MLflow keeps the first values)")
            self.set_tags({f"memtrain.resumed_param.{k}": v for k, v in changed.items()})

    def _write_state(self) -> None:
        self.run.write_tracking(self.run_id, self.tracking_uri, self.experiment)

    # ------------------------------------------------------------------ failure handling
    def _fail(self, err: BaseException) -> None:
        """Any MLflow error: warn, and local-only for the rest of the run. Local-only means no
        MLflow call is tried again, so this warns once and a hung server stalls training once
        (MLFLOW_HTTP_REQUEST_TIMEOUT), not at every step."""
        self._client = None
        msg = " ".join(str(err).split())[:500]  # one line; a server may send a whole page
        _warn(f"MLflow tracking at {self.tracking_uri} failed ({type(err).__name__}: {msg}); "
              f"continuing local-only, metrics go to {self.metrics_path}")

    def _no_locks(self, problem: str) -> None:
        folder = Path(self.tracking_uri[len("sqlite:///"):]).absolute().parent
        _warn(f"MLFLOW TRACKING IS OFF FOR THIS RUN: the sqlite store {self.tracking_uri} "
              f"needs file locks, and {folder} does not support them ({problem}; e.g. "
              "Lustre mounted without -o flock). This run's metrics go only to "
              f"{self.metrics_path} (its config, eval report and loss curve stay in "
              f"{self.run_dir}). To track in MLflow: mount that file system with -o flock, "
              "or set tracking.uri (or MLFLOW_TRACKING_URI) to an MLflow server "
              "(tracking.uri=http://HOST:5000) or to a sqlite file in a directory with "
              "locks (tracking.uri=sqlite:////home/USER/mlflow.db)")

    def _mlflow(self, method: str, *args, **kwargs) -> None:
        """self._client.<method>(...) unless local-only; any error makes it local-only."""
        if self._client is None:
            return
        try:
            getattr(self._client, method)(*args, **kwargs)
        except Exception as err:  # tracking must never stop training
            self._fail(err)

    def _log_batch(self, kind: str, items: list, size: int) -> None:
        # MLflow takes at most 100 params/tags and 1000 metrics per log_batch call.
        for i in range(0, len(items), size):
            self._mlflow("log_batch", self.run_id, **{kind: items[i:i + size]})

    # ------------------------------------------------------------------ public API
    def log_metrics(self, metrics: dict[str, float], step: int, *, local: bool = True) -> None:
        """local=False: MLflow only, for curves whose x axis is not the training step (a
        memory-length sweep): metrics.jsonl stays a record of training steps."""
        if not self.enabled:
            return
        values: dict[str, float] = {}
        for k, v in metrics.items():
            try:
                values[k] = float(v)  # python numbers, numpy scalars, 0-d tensors
            except (TypeError, ValueError):
                log.warning("metric %s=%r is not a number; not logged", k, v)
        now = time.time()
        try:
            if local:
                with open(self.metrics_path, "a") as f:
                    f.write(json.dumps({"step": int(step), "time": now, **values}) + "\n")
        except OSError as err:
            if not self._warned_local:
                self._warned_local = True
                _warn(f"cannot append to {self.metrics_path}: {err}")
        if self._client is None or not values:
            return
        from mlflow.entities import Metric  # lazily: see the module docstring

        ms = int(now * 1000)
        batch = [Metric(_param_key(k), v, ms, int(step)) for k, v in values.items()]
        self._log_batch("metrics", batch, MAX_METRICS_PER_BATCH)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        if not self.enabled or self._client is None:
            return
        path = Path(path)
        if not path.exists():  # the caller's mistake, not MLflow's: keep tracking on
            log.warning("artifact %s does not exist; not logged", path)
            return
        method = "log_artifacts" if path.is_dir() else "log_artifact"
        self._mlflow(method, self.run_id, str(path), artifact_path)

    def log_json(self, data: dict, name: str) -> Path:
        path = self.run_dir / name
        if not self.enabled:
            return path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(path, data, indent=2, default=str)
        except OSError as err:
            log.warning("cannot write %s: %s", path, err)
            return path
        # name "eval/report.json" lands at artifact eval/report.json, as in the run dir.
        sub = Path(name).parent.as_posix()
        self.log_artifact(path, None if sub == "." else sub)
        return path

    def set_tags(self, tags: dict) -> None:
        if not self.enabled or self._client is None or not tags:
            return
        from mlflow.entities import RunTag  # lazily: see the module docstring

        items = [RunTag(_param_key(str(k)), _clip(str(v), MAX_TAG_VALUE)) for k, v in tags.items()]
        self._log_batch("tags", items, MAX_PARAMS_PER_BATCH)

    def close(self, status: str | None = "FINISHED") -> None:
        """End this process's use of the run, recording `status`; None leaves the MLflow run's
        status as it is (an evaluation tool logging into a run whose training is still live)."""
        if not self.enabled or self._closed:
            return
        self._closed = True
        if status is None:
            self._client = None
            return
        if status not in STATUSES:  # a typo must not leave the run RUNNING forever
            log.warning("unknown run status %r; recording FAILED", status)
            status = "FAILED"
        try:
            png = plot_loss_curve(self.metrics_path, self.run.loss_curve)
        except Exception as err:  # a plotting bug must not fail the run's end
            log.warning("loss curve not plotted: %s", err)
            png = None
        if png is not None:
            self.log_artifact(png)
        self._mlflow("set_terminated", self.run_id, status)
        self._client = None  # later calls (if any) are local-only


def _lock_problem(uri: str) -> str | None:
    """For a sqlite store: why its directory cannot lock files (flock, as _sqlite_lock
    takes, and a POSIX record lock, as sqlite takes), tried on a probe file there; None
    when both work, for other stores, or when no probe file can be made (then MLflow's own
    error says why)."""
    if not uri.startswith("sqlite:///"):
        return None
    folder = Path(uri[len("sqlite:///"):]).absolute().parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".memtrain-lock-probe-") as probe:
            for name, lock in (("flock", fcntl.flock),
                               ("a POSIX record lock (fcntl F_SETLK)", fcntl.lockf)):
                try:
                    lock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)   # a fresh file: never busy
                    lock(probe, fcntl.LOCK_UN)
                except OSError as err:
                    code = errno.errorcode.get(err.errno, str(err.errno))
                    return f"{name} failed with {code}: {err.strerror}"
    except OSError:
        return None
    return None


@contextlib.contextmanager
def _sqlite_lock(uri: str):
    """Hold an exclusive lock beside a sqlite store while a run starts. Two jobs opening a
    NEW store at once (sweep elements sharing one) race on MLflow's schema migration, and
    the loser leaves the database half-migrated ("duplicate column name") for good; once
    created, sqlite serialises writers itself. Other stores need no lock."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    db = Path(uri[len("sqlite:///"):]).absolute()
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_name(db.name + ".lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
