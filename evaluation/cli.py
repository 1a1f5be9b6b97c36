"""`memtrain eval`: score a run's checkpoint under any evaluation protocol, without DeepSpeed.

    memtrain eval --run-dir runs/quickstart [eval.mem_len=64 eval.split=test ...]
    memtrain eval --run-dir runs/quickstart --sweep [--multiples 1,2,4]   (evaluation/sweep.py)
    memtrain eval --run-dir runs/babi --babilong data/babilong [--tasks qa1,qa2]
                  [--lengths 0k,4k] [--samples 100]      (evaluation/babilong_report.py)

The fp32 weights are consolidated from the checkpoint (any ZeRO stage) into a plain model;
launched on several ranks (torchrun / srun), each rank reads its rows and the sums are
all-reduced. The report goes to `<run_dir>/eval/` and into the run's MLflow run.
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

from data_pipeline.shards import ShardError, load_manifest
from memtrain.command_line import CommandParser, error_line, invalid_config
from model import ConfigError
from model.weights_file import WeightsError
from train.config import RunConfig
from train.distributed import resolve_env
from train.evaluate import evaluate, headline, protocol_for
from train.export import load_weights_once
from train.gpu_binding import device_for
from train.master_weights import checkpoint_weights
from train.run_access import load_run_config, log_to_run, pick_checkpoint
from train.run_dir import RunDir, atomic_write_json

from .babilong_report import run_babilong
from .eval_files import save_and_log
from .sweep import format_table, plot_sweep, run_sweep, sweep_curve, sweep_grid


def main_eval(argv: list[str] | None = None) -> int:
    p = CommandParser(prog="memtrain eval", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", required=True)
    p.add_argument("overrides", nargs="*", metavar="eval.field=value",
                   help="e.g. eval.split=test eval.mem_len=2100 eval.tgt_len=80")
    p.add_argument("--checkpoint", help="checkpoint folder name (default: latest)")
    p.add_argument("--no-track", action="store_true", help="do not log to the run's MLflow run")
    sweep = p.add_argument_group("memory-length sweep (LaMemo's extrapolation figure)")
    sweep.add_argument("--sweep", action="store_true",
                       help="score over evaluation memory lengths instead of once")
    sweep.add_argument("--multiples", type=_int_list, metavar="1,2,...",
                       help="mem_len = m x tgt_len for each m (default 1..10)")
    sweep.add_argument("--mem-lens", type=_int_list, metavar="64,128,...",
                       help="explicit memory lengths instead of multiples")
    sweep.add_argument("--tgt-lens", type=_int_list, metavar="32,64",
                       help="segment lengths (default: the eval protocol's)")
    babi = p.add_argument_group("BABILong (accuracy per bAbI task and context length)")
    babi.add_argument("--babilong", metavar="DIR", help="score the BABILong data set in DIR "
                      "(one folder per length, as `memtrain tasks babilong` writes)")
    babi.add_argument("--tasks", type=_str_list, metavar="qa1,qa2,...",
                      help="tasks to score (default: all in the data)")
    babi.add_argument("--lengths", type=_str_list, metavar="0k,1k,...",
                      help="length folders to score (default: all)")
    babi.add_argument("--samples", type=int, default=0, metavar="N",
                      help="at most N samples per task and length (default: all)")
    babi.add_argument("--substring", action="store_true",
                      help="match answer labels as substrings, as BABILong's own scoring code "
                      "does (to reproduce its numbers); default: whole words")
    args = p.parse_intermixed_args(argv)
    try:
        cfg = load_run_config(args.run_dir, args.overrides)
    except ConfigError as err:
        return invalid_config("memtrain eval", err)
    if args.babilong is None and (args.tasks or args.lengths or args.samples
                                  or args.substring):
        print("memtrain eval: --tasks/--lengths/--samples/--substring need --babilong",
              file=sys.stderr)
        return 2
    if args.babilong is not None:
        if args.sweep or args.multiples or args.mem_lens or args.tgt_lens:
            print("memtrain eval: --babilong and --sweep are separate evaluations; run them "
                  "one at a time", file=sys.stderr)
            return 2
        if args.samples < 0:
            print("memtrain eval: --samples must be >= 0", file=sys.stderr)
            return 2
        try:
            report = run_babilong(cfg, args.checkpoint, args.babilong, tasks=args.tasks,
                                  lengths=args.lengths, samples=args.samples,
                                  track=not args.no_track, whole_words=not args.substring)
        except (FileNotFoundError, ValueError, ShardError) as err:  # ConfigError: a ValueError
            return error_line("memtrain eval", err, code=2)
        return 0 if report else 1
    try:
        points = None
        if args.sweep:
            points = sweep_grid(args.tgt_lens or [cfg.eval.lengths(cfg.model).tgt_len],
                                args.mem_lens, args.multiples)
        elif args.multiples or args.mem_lens or args.tgt_lens:
            print("memtrain eval: --multiples/--mem-lens/--tgt-lens need --sweep",
                  file=sys.stderr)
            return 2
        report = run_eval(cfg, args.checkpoint, track=not args.no_track, sweep_points=points)
    except WeightsError as err:  # a checkpoint file that does not read: the input is bad
        return error_line("memtrain eval", err, code=2)
    except (FileNotFoundError, ValueError) as err:  # no such checkpoint; weights vs config
        return error_line("memtrain eval", err, code=1)
    return 0 if report else 1


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of "
                                          "integers") from None


def _str_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def run_eval(cfg: RunConfig, checkpoint: str | None, track: bool = True,
             sweep_points: list[tuple[int, int]] | None = None) -> dict | None:
    """Score the checkpoint under the run's eval protocol, or, with `sweep_points`
    ((tgt_len, mem_len) pairs), over a memory-length sweep (evaluation/sweep.py)."""
    env = resolve_env()
    if env.world_size > 1:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        # The run's distributed.timeout_minutes, as in training (torch's default: 10 minutes
        # under nccl, 30 under gloo): rank 0 alone consolidates the checkpoint's fp32
        # weights (load_weights_once) while the other ranks wait for its broadcast.
        torch.distributed.init_process_group(
            backend, timeout=timedelta(minutes=cfg.distributed.timeout_minutes))
    device = device_for(env.local_rank)
    info = pick_checkpoint(cfg, checkpoint)
    if info is None:
        print(f"memtrain eval: no complete checkpoint in {cfg.resolved_run_dir}",
              file=sys.stderr)
        return None
    model = load_weights_once(info, cfg.model, device)  # consolidated on rank 0 only
    manifest = load_manifest(cfg.data.path)
    try:
        if sweep_points:
            return _sweep(cfg, model, manifest, sweep_points, info, env, device, track)
        return _single(cfg, model, manifest, info, env, device, track)
    finally:
        if env.world_size > 1:
            torch.distributed.destroy_process_group()


def _single(cfg, model, manifest, info, env, device, track) -> dict:
    proto = protocol_for(cfg, weights=checkpoint_weights(cfg.deepspeed.precision,
                                                         info.zero_stage))
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
    sweep = run_sweep(cfg, model, manifest, points, device, env.rank, env.world_size)
    sweep.update(checkpoint=info.path.name, step=info.step)
    if env.is_main:
        print(format_table(sweep), flush=True)
        path = save_and_log(cfg, sweep, "sweep", info.step, info.tag, track,
                            beside=lambda stem: [plot_sweep(sweep, Path(f"{stem}.png"))],
                            curve=sweep_curve(sweep))
        print(f"sweep written to {path} (and its .png)", flush=True)
    return sweep
