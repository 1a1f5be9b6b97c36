"""`memtrain recl`: the Relative Effective Context Length of a group of trained runs.

    memtrain recl --run-dirs runs/xl runs/xl-nomem --step 16 --max-context 64

Each run's latest checkpoint (or --checkpoint) is scored on the same tokens of the same
split at contexts start, start+step, ..., max-context (evaluation/recl.py). Out: a
table on the terminal, recl.json, recl.md and the gain plot in --out, and in every run's
MLflow run the metrics recl_r<r> plus those files as artifacts under recl/.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from data_pipeline.shards import load_manifest
from data_pipeline.streams import TokenStream
from data_pipeline.vocab import fingerprint
from memtrain.command_line import error_line
from model import ConfigError
from train.export import load_weights
from train.regime import regime_of
from train.run_access import load_run_config, log_to_run, pick_checkpoint

from . import recl as R
from .sweep import scored_window


def _floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: write e.g. 0.1,0.5,1.0") from None
    if not values or any(not 0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: ratios must lie in (0, 1]")
    return values


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="memtrain recl", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dirs", nargs="+", required=True, help="the group of runs")
    p.add_argument("--checkpoint", help="checkpoint folder name in every run (default latest)")
    p.add_argument("--split", default="test")
    p.add_argument("--step", type=int, default=0,
                   help="context step (default: the first run's segment length; the paper's "
                        "values suggest 100)")
    p.add_argument("--start", type=int, default=-1, help="first context (default: --step)")
    p.add_argument("--max-context", type=int, default=0, help="default: 10 x --step")
    p.add_argument("--tgt-len", type=int, default=0,
                   help="segment length of the evaluation (default: the first run's)")
    p.add_argument("--ratios", type=_floats, default=list(R.DEFAULT_RATIOS),
                   help="fractions r of hardest tokens (default 0.1,0.5,1.0)")
    p.add_argument("--threshold", type=float, default=0.01,
                   help="relative gain below which the context stops growing (paper: 0.01)")
    p.add_argument("--rows", type=int, default=0, help="rows of the split (default eval.batch)")
    p.add_argument("--max-tokens", type=int, default=0, help="scored tokens per row (0: all)")
    p.add_argument("--out", help="output folder (default runs/recl-<time>)")
    p.add_argument("--no-track", action="store_true", help="do not log to the runs' MLflow")
    return p


def main_recl(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except (ConfigError, ValueError, FileNotFoundError) as err:
        return error_line("memtrain recl", err, code=2 if isinstance(err, ConfigError) else 1)


def _run(args) -> int:
    runs = []
    for run_dir in args.run_dirs:
        cfg = load_run_config(run_dir, [])
        info = pick_checkpoint(cfg, args.checkpoint)
        if info is None:
            raise FileNotFoundError(f"no complete checkpoint in {run_dir}")
        runs.append((cfg, info, load_manifest(cfg.data.path)))
    first_cfg, _, manifest = runs[0]
    for cfg, _, m in runs[1:]:
        # Recomputed, not the stored fingerprints: data prepared before and after the
        # fingerprint had one canonical form still compare equal.
        if fingerprint(m.vocab) != fingerprint(manifest.vocab):
            raise ValueError(f"{cfg.resolved_run_dir} was trained on other data ("
                             f"{m.location}) than {first_cfg.resolved_run_dir} ("
                             f"{manifest.location}): RECL compares models on the same tokens")
    regime_of(manifest).require_token_stream("RECL", "these runs train")
    tgt_len = args.tgt_len or first_cfg.eval.lengths(first_cfg.model).tgt_len
    step = args.step or tgt_len
    start = step if args.start < 0 else args.start
    contexts = R.context_grid(start, step, args.max_context or 10 * step)
    rows = args.rows or first_cfg.eval.batch or first_cfg.data.global_batch
    row_len = TokenStream(manifest, args.split, rows, tgt_len, 0, 1).stream_len
    # Leave out the first max(context) tokens (whole segments): every scored token has a
    # full context at every c.
    skip, end = scored_window([(tgt_len, contexts[-1])], row_len, args.max_tokens)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    names, losses = [], {c: [] for c in contexts}
    for cfg, info, m in runs:
        names.append(cfg.name)
        model = load_weights(info, cfg.model).to(device)
        for c in contexts:
            losses[c].append(R.per_token_losses(model, m, args.split, rows, tgt_len, c, skip,
                                                 end, device, cfg.data.url_template or None))
        print(f"scored {cfg.name} ({info.path.name}) at {len(contexts)} contexts", flush=True)
    stacked = {c: torch.stack(v) for c, v in losses.items()}
    res = R.compute(stacked, names, contexts, args.ratios, args.threshold)
    print(res.table())
    out = Path(args.out or f"runs/recl-{time.strftime('%Y%m%d-%H%M%S')}")
    files = R.write(res, out)
    print(f"written: {', '.join(str(f) for f in files)}")
    if not args.no_track:
        for i, (cfg, info, _) in enumerate(runs):
            if cfg.tracking.enabled:
                metrics = {f"recl_r{r}": res.recl[r][i][0] for r in args.ratios}
                log_to_run(cfg, info.step, metrics, [(f, "recl") for f in files])
    return 0
