"""`memtrain analyze`: memory analyses of a run's checkpoint, as plots in the run's MLflow run.

    memtrain analyze --config quickstart [section.field=value ...] [--checkpoint NAME]
                     [--split test] [--segments 8] [--rows 4] [--no-track]

Reads `--segments` segments of every one of `--rows` stream rows of the split, carrying the
memory as in evaluation (the eval.* lengths apply: eval.mem_len=64 analyses a longer
memory), after a warm-up that fills the memory. Writes to <run_dir>/analysis/ the plots
that apply to the mechanism (evaluation/memory_plots.py), each PNG with a JSON of its numbers,
and logs them as artifacts under analysis/ of the run's MLflow run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from data_pipeline.shards import ShardError, load_manifest
from memtrain.command_line import invalid_config
from model import ConfigError, backbone_of
from train.config import RunConfig, load_config
from train.evaluate import protocol_for
from train.export import load_weights
from train.regime import regime_of
from train.run_access import load_run_config, log_to_run, pick_checkpoint
from train.run_dir import RunDir

from .memory_plots import MemoryAnalysis

PROG = "memtrain analyze"


def analyze_run(cfg: RunConfig, checkpoint: str | None = None, split: str | None = None,
                segments: int = 8, rows: int = 4, track: bool = True,
                device: torch.device | None = None) -> list[Path]:
    """Analyse a run's checkpoint; returns the files written. Raises FileNotFoundError (no
    checkpoint), ShardError (no such split) or ValueError (bad numbers, data too short)."""
    if segments < 1 or rows < 1:
        raise ValueError(f"--segments and --rows must be >= 1, got {segments} and {rows}")
    if not backbone_of(cfg.model).records_analysis:
        raise ConfigError("model.backbone", "memtrain analyze records the native stack's "
                          "attention maps and memory; a pretrained backbone's run has none "
                          "of its hooks (score it with memtrain eval)")
    split = split or cfg.eval.split
    manifest = load_manifest(cfg.data.path)
    manifest.split(split)  # names the splits the manifest has
    info = pick_checkpoint(cfg, checkpoint)
    run = RunDir(cfg.resolved_run_dir)
    if info is None:
        raise FileNotFoundError(f"no complete checkpoint in {run.checkpoints} (train the run "
                                "first: memtrain train --config ...)")
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_weights(info, cfg.model).to(device).eval()
    proto = protocol_for(cfg, split=split)
    model.set_lengths(mem_len=proto.mem_len, clamp_len=proto.clamp_len,
                      same_length=proto.same_length)

    # A stream's rows side by side, or task samples one after another (train/regime.py).
    source, per_row, n_rows_or_episodes = regime_of(manifest).analysis_segments(
        split, rows, proto.tgt_len, cfg.data.url_template)
    # Warm-up: only segments whose memory is full count (an XL cache: ceil(M / L) segments
    # in; memory tokens (RMT, ARMT): written at least once).
    warm = cfg.model.mech.warmup_segments(cfg.model, proto.mem_len, proto.tgt_len)
    warm = min(warm, per_row - 1)
    available = (per_row - warm) * n_rows_or_episodes
    if available < 1:
        raise ValueError(f"split {split!r} has {per_row} segments per row: too few to analyse")
    if segments > available:
        print(f"{PROG}: {split!r} has only {available} segments after the warm-up of {warm}; "
              f"analysing those", file=sys.stderr)
        segments = available

    analysis = MemoryAnalysis(model)
    state = None
    for seg, index in source:
        if state is not None and bool(seg.reset.any()):
            state = state.reset_rows(seg.reset.to(device))
        tokens = seg.tokens[:, :-1].to(device)
        state = analysis.step(tokens, state, count=index >= warm)
        if analysis.segments >= segments:
            break

    meta = {"run": cfg.name, "checkpoint": info.path.name, "step": info.step, "split": split,
            "rows": rows, "warmup_segments": warm, "mem_len": proto.mem_len,
            "tgt_len": proto.tgt_len, "clamp_len": proto.clamp_len,
            "same_length": proto.same_length}
    out_dir = run.analysis
    # The lengths are in the name: analyses under other eval.* lengths do not overwrite.
    stem = f"{info.tag}_{split}_m{proto.mem_len}_l{proto.tgt_len}"
    files = analysis.write(out_dir, stem, meta)
    print(f"{PROG}: {cfg.name} {info.path.name} (step {info.step}), {analysis.mechanism}, "
          f"split {split!r}: {analysis.segments} segments x {rows} rows after {warm} warm-up "
          f"segments, mem_len {proto.mem_len}, tgt_len {proto.tgt_len}")
    for line in analysis.summary():
        print(f"  {line}")
    for path in files:
        print(f"wrote {path}")
    if track and cfg.tracking.enabled and files:
        log_to_run(cfg, info.step, artifacts=[(path, out_dir.name) for path in files])
        print(f"logged {len(files)} files to the run's MLflow run under analysis/")
    return files


def main_analyze(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--config", help="the run's YAML config, or a name in configs/")
    where.add_argument("--run-dir", help="a run directory (reads its config.yaml)")
    p.add_argument("overrides", nargs="*", metavar="section.field=value",
                   help="e.g. eval.mem_len=64 (a longer memory than in training)")
    p.add_argument("--checkpoint", help="checkpoint folder name (default: latest)")
    p.add_argument("--split", help="split to read (default: eval.split of the config)")
    p.add_argument("--segments", type=int, default=8,
                   help="segments analysed after the warm-up (default 8)")
    p.add_argument("--rows", type=int, default=4,
                   help="stream rows (batch) read side by side (default 4)")
    p.add_argument("--no-track", action="store_true", help="do not log to the run's MLflow run")
    args = p.parse_args(argv)
    try:
        if args.run_dir:
            cfg = load_run_config(args.run_dir, args.overrides)
        else:
            cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        return invalid_config(PROG, err)
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    try:
        analyze_run(cfg, args.checkpoint, args.split, args.segments, args.rows,
                    track=not args.no_track)
    except (FileNotFoundError, ShardError, ValueError) as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main_analyze())
