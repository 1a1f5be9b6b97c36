"""`memtrain eval`: score a run's checkpoint under any evaluation protocol, without DeepSpeed.

The fp32 weights are consolidated from the checkpoint (any ZeRO stage) into a plain model;
launched on several ranks (torchrun / srun), each rank reads its rows and the sums are
all-reduced. The report goes to `<run_dir>/eval/` and into the run's MLflow run.
"""

from __future__ import annotations

import sys
import time

import torch

from train.checkpoint import CheckpointInfo, find_latest, read_checkpoint
from train.config import RunConfig
from train.distributed import device_for, resolve_env
from train.evaluate import evaluate, headline, protocol_for
from train.export import load_weights
from train.run_dir import FINISHED, INTERRUPTED, RunDir, atomic_write_json


def pick_checkpoint(cfg: RunConfig, name: str | None) -> CheckpointInfo | None:
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
    from train.tracking import Tracker

    tracker = Tracker(cfg.resolved_run_dir, experiment=cfg.tracking.experiment,
                      run_name=cfg.name, tracking_uri=cfg.tracking.uri or None)
    if metrics:
        tracker.log_metrics(metrics, step)
    for key, value, at in metric_steps:
        tracker.log_metrics({key: value}, at, local=False)
    for path, artifact_dir in artifacts:
        tracker.log_artifact(path, artifact_dir)
    run_state = RunDir(cfg.resolved_run_dir).read_status()
    tracker.close({FINISHED: "FINISHED", INTERRUPTED: "KILLED"}.get(
        run_state.get("state"), "FAILED" if run_state else "FINISHED"))


def run_eval(cfg: RunConfig, checkpoint: str | None, track: bool = True,
             sweep_points: list[tuple[int, int]] | None = None) -> dict | None:
    """Score the checkpoint under the run's eval protocol, or, with `sweep_points`
    ((tgt_len, mem_len) pairs), over a memory-length sweep (train/evaluation/sweep.py)."""
    from data_pipeline.shards import load_manifest

    env = resolve_env()
    if env.world_size > 1:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        torch.distributed.init_process_group(backend)
    device = device_for(env.local_rank)
    info = pick_checkpoint(cfg, checkpoint)
    if info is None:
        print(f"memtrain eval: no complete checkpoint in {cfg.resolved_run_dir}",
              file=sys.stderr)
        return None
    model = load_weights(info, cfg.model).to(device)
    manifest = load_manifest(cfg.data.path)
    try:
        if sweep_points:
            return _sweep(cfg, model, manifest, sweep_points, info, env, device, track)
        return _single(cfg, model, manifest, info, env, device, track)
    finally:
        if env.world_size > 1:
            torch.distributed.destroy_process_group()


def _single(cfg, model, manifest, info, env, device, track) -> dict:
    proto = protocol_for(cfg)
    report = evaluate(model, model, manifest, proto, env.rank, env.world_size, device,
                      url_template=cfg.data.url_template, seed=cfg.data.seed)
    report.update(checkpoint=info.path.name, step=info.step)
    if env.is_main:
        print(headline(report), flush=True)
        out_dir = RunDir(cfg.resolved_run_dir).eval_dir
        out_dir.mkdir(exist_ok=True)
        name = f"eval_{info.tag}_{proto.split}_{time.strftime('%Y%m%d-%H%M%S')}.json"
        atomic_write_json(out_dir / name, report)
        if track and cfg.tracking.enabled:
            tag = f"eval_{proto.split}_m{proto.mem_len}_l{proto.tgt_len}"
            log_to_run(cfg, info.step, {f"{tag}_loss": report["loss"]},
                       [(out_dir / name, out_dir.name)])
    return report


def _sweep(cfg, model, manifest, points, info, env, device, track) -> dict:
    from .sweep import format_table, run_sweep, save_and_log

    sweep = run_sweep(cfg, model, manifest, points, device, env.rank, env.world_size)
    sweep.update(checkpoint=info.path.name, step=info.step)
    if env.is_main:
        print(format_table(sweep), flush=True)
        path = save_and_log(cfg, sweep, info.step, info.tag, track)
        print(f"sweep written to {path} (and its .png)", flush=True)
    return sweep
