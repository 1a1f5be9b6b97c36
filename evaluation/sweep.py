"""`memtrain eval --sweep`: one checkpoint scored over a grid of evaluation memory lengths.

This is LaMemo's extrapolation experiment (Ji et al. 2022: memory = m x segment,
m = 1..10, for a model trained with a shorter memory) for any of the three models, and
Transformer-XL's "evaluate with a longer memory" knob (XL §3.2 and §4.5); measured
examples in docs/evaluation.md. Relative positions make every point
runnable; whether the model *uses* the extra memory is what the curve shows.

Every point scores the same tokens of every row: the first `skip` tokens (at least the
largest memory, rounded up to whole segments of every segment length) and everything after
a common end are left out, so the curve compares like with like. Where a point asks for
more than the model or the data can give, the point still runs and carries a note:

- mem_len + tgt_len beyond clamp_len: distances past clamp_len share one position encoding;
- mem_len beyond the history a scored token can have in its row (the memory never fills).
"""

from __future__ import annotations

import math
from dataclasses import asdict, replace
from pathlib import Path

import torch

from data_pipeline.streams import TokenStream
from model import ConfigError
from train.config import RunConfig
from train.evaluate import EvalProtocol, evaluate, protocol_for
from train.regime import regime_of

DEFAULT_MULTIPLES = tuple(range(1, 11))


def sweep_grid(tgt_lens: list[int], mem_lens: list[int] | None,
               multiples: list[int] | None) -> list[tuple[int, int]]:
    """(tgt_len, mem_len) points: explicit memory lengths, or multiples of each segment."""
    if any(t <= 0 for t in tgt_lens):
        raise ValueError(f"segment lengths must be > 0, got {tgt_lens}")
    if mem_lens is not None:
        if any(m < 0 for m in mem_lens):
            raise ValueError(f"memory lengths must be >= 0, got {mem_lens}")
        return [(t, m) for t in tgt_lens for m in mem_lens]
    mult = list(multiples or DEFAULT_MULTIPLES)
    if any(k < 0 for k in mult):
        raise ValueError(f"memory multiples must be >= 0, got {mult}")
    return [(t, k * t) for t in tgt_lens for k in mult]


def scored_window(points: list[tuple[int, int]], row_len: int,
                  max_tokens: int = 0) -> tuple[int, int]:
    """(skip, end) token offsets per row shared by every point: skip >= the largest memory,
    both multiples of every segment length, end <= the last token a segment can predict."""
    unit = math.lcm(*(t for t, _ in points))
    skip = -(-max(m for _, m in points) // unit) * unit
    end = ((row_len - 1) // unit) * unit
    if max_tokens:
        end = min(end, skip + -(-max_tokens // unit) * unit)
    if end <= skip:
        raise ValueError(f"rows of {row_len} tokens leave nothing to score after skipping "
                         f"{skip} tokens (the largest memory, in whole segments of "
                         f"{sorted({t for t, _ in points})}); use shorter memories (contexts) "
                         "or fewer rows")
    return skip, end


def point_notes(proto: EvalProtocol, skip: int) -> list[str]:
    """What limits a point, said instead of silently clamped."""
    notes = []
    span = proto.mem_len + proto.tgt_len
    if proto.clamp_len > 0 and span > proto.clamp_len:
        notes.append(f"attention span {span} > clamp_len {proto.clamp_len}: distances beyond "
                     f"{proto.clamp_len} share one position encoding")
    if proto.mem_len > skip:
        notes.append(f"mem_len {proto.mem_len} > the {skip} tokens of history before the "
                     "first scored token: the memory never fills")
    return notes


def run_sweep(cfg: RunConfig, model, manifest, points: list[tuple[int, int]],
              device: torch.device, rank: int = 0, world_size: int = 1) -> dict:
    """Score every point; returns {"points": [...], "skip_tokens", "end_tokens", ...}."""
    regime_of(manifest).require_token_stream(
        "a memory-length sweep", hint="; score it with `memtrain eval`")
    base = protocol_for(cfg)
    row_len = TokenStream(manifest, base.split, base.batch, min(t for t, _ in points), 0,
                          1, url_template=cfg.data.url_template or None).stream_len
    max_tokens = base.max_segments * base.tgt_len if base.max_segments else 0
    skip, end = scored_window(points, row_len, max_tokens)
    results = []
    for tgt_len, mem_len in points:
        proto = replace(base, tgt_len=tgt_len, mem_len=mem_len,
                        same_length=base.same_length and mem_len > 0,
                        skip_segments=skip // tgt_len, max_segments=end // tgt_len)
        try:
            report = evaluate(model, model, manifest, proto, rank, world_size, device,
                              url_template=cfg.data.url_template, seed=cfg.data.seed)
        except ConfigError as err:  # e.g. LaMemo with mem_len 0: reported, not skipped
            results.append({"protocol": asdict(proto), "error": str(err), "notes": [str(err)],
                            "multiple": mem_len / tgt_len})
            continue
        report["notes"] = point_notes(proto, skip)
        report["multiple"] = mem_len / tgt_len
        results.append(report)
    return {"split": base.split, "skip_tokens": skip, "end_tokens": end, "row_tokens": row_len,
            "trained": {"tgt_len": cfg.model.tgt_len, "mem_len": cfg.model.mem_len},
            "points": results}


def format_table(sweep: dict) -> str:
    metric = next((p["metric"] for p in sweep["points"] if "metric" in p), "ppl")
    value = "bpc" if metric == "bpc" else "ppl"
    lines = [f"memory-length sweep on {sweep['split']} (trained with tgt_len "
             f"{sweep['trained']['tgt_len']}, mem_len {sweep['trained']['mem_len']}); tokens "
             f"{sweep['skip_tokens']}..{sweep['end_tokens']} of every row scored",
             f"{'tgt_len':>8} {'mem_len':>8} {'m':>5} {'loss':>8} {value:>9} {'tokens':>8}  notes"]
    for p in sweep["points"]:
        pr = p["protocol"]
        if "error" in p:
            lines.append(f"{pr['tgt_len']:>8} {pr['mem_len']:>8} {p['multiple']:>5.1f} "
                         f"{'-':>8} {'-':>9} {'-':>8}  not run: {p['error']}")
            continue
        shown = p["bpc"] if value == "bpc" else p["ppl"]
        lines.append(f"{pr['tgt_len']:>8} {pr['mem_len']:>8} {p['multiple']:>5.1f} "
                     f"{p['loss']:>8.4f} {shown:>9.4f} {p['tokens']:>8.0f}  "
                     + "; ".join(p["notes"]))
    return "\n".join(lines)


def plot_sweep(sweep: dict, out_png: Path) -> Path:
    # matplotlib (~0.4 s to import) only when a sweep is drawn
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    metric = next((p["metric"] for p in sweep["points"] if "metric" in p), "ppl")
    fig = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    by_tgt: dict[int, list] = {}
    for p in sweep["points"]:
        if "error" in p:
            continue
        by_tgt.setdefault(p["protocol"]["tgt_len"], []).append(p)
    for tgt_len, pts in sorted(by_tgt.items()):
        pts = sorted(pts, key=lambda p: p["protocol"]["mem_len"])
        ys = [p["bpc"] if metric == "bpc" else p["loss"] for p in pts]
        ax.plot([p["protocol"]["mem_len"] for p in pts], ys, "o-", label=f"tgt_len {tgt_len}")
        for p, y in zip(pts, ys, strict=True):
            if p["notes"]:
                ax.plot(p["protocol"]["mem_len"], y, "x", color="red", markersize=9)
    ax.axvline(sweep["trained"]["mem_len"], color="gray", linestyle=":",
               label="trained mem_len")
    ax.set(xlabel="evaluation mem_len (tokens)", ylabel="bpc" if metric == "bpc"
           else "loss (nats)", title=f"memory-length sweep ({sweep['split']}); x: point "
           "with a note")
    ax.grid(alpha=0.3)
    ax.legend()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100, bbox_inches="tight")
    return out_png


def sweep_curve(sweep: dict) -> list[tuple[str, float, int]]:
    """The sweep as MLflow points: one loss curve per segment length, x = mem_len."""
    return [(f"sweep_{sweep['split']}_loss_tgt{p['protocol']['tgt_len']}", p["loss"],
             p["protocol"]["mem_len"]) for p in sweep["points"] if "error" not in p]
