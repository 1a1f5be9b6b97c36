"""A run directory: every file and folder a run keeps, named in this one place.

    <run_dir>/                      RunDir(cfg.resolved_run_dir)
        config.yaml                 .config        the resolved run config (read back by
                                                   eval, export, analyze, generate, recl)
        ds_config.json              .ds_config     the DeepSpeed config derived from it
        status.json                 .status        {"state": finished | interrupted | failed
                                                   | running, "step"}: how the last job
                                                   ended (running: it is, or it died hard)
        tracking.json               .tracking      MLflow run id and store: a restarted job
                                                   continues the same MLflow run
        metrics.jsonl               .metrics       every logged step, MLflow or not
        loss_curve.png              .loss_curve
        eval_report.json            .eval_report   the final evaluation (also an artifact)
        model.safetensors           .exported      fp32 weights exported at the end
        checkpoints/                .checkpoints   train/checkpoint.py
        eval/                       .eval_dir      `memtrain eval` reports and sweeps
        analysis/                   .analysis      `memtrain analyze` plots
        jobs.jsonl                  .jobs          SLURM jobs submitted for the run
        sweep.json                  .sweep         a sweep's elements (`submit --sweep`)
        mlflow.db                   .own_store_uri a store of this run (or of a sweep's runs)
        submit-<time>.sbatch, slurm-<job>.out, hostfile-<job>, env-<job>.json
                                    .submit_script() ...
    <runs root>/mlflow.db, mlartifacts/             the store every run of a root shares
                                    shared_store_uri(RunDir(...).runs_root)

Files that readers may meet mid-write (status, tracking, configs) are written atomically
(data_pipeline/atomic.py, re-exported here). `python -m train.run_dir status <run_dir>`
prints the run's state for the sbatch script. `probe_server` is the one check that an MLflow
tracking server answers, for training and `memtrain compare` alike. Stdlib only: that command
and `memtrain jobs` start without torch.
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from data_pipeline.atomic import (
    AtomicFile,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
)

__all__ = ["RunDir", "read_json", "shared_store_uri", "sqlite_uri", "artifact_location",
           "probe_server", "HEALTH_TIMEOUT_S",
           "AtomicFile", "atomic_write_bytes", "atomic_write_json", "atomic_write_text",
           "FINISHED", "INTERRUPTED", "FAILED", "RUNNING", "STATES"]

# How a job left the run (status.json "state"). The sbatch script requeues "interrupted".
# "running" is written when training starts: still there after the job, it means the ranks
# died without writing an end (SIGKILL, a segfault, a lost node), which is not requeued.
FINISHED, INTERRUPTED, FAILED, RUNNING = "finished", "interrupted", "failed", "running"
STATES = (FINISHED, INTERRUPTED, FAILED, RUNNING)
STORE = "mlflow.db"                  # an MLflow sqlite store, in a runs root or a run dir
ARTIFACTS = "mlartifacts"            # its artifacts, beside it
HEALTH_TIMEOUT_S = 3.0               # a live tracking server answers /health within this


def sqlite_uri(db: str | Path) -> str:
    return f"sqlite:///{Path(db).absolute()}"


def shared_store_uri(runs_root: str | Path) -> str:
    """The store every run under `runs_root` logs to by default (runs/mlflow.db)."""
    return sqlite_uri(Path(runs_root) / STORE)


def artifact_location(tracking_uri: str) -> str | None:
    """Where a new experiment of a sqlite store keeps its artifacts: beside the db file, not
    in ./mlruns of whatever directory the command ran in (MLflow's default). None for other
    stores (a server chooses its own)."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    return str(Path(tracking_uri[len("sqlite:///"):]).absolute().parent / ARTIFACTS)


def probe_server(uri: str, timeout: float = HEALTH_TIMEOUT_S) -> None:
    """Raise ConnectionError if nothing answers at <uri>/health within `timeout` seconds: the
    one check, before MLflow's client retries a dead server for minutes, that training
    (train/tracking.py) and `memtrain compare` (compare/runs.py) make of a tracking server.
    Any HTTP answer, even 401/404 (a proxy, an auth layer), means someone is there: MLflow
    takes it from here."""
    url = uri.rstrip("/") + "/health"
    try:
        urllib.request.urlopen(url, timeout=timeout).close()
    except urllib.error.HTTPError:
        return
    except (urllib.error.URLError, OSError) as err:
        raise ConnectionError(f"no answer from {url}: {getattr(err, 'reason', err)}") from err


def read_json(path: str | Path) -> dict:
    """The JSON object in `path`, or {} when it is missing, unreadable or not an object:
    run files are read by commands that must keep going without them."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


@dataclass(frozen=True)
class RunDir:
    path: Path

    # Names the sbatch script needs with shell or SLURM placeholders ($SLURM_JOB_ID, %j).
    HOSTFILE = "hostfile-{job}"
    ENV_FILE = "env-{job}.json"
    SLURM_LOG = "slurm-{job}.out"
    SUBMIT_SCRIPT = "submit-{stamp}.sbatch"
    # Folder names, for code that only has a path inside the run (a checkpoint folder).
    CHECKPOINTS = "checkpoints"
    JOBS = "jobs.jsonl"
    EVAL_REPORT = "eval_report.json"

    def __post_init__(self):
        object.__setattr__(self, "path", Path(self.path))

    # ------------------------------------------------------------------ files and folders
    @property
    def config(self) -> Path:
        return self.path / "config.yaml"

    @property
    def ds_config(self) -> Path:
        return self.path / "ds_config.json"

    @property
    def status(self) -> Path:
        return self.path / "status.json"

    @property
    def tracking(self) -> Path:
        return self.path / "tracking.json"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def loss_curve(self) -> Path:
        return self.path / "loss_curve.png"

    @property
    def eval_report(self) -> Path:
        return self.path / self.EVAL_REPORT

    @property
    def exported(self) -> Path:
        return self.path / "model.safetensors"

    @property
    def checkpoints(self) -> Path:
        return self.path / self.CHECKPOINTS

    @property
    def eval_dir(self) -> Path:
        return self.path / "eval"

    @property
    def analysis(self) -> Path:
        return self.path / "analysis"

    @property
    def jobs(self) -> Path:
        return self.path / self.JOBS

    @property
    def sweep(self) -> Path:
        return self.path / "sweep.json"

    def hostfile(self, job: str) -> Path:
        return self.path / self.HOSTFILE.format(job=job)

    def env_file(self, job: str) -> Path:
        """Variables the DeepSpeed launcher cannot pass through srun (commas in the value)."""
        return self.path / self.ENV_FILE.format(job=job)

    def slurm_log(self, job: str) -> Path:
        return self.path / self.SLURM_LOG.format(job=job)

    def submit_script(self, stamp: str) -> Path:
        return self.path / self.SUBMIT_SCRIPT.format(stamp=stamp)

    # ------------------------------------------------------------------ MLflow stores
    @property
    def runs_root(self) -> Path:
        return self.path.parent

    @property
    def own_store_uri(self) -> str:
        return sqlite_uri(self.path / STORE)

    # ------------------------------------------------------------------ reading and writing
    def read_status(self) -> dict:
        """{"state", "step"} of the last job to end, {} when none wrote one."""
        return read_json(self.status)

    def write_status(self, state: str, step: int) -> None:
        if state not in STATES:
            raise ValueError(f"run state {state!r}: choose one of {', '.join(STATES)}")
        atomic_write_json(self.status, {"state": state, "step": int(step)})

    def read_tracking(self) -> dict:
        """{"run_id", "tracking_uri", "experiment"} of the run's MLflow run, or {}."""
        return read_json(self.tracking)

    def write_tracking(self, run_id: str, tracking_uri: str, experiment: str) -> None:
        atomic_write_json(self.tracking, {"run_id": run_id, "tracking_uri": tracking_uri,
                                          "experiment": experiment}, indent=2)

    def last_step(self) -> int | None:
        """The step of the last line of metrics.jsonl, None before the first log."""
        try:
            lines = self.metrics.read_text().splitlines()
            return int(json.loads(lines[-1])["step"]) if lines else None
        except (OSError, ValueError, KeyError, TypeError):
            return None


def main(argv: list[str] | None = None) -> int:
    """`python -m train.run_dir status <run_dir>`: the state of the run's last job, or
    "failed" when no job wrote one (it died before its end, or never started)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "status":
        print("usage: python -m train.run_dir status <run_dir>", file=sys.stderr)
        return 2
    print(RunDir(args[1]).read_status().get("state", FAILED))
    return 0


if __name__ == "__main__":
    sys.exit(main())
