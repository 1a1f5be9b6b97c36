"""`memtrain train`, `memtrain export` (and `python -m train` for launchers).

    memtrain train --config quickstart [section.field=value ...] [--no-resume]
    memtrain export --run-dir runs/quickstart --out model.safetensors

(`memtrain eval` is an evaluation tool: evaluation/cli.py.)

Options and section.field=value overrides may come in any order. A config error exits with
code 2 before any compute, naming the field; every error is one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from memtrain.command_line import CommandParser, error_line, invalid_config
from model import ConfigError

from .config import dump_yaml, load_config
from .export import export_checkpoint
from .run_access import load_run_config, pick_checkpoint
from .run_dir import RunDir
from .trainer import main_entry


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
        return invalid_config("memtrain train", err)
    if args.print_config:
        print(dump_yaml(cfg), end="")
        return 0
    try:
        return main_entry(cfg, resume="require" if args.resume else not args.no_resume)
    except OSError as err:  # e.g. a run directory that cannot be created or written
        return error_line("memtrain train", err)


def main_export(argv: list[str] | None = None) -> int:
    p = _parser("memtrain export")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--out", help="output file (default: <run-dir>/model.safetensors)")
    p.add_argument("--checkpoint", help="checkpoint folder name (default: latest)")
    args = p.parse_args(argv)
    try:
        cfg = load_run_config(args.run_dir, [])
    except ConfigError as err:
        return invalid_config("memtrain export", err)
    info = pick_checkpoint(cfg, args.checkpoint)  # None: the latest complete checkpoint
    if info is None:
        print(f"memtrain export: no complete checkpoint in {args.run_dir}", file=sys.stderr)
        return 1
    out = export_checkpoint(info, Path(args.out or RunDir(args.run_dir).exported), cfg.model)
    print(json.dumps({"exported": str(out), "step": info.step}))
    return 0
