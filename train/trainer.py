"""Setting up a training run on this rank: process group, device, data, engine, resume,
tracking; then `TrainingLoop` (loop.py) runs it. One function, `train(cfg)`, run by every
rank; `main_entry` turns its errors into exit codes for `memtrain train`.
"""

from __future__ import annotations

import subprocess
from dataclasses import asdict
from pathlib import Path

import torch

from data_pipeline.shards import MANIFEST, ShardError, load_manifest
from data_pipeline.streams import LayoutError, rows_of_rank
from data_pipeline.synthetic import write_repeat_corpus
from memtrain.command_line import error_line
from model import ConfigError, backbone_of
from model.io import load_initial

from . import checkpoint as ckpt
from .bptt import TrainState, WindowPlan
from .config import RunConfig, dump_yaml
from .distributed import resolve_env
from .engine import build_ds_config, initialize, zero_stage
from .evaluate import protocol_for
from .gpu_binding import device_for
from .loop import LoopParts, NonFiniteLoss, TrainingLoop
from .master_weights import gathers_masters, scored_weights
from .precision import check_precision, configure_matmul
from .pretrained import build_for_engine
from .process_group import barrier, init_process_group, rank_seed
from .regime import DataRegime, regime_of
from .resume import restore
from .run_dir import RUNNING, RunDir, atomic_write_json, atomic_write_text
from .tracking import Tracker


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=5).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def check_run(cfg: RunConfig, world_size: int, device: torch.device) -> None:
    """Checks that need the world or the device, still before any engine exists."""
    rows_of_rank(cfg.data.global_batch, 0, world_size)  # LayoutError with the numbers
    try:
        rows_of_rank(cfg.eval.batch or cfg.data.global_batch, 0, world_size)
    except LayoutError as err:
        raise ConfigError("eval.batch", str(err)) from None
    check_precision(cfg.deepspeed.precision, device)


def open_data(cfg: RunConfig, rank: int) -> tuple[DataRegime, WindowPlan]:
    """The data regime of the manifest (generated first by rank 0 for `data.generate`),
    checked against the model, and the BPTT window plan it gives (refusing what cannot be
    planned), both before any engine exists."""
    path = Path(cfg.data.path)
    if cfg.data.generate and rank == 0 and not (path / MANIFEST).exists():
        write_repeat_corpus(path, n_symbols=cfg.model.vocab_size, seed=cfg.data.seed)
    barrier()
    manifest = load_manifest(cfg.data.path)
    regime = regime_of(manifest)
    backbone = backbone_of(cfg.model)
    backbone.check_training_data(cfg.model, manifest, cfg.data.path, announce=rank == 0)
    if backbone.finetune(cfg.model) == "frozen" and rank == 0:
        regime.warn_frozen_base("memtrain train")
    regime.check_segments(cfg.model.tgt_len, cfg.data.path)
    return regime, regime.window_plan(cfg.bptt)


def train(cfg: RunConfig, resume: bool | str = True) -> int:
    """Run (or continue) the training run `cfg` on this rank. resume: True = continue the
    latest checkpoint if any, False = refuse a run directory with checkpoints, "require" =
    fail unless there is one."""
    env = resolve_env()
    run = RunDir(cfg.resolved_run_dir)
    if env.is_main:
        # "running" before anything below can fail (process group, device, data, the
        # checkpoint choice): "running" left after the job means it died, which the sbatch
        # script does not requeue; a previous job's "interrupted" would be, again and again.
        # A fresh run refused for the checkpoints it found keeps their run's state.
        latest = ckpt.find_latest(run.checkpoints)
        if resume or latest is None:
            run.path.mkdir(parents=True, exist_ok=True)
            run.write_status(RUNNING, latest.step if latest is not None else 0)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    init_process_group(env, timeout_minutes=cfg.distributed.timeout_minutes)
    device = device_for(env.local_rank)
    check_run(cfg, env.world_size, device)
    if env.is_main:
        for note in cfg.model.mech.training_notes(cfg.model, cfg.bptt.depth):
            print(f"memtrain: {note}", flush=True)
    numerics = configure_matmul(cfg.deepspeed.precision, cfg.deepspeed.tf32, device,
                                env.is_main)
    if env.is_main:
        print(f"memtrain: training in {numerics}", flush=True)
    run_dir, ckpt_root = run.path, run.checkpoints
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    barrier()
    regime, plan = open_data(cfg, env.rank)
    stream = regime.train_stream(cfg, env.rank, env.world_size)
    curriculum = regime.curriculum(cfg.curriculum, stream, cfg.data.path)
    info = ckpt.agreed_latest(ckpt_root) if resume else None   # rank 0's choice, on all
    if resume == "require" and info is None:
        raise ConfigError("--resume", f"no complete checkpoint in {ckpt_root}")
    if not resume and ckpt.agreed_latest(ckpt_root) is not None:
        raise ConfigError("run_dir", f"{run_dir} already holds checkpoints; resume it, or "
                          "choose another name / run_dir for a fresh run")
    ds_config = build_ds_config(cfg, env.world_size, load_universal=bool(
        info and info.world_size != env.world_size and info.zero_stage > 0))
    if info is not None and info.zero_stage != zero_stage(ds_config):
        raise ConfigError("deepspeed.zero_stage", f"the checkpoint {info.path} was saved at "
                          f"ZeRO-{info.zero_stage}; resume at the same stage (changing it "
                          "through DeepSpeed's universal checkpoint fails)")
    if env.is_main:
        atomic_write_text(run.config, dump_yaml(cfg))
        atomic_write_json(run.ds_config, ds_config, default=str)
        # The resolved config is worth reading at every start; the DeepSpeed JSON is
        # derived from it, so it is only saved.
        print(f"memtrain: {env.world_size} rank(s) via {env.launcher}, run dir {run_dir}\n"
              f"--- resolved config ---\n{dump_yaml(cfg)}--- ds_config: saved in "
              f"{run.ds_config}", flush=True)

    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    # A pretrained base at ZeRO-3 is loaded partitioned from the start (train/pretrained.py).
    model = build_for_engine(cfg.model, ds_config, env.is_main)
    if cfg.init_from and info is None:
        try:
            loaded = load_initial(model, cfg.init_from)
        except ValueError as err:  # a file that does not read, or another model's weights
            raise ConfigError("init_from", str(err)) from None
        if env.is_main:
            print(f"memtrain: started from {cfg.init_from} ({len(loaded)} tensors: "
                  f"{', '.join(loaded[:4])}{' ...' if len(loaded) > 4 else ''})", flush=True)
    engine, schedule = initialize(model, cfg, ds_config)
    if env.rank:
        # Dropout of its own on every other rank (rank 0 keeps the stream it always had):
        # ranks drawing identical masks would add correlated, not independent, noise. A
        # resume restores each rank's RNG state from its checkpoint file.
        torch.manual_seed(rank_seed(cfg.seed, env.rank))
    state = TrainState(plan=plan)
    if info is not None:
        restore(info, engine, state, stream, env, device)  # the curriculum stage included
        if env.is_main:
            print(f"resumed from {info.path} at step {state.step}", flush=True)
    curriculum.start(resumed=info is not None)
    tracker = Tracker(run_dir, enabled=env.is_main, experiment=cfg.tracking.experiment,
                      run_name=cfg.name, tracking_uri=cfg.tracking.uri or None,
                      params={**cfg.to_dict(), "ds": ds_config,
                              "valid_protocol": asdict(protocol_for(
                                  cfg, split=cfg.data.valid_split, weights=scored_weights(
                                      cfg.deepspeed.precision, final=False))),
                              "final_protocol": asdict(protocol_for(cfg, weights=scored_weights(
                                  cfg.deepspeed.precision, final=True,
                                  masters=gathers_masters(cfg.model,
                                                          zero_stage(ds_config)))))},
                      tags={"model_type": "memory-augmented-lm",
                            "mechanism": cfg.model.mechanism, "git_commit": git_commit(),
                            "world_size": env.world_size,
                            "zero_stage": zero_stage(ds_config)},
                      use_mlflow=cfg.tracking.enabled)
    tracker.log_artifact(run.config, "config")
    tracker.log_artifact(run.ds_config, "config")
    loop = TrainingLoop(LoopParts(cfg=cfg, engine=engine, state=state, device=device,
                                  stage=zero_stage(ds_config), env=env, schedule=schedule,
                                  stream=stream, manifest=regime.manifest, tracker=tracker,
                                  ckpt_root=ckpt_root, curriculum=curriculum))
    try:
        status = loop.run()
    except BaseException:
        tracker.close("FAILED")
        if env.is_main:
            run.write_status("failed", state.step)
        raise
    tracker.close("FINISHED" if status == "finished" else "KILLED")
    if env.is_main:
        run.write_status(status, state.step)
    barrier()
    # Leave the process group explicitly: tearing gloo down at interpreter exit can abort a
    # rank ("terminate called without an active exception") after a successful run.
    torch.distributed.destroy_process_group()
    return 0


def main_entry(cfg: RunConfig, resume: bool | str) -> int:
    try:
        return train(cfg, resume)
    except (ConfigError, ShardError, LayoutError) as err:  # the data does not fit the config
        return error_line("memtrain train", err, code=2)
    except NonFiniteLoss as err:
        return error_line("memtrain train", err, code=3)
