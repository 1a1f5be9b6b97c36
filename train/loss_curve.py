"""The run's loss curve (run_dir/loss_curve.png): train loss against step, valid loss as
points on top, read back from metrics.jsonl (what the tracker writes whatever MLflow does)."""

from __future__ import annotations

import json
import math
from pathlib import Path

# Metric names the loss plot looks for, first match wins (log train/loss and valid/loss).
TRAIN_LOSS_KEYS = ("train/loss", "train_loss", "loss")
VALID_LOSS_KEYS = ("valid/loss", "valid_loss", "val_loss", "eval/loss")


def _read_points(metrics_jsonl: Path, keys: tuple[str, ...]) -> list[tuple[int, float]]:
    """(step, value) of the first key in `keys` present in the file; the last line wins per
    step, because a job resumed from an older checkpoint logs some steps again."""
    by_key: dict[str, dict[int, float]] = {k: {} for k in keys}
    try:
        lines = Path(metrics_jsonl).read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            rec = json.loads(line)
            step = int(rec["step"])
        except (ValueError, KeyError, TypeError):  # e.g. a line cut short by a crash
            continue
        for k in keys:
            v = rec.get(k)
            if isinstance(v, (int, float)) and math.isfinite(v):
                by_key[k][step] = float(v)
    return next((sorted(points.items()) for points in by_key.values() if points), [])


def plot_loss_curve(metrics_jsonl: Path, out_png: Path) -> Path | None:
    """Train loss against step, valid loss as points on top; None when there is no loss."""
    train = _read_points(metrics_jsonl, TRAIN_LOSS_KEYS)
    valid = _read_points(metrics_jsonl, VALID_LOSS_KEYS)
    if not train and not valid:
        return None
    # matplotlib (~0.4 s to import) only when a figure is drawn. Figure + Agg canvas instead
    # of pyplot: no global backend switch, no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    if train:
        ax.plot(*zip(*train, strict=True), label="train", linewidth=1.2)
    if valid:
        ax.plot(*zip(*valid, strict=True), "o", label="valid", markersize=5)
    ax.set(xlabel="step", ylabel="loss (nats)")
    ax.grid(alpha=0.3)
    ax.legend()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100, bbox_inches="tight")
    return out_png
