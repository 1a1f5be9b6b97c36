"""`memtrain train`, `memtrain export` (and `python -m train` for launchers).

    memtrain train --config quickstart [section.field=value ...] [--no-resume]
    memtrain export --run-dir runs/quickstart --out model.safetensors
    memtrain export --model imported/model.safetensors --format authors --out rmt.pt
    memtrain import --state-dict rmt.pt --base ckpt/gpt2 --segment-size 128 --out imported

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
from model.io import load_model, save_model

from .config import dump_yaml, load_config
from .export import export_checkpoint, load_weights
from .interop import export_authors, export_peft, import_authors
from .run_access import load_run_config, pick_checkpoint
from .run_dir import RunDir
from .trainer import main_entry

FORMATS = ("memtrain", "peft", "authors")


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
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run-dir", help="a run directory (its latest complete checkpoint)")
    src.add_argument("--model", help="a memtrain model file (an export or an import)")
    p.add_argument("--out", help="output (default: <run-dir>/model.safetensors)")
    p.add_argument("--checkpoint", help="checkpoint folder name (default: latest)")
    p.add_argument("--format", choices=FORMATS, default="memtrain",
                   help="memtrain: one fp32 safetensors file; peft: a peft adapter directory "
                   "plus the memory; authors: the RMT authors' RecurrentWrapper state dict")
    args = p.parse_args(argv)
    if args.format != "memtrain" and not args.out:
        p.error(f"--format {args.format} needs --out")
    try:
        if args.model:
            model, step = load_model(args.model), None
        else:
            cfg = load_run_config(args.run_dir, [])
            info = pick_checkpoint(cfg, args.checkpoint)  # None: the latest complete one
            if info is None:
                print(f"memtrain export: no complete checkpoint in {args.run_dir}",
                      file=sys.stderr)
                return 1
            step = info.step
            if args.format == "memtrain":
                out = export_checkpoint(info, Path(args.out or RunDir(args.run_dir).exported),
                                        cfg.model)
                print(json.dumps({"exported": str(out), "step": step}))
                return 0
            model = load_weights(info, cfg.model)
        if args.format == "memtrain":
            out = save_model(model, args.out)
        else:
            out = (export_peft if args.format == "peft" else export_authors)(model, args.out)
    except ConfigError as err:
        return invalid_config("memtrain export", err)
    except (OSError, ValueError) as err:
        return error_line("memtrain export", err)
    print(json.dumps({"exported": str(out), "format": args.format, "step": step}))
    return 0


def main_import(argv: list[str] | None = None) -> int:
    p = _parser("memtrain import")
    p.add_argument("--format", choices=["rmt-authors", "armt-authors"], default="rmt-authors",
                   help="rmt-authors: a state dict of the RMT authors' RecurrentWrapper or "
                   "MemoryCell (booydar/recurrent-memory-transformer); armt-authors: of the "
                   "ARMT authors' AssociativeRecurrentWrapper or AssociativeMemoryCell "
                   "(RodkinIvan/associative-recurrent-memory-transformer)")
    p.add_argument("--no-correction", action="store_true",
                   help="armt-authors: the model was trained with their --no_correction")
    p.add_argument("--state-dict", required=True, help=".pt/.bin/.pth or .safetensors")
    p.add_argument("--base", required=True,
                   help="the base model's checkpoint directory the authors wrapped")
    p.add_argument("--segment-size", type=int, required=True,
                   help="their RecurrentWrapper's segment_size (becomes model.tgt_len)")
    p.add_argument("--out", required=True, help="the model directory to write")
    args = p.parse_args(argv)
    try:
        summary = import_authors(args.state_dict, args.base, args.segment_size, args.out,
                                 args.format, correction=not args.no_correction)
    except ConfigError as err:
        return invalid_config("memtrain import", err)
    except (OSError, ValueError, RuntimeError) as err:
        return error_line("memtrain import", err)
    print(json.dumps(summary))
    return 0
