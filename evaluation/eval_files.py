"""What an evaluation of a run's checkpoint leaves behind (`memtrain eval --sweep`,
`--babilong`): its result as <run_dir>/eval/<kind>_<checkpoint>_<split>_<time>.json with the
files made from it beside it (a table, a plot), and, when the run is tracked, those files as
artifacts of the run's MLflow run and the result's curve as metrics whose step is the
curve's x (a memory length, a context length: tokens)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

from train.config import RunConfig
from train.run_access import log_to_run
from train.run_dir import RunDir, atomic_write_json


def save_and_log(cfg: RunConfig, result: dict, kind: str, step: int, tag: str, track: bool,
                 *, beside: Callable[[Path], list[Path]] = lambda stem: [],
                 curve: Sequence[tuple[str, float, int]] = ()) -> Path:
    """The result's JSON (returned), the files `beside(stem)` writes next to it (`stem`: the
    JSON's path without its suffix), and, if `track`, all of them logged to the run with
    `curve` as (metric, value, step) points."""
    out_dir = RunDir(cfg.resolved_run_dir).eval_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"{kind}_{tag}_{result['split']}_{time.strftime('%Y%m%d-%H%M%S')}"
    path = atomic_write_json(Path(f"{stem}.json"), result)
    files = [path, *beside(stem)]
    if track and cfg.tracking.enabled:
        log_to_run(cfg, step, None, [(f, out_dir.name) for f in files],
                   metric_steps=list(curve))
    return path
