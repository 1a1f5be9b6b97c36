"""A run directory opened again after training: its config, one of its checkpoints, and its
MLflow run to add results to.

What the commands that come after `memtrain train` share: export (train/cli.py) and the
evaluation tools (evaluation/: eval, sweep, recl, analyze, generate). Keeping them here, in
one module below both, is what lets `evaluation/cli.py` and `evaluation/sweep.py` import each
other's helpers without importing each other.
"""

from __future__ import annotations

from model import ConfigError

from .checkpoint import CheckpointInfo, find_latest, read_checkpoint
from .config import RunConfig, load_config
from .run_dir import FINISHED, INTERRUPTED, RUNNING, RunDir
from .tracking import Tracker


def load_run_config(run_dir: str, overrides: list[str]) -> RunConfig:
    """The config a run directory was trained with (its config.yaml), with `overrides`."""
    path = RunDir(run_dir).config
    if not path.is_file():
        raise ConfigError("--run-dir", f"{path} not found: not a memtrain run directory")
    return load_config(path, [*overrides, f"run_dir={run_dir}"])


def pick_checkpoint(cfg: RunConfig, name: str | None) -> CheckpointInfo | None:
    """The run's checkpoint folder `name` (FileNotFoundError if it is not complete), or with
    no name the latest complete one (None if there is none)."""
    root = RunDir(cfg.resolved_run_dir).checkpoints
    if name is None:
        return find_latest(root)
    info = read_checkpoint(root / name)
    if info is None:
        raise FileNotFoundError(f"{root / name} is not a complete checkpoint")
    return info


def log_to_run(cfg: RunConfig, step: int, metrics: dict[str, float] | None = None,
               artifacts: list[tuple] = (), metric_steps: list[tuple[str, float, int]] = ()
               ) -> None:
    """Add evaluation results to the training run's MLflow run (same run dir, same run id).

    metrics are logged at `step`; metric_steps are (key, value, step) triples for curves
    whose x axis is not the training step (e.g. a memory-length sweep). artifacts are
    (path, artifact_dir) pairs. The run's status stays what training left (e.g. KILLED when
    it was interrupted), not FINISHED because an evaluation finished."""
    tracker = Tracker(cfg.resolved_run_dir, experiment=cfg.tracking.experiment,
                      run_name=cfg.name, tracking_uri=cfg.tracking.uri or None)
    if metrics:
        tracker.log_metrics(metrics, step)
    for key, value, at in metric_steps:
        tracker.log_metrics({key: value}, at, local=False)
    for path, artifact_dir in artifacts:
        tracker.log_artifact(path, artifact_dir)
    run_state = RunDir(cfg.resolved_run_dir).read_status()
    if run_state.get("state") == RUNNING:  # training live (or crashed): leave its MLflow status
        tracker.close(None)
        return
    tracker.close({FINISHED: "FINISHED", INTERRUPTED: "KILLED"}.get(
        run_state.get("state"), "FAILED" if run_state else "FINISHED"))
