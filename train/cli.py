"""`memtrain train`, `memtrain eval`, `memtrain export` (and `python -m train` for launchers).

    memtrain train --config quickstart [section.field=value ...] [--no-resume]
    memtrain eval --run-dir runs/quickstart [eval.mem_len=64 eval.split=test ...]
    memtrain export --run-dir runs/quickstart --out model.safetensors

Options and section.field=value overrides may come in any order. A config error exits with
code 2 before any compute, naming the field; every error is one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from memtrain.cli import CommandParser, error_line
from model import ConfigError

from .config import load_config
from .run_dir import RunDir


def _parser(prog: str) -> argparse.ArgumentParser:
    return CommandParser(prog=prog, description=__doc__,
                         formatter_class=argparse.RawDescriptionHelpFormatter)


def parse_train_args(argv: list[str] | None = None) -> argparse.Namespace:
    """`memtrain train` arguments: options and overrides intermixed in any order (plain
    parse_args stops collecting overrides at the first option after them)."""
    p = _parser("memtrain train")
    p.add_argument("--config", help="YAML run config, or a name in configs/ (quickstart, ...)")
    p.add_argument("overrides", nargs="*", metavar="section.field=value")
    when = p.add_mutually_exclusive_group()
    when.add_argument("--resume", action="store_true", help="continue the run directory's "
                      "latest checkpoint; fail if there is none (default: resume if present)")
    when.add_argument("--no-resume", action="store_true",
                      help="refuse to continue a run directory that holds checkpoints")
    p.add_argument("--print-config", action="store_true", help="print the resolved config "
                   "and exit")
    # The deepspeed launcher appends --local_rank=N; LOCAL_RANK in the environment says the same.
    p.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    return p.parse_intermixed_args(argv)


def main_train(argv: list[str] | None = None) -> int:
    args = parse_train_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"memtrain train: invalid config: {err}", file=sys.stderr)
        return 2
    if args.print_config:
        from .config import dump_yaml
        print(dump_yaml(cfg), end="")
        return 0
    from .trainer import main_entry
    try:
        return main_entry(cfg, resume="require" if args.resume else not args.no_resume)
    except OSError as err:  # e.g. a run directory that cannot be created or written
        return error_line("memtrain train", err)


def _run_config(run_dir: str, overrides: list[str]):
    """The config a run directory was trained with (its config.yaml), with `overrides`."""
    path = RunDir(run_dir).config
    if not path.is_file():
        raise ConfigError("--run-dir", f"{path} not found: not a memtrain run directory")
    return load_config(path, [*overrides, f"run_dir={run_dir}"])


def main_eval(argv: list[str] | None = None) -> int:
    p = _parser("memtrain eval")
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
    args = p.parse_intermixed_args(argv)
    try:
        cfg = _run_config(args.run_dir, args.overrides)
    except ConfigError as err:
        print(f"memtrain eval: invalid config: {err}", file=sys.stderr)
        return 2
    from evaluation.cli import run_eval
    try:
        points = None
        if args.sweep:
            from evaluation.sweep import sweep_grid
            points = sweep_grid(args.tgt_lens or [cfg.eval.tgt_len or cfg.model.tgt_len],
                                args.mem_lens, args.multiples)
        elif args.multiples or args.mem_lens or args.tgt_lens:
            print("memtrain eval: --multiples/--mem-lens/--tgt-lens need --sweep",
                  file=sys.stderr)
            return 2
        report = run_eval(cfg, args.checkpoint, track=not args.no_track, sweep_points=points)
    except (FileNotFoundError, ValueError) as err:  # no such checkpoint; weights vs config
        print(f"memtrain eval: {err}", file=sys.stderr)
        return 1
    return 0 if report else 1


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of "
                                          "integers") from None


def main_export(argv: list[str] | None = None) -> int:
    p = _parser("memtrain export")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--out", help="output file (default: <run-dir>/model.safetensors)")
    p.add_argument("--checkpoint", help="checkpoint folder name (default: latest)")
    args = p.parse_args(argv)
    try:
        cfg = _run_config(args.run_dir, [])
    except ConfigError as err:
        print(f"memtrain export: {err}", file=sys.stderr)
        return 2
    from evaluation.cli import pick_checkpoint

    from .checkpoint import find_latest
    from .export import export_checkpoint
    info = pick_checkpoint(cfg, args.checkpoint) if args.checkpoint else \
        find_latest(RunDir(cfg.resolved_run_dir).checkpoints)
    if info is None:
        print(f"memtrain export: no complete checkpoint in {args.run_dir}", file=sys.stderr)
        return 1
    out = export_checkpoint(info, Path(args.out or RunDir(args.run_dir).exported), cfg.model)
    print(json.dumps({"exported": str(out), "step": info.step}))
    return 0
