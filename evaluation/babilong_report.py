"""`memtrain eval --babilong`: the run's checkpoint scored on a BABILong data set, and the
result written as BABILong reports it (Kuratov et al. 2024, Fig. 1 and §3: accuracy of each
task at each length, a heatmap of tasks x lengths).

Into <run_dir>/eval/: babilong_<checkpoint>_<split>_<time>.json (every cell with its number
of samples, chance and a few outputs), .md (task rows x length columns) and .png (the
heatmap); into the run's MLflow run one metric per task, babilong_<split>_<task>, whose step
is the length in tokens (as the memory-length sweep logs its curve against mem_len), and the
three files as artifacts. `memtrain compare` shows those metrics side by side
(compare/summary.py babilong_table).
"""

from __future__ import annotations

import functools
import math
import sys
from pathlib import Path

import torch

from data_pipeline.shards import load_manifest
from model import ConfigError
from train.config import RunConfig
from train.distributed import resolve_env
from train.evaluate import protocol_for
from train.export import load_weights
from train.run_access import pick_checkpoint

from .babilong import evaluate_babilong, find_folders
from .babilong_score import is_correct
from .eval_files import save_and_log
from .generation import fit_to_data

# How labels are found in an answer (evaluation/babilong_score.py), as the report names it.
MATCHING = {True: "whole words", False: "substrings (the authors' code)"}


def run_babilong(cfg: RunConfig, checkpoint: str | None, data: str, *, tasks=None,
                 lengths=None, samples: int = 0, track: bool = True,
                 whole_words: bool = True) -> dict | None:
    """Score the checkpoint on every (task, length) of the BABILong data at `data`.
    `whole_words=False` matches the labels as substrings, as the authors' code does
    (evaluation/babilong_score.py), to reproduce their numbers."""
    if resolve_env().world_size > 1:
        raise ValueError("--babilong runs on one process (its rows are few and generated one "
                         "token at a time); launch `memtrain eval --babilong` without "
                         "torchrun/srun")
    proto = protocol_for(cfg)
    folders, tasks = find_folders(data, proto.split, tasks, lengths)
    info = pick_checkpoint(cfg, checkpoint)
    if info is None:
        print(f"memtrain eval: no complete checkpoint in {cfg.resolved_run_dir}",
              file=sys.stderr)
        return None
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    base = load_weights(info, cfg.model).to(device)
    model = _fit_vocab(base, folders[0].manifest, cfg.data.path)
    with base.using_lengths(proto.mem_len, proto.clamp_len, proto.same_length):
        result = evaluate_babilong(model, folders, proto.split, tasks, seg_len=proto.tgt_len,
                                   batch=proto.batch, device=device, samples=samples,
                                   score=functools.partial(is_correct, whole_words=whole_words),
                                   progress=lambda line: print(line, flush=True))
    result.update(checkpoint=info.path.name, step=info.step, data=str(data),
                  mechanism=cfg.model.mechanism, mem_len=proto.mem_len,
                  clamp_len=proto.clamp_len, matching=MATCHING[whole_words])
    print(format_table(result), flush=True)
    curve = [(metric_name(result["split"], c["task"]), c["accuracy"], c["length"])
             for c in result["cells"] if c["n"]]
    path = save_and_log(cfg, result, "babilong", info.step, info.tag, track,
                        beside=functools.partial(_table_and_heatmap, result), curve=curve)
    print(f"BABILong table written to {path} (and its .md, .png)", flush=True)
    return result


def _fit_vocab(model, manifest, run_data: str):
    """The model, fitted to the data's ids as `memtrain generate` fits it
    (evaluation/generation.py `fit_to_data`), once the BABILong data are known to be written
    with the run's training vocabulary."""
    fitted = fit_to_data(model, manifest, str(manifest.location))
    try:
        trained = load_manifest(run_data).vocab_fingerprint if run_data else None
    except Exception:  # the training data need not be reachable where the scoring runs
        trained = None
    if trained and trained != manifest.vocab_fingerprint:
        raise ConfigError("--babilong", f"the data at {manifest.location} were written with "
                          f"another vocabulary than the run's training data ({run_data})")
    return fitted


# ---------------------------------------------------------------------------- rendering
def grid(result: dict) -> tuple[list[str], list[tuple[str, int]], dict]:
    """(tasks, [(length label, tokens)], {(task, tokens): cell})."""
    cells = {(c["task"], c["length"]): c for c in result["cells"]}
    lengths = [(x["label"], x["length"]) for x in result["lengths"]]
    return list(result["tasks"]), lengths, cells


def _chance(cells: dict, task: str) -> float:
    return next((c["chance"] for (t, _), c in cells.items() if t == task), math.nan)


def format_table(result: dict) -> str:
    """Markdown: one row per task, one column per length, accuracy (n) in each cell, and
    chance (1 / the number of the task's labels)."""
    tasks, lengths, cells = grid(result)
    matching = f", labels matched as {result['matching']}" if "matching" in result else ""
    lines = [f"BABILong accuracy on {result['split']} ({result.get('checkpoint', '?')}, "
             f"segments of {result['seg_len']} tokens, greedy answers of up to the answer "
             f"field's length{matching}); cell: accuracy (samples)", "",
             "| task | " + " | ".join(f"{lab} ({n})" for lab, n in lengths) + " | chance |",
             "|---|" + "---|" * (len(lengths) + 1)]
    for task in tasks:
        row = []
        for _, n in lengths:
            c = cells.get((task, n))
            row.append("-" if c is None or not c["n"] else f"{c['accuracy']:.3f} ({c['n']})")
        lines.append(f"| {task} | " + " | ".join(row) + f" | {_chance(cells, task):.3f} |")
    return "\n".join(lines)


def plot_heatmap(result: dict, out_png: Path) -> Path:
    """Tasks x lengths, the accuracy written in each cell (BABILong's figures)."""
    # matplotlib (~0.4 s to import) only when a table is drawn
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    tasks, lengths, cells = grid(result)
    values = [[cells[(t, n)]["accuracy"] if (t, n) in cells and cells[(t, n)]["n"]
               else math.nan for _, n in lengths] for t in tasks]
    fig = Figure(figsize=(1.2 + 0.9 * len(lengths), 1.0 + 0.55 * len(tasks)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    im = ax.imshow(values, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    for i, row in enumerate(values):
        for j, v in enumerate(row):
            ax.text(j, i, "-" if math.isnan(v) else f"{100 * v:.0f}", ha="center",
                    va="center", fontsize=9)
    ax.set_xticks(range(len(lengths)), [lab for lab, _ in lengths])
    ax.set_yticks(range(len(tasks)), tasks)
    ax.set(xlabel="context length", title=f"BABILong accuracy (%), {result['split']}")
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100, bbox_inches="tight")
    return out_png


def _table_and_heatmap(result: dict, stem: Path) -> list[Path]:
    md = Path(f"{stem}.md")
    md.write_text(format_table(result) + "\n", encoding="utf-8")
    return [md, plot_heatmap(result, Path(f"{stem}.png"))]


def metric_name(split: str, task: str) -> str:
    return f"babilong_{split}_{task}"
