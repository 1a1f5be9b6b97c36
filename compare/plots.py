"""The comparison's figures, as PNG bytes (embedded in report.html, written for report.md).

Readable from 2 to 40 runs: run i has the same colour and line style in every figure (the 10
tab10 colours, then again dashed, dotted, dash-dotted: 40 distinct) and its number #i+1 in
every legend, axis and table. Legends sit outside the axes, so no curve hides under them,
and run names are cut short so that a long one cannot squeeze the plot.
matplotlib's Figure + Agg canvas instead of pyplot (as train/tracking.py): no global state,
no backend switch, no display needed.
"""

from __future__ import annotations

import io
import math

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator, NullLocator

# tab10, written out so that the HTML swatches use the very same colours.
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf")
LINESTYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D")
LEGEND_ROWS = 20      # entries per legend column: 40 runs still fit beside a 4.5 in plot
DPI = 100
MAX_POINTS = 2000     # per curve; see _thin

Series = list[tuple[int, str, list[tuple[float, float]]]]   # (run index, label, points)


def style(i: int) -> dict:
    """Colour, line style and marker of run i, the same in every figure."""
    turn = (i // len(COLOURS)) % len(LINESTYLES)
    return {"color": COLOURS[i % len(COLOURS)], "linestyle": LINESTYLES[turn],
            "marker": MARKERS[turn]}


def _figure(width: float, height: float) -> Figure:
    # No constrained layout: it would shrink the axes to make room for a long legend; the
    # image grows instead (bbox_inches="tight" in png()), so every plot keeps its size.
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig


def png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    # bbox_inches="tight" grows the image to hold the legend placed outside the axes.
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
    return buf.getvalue()


def _legend(ax) -> None:
    n = len(ax.get_legend_handles_labels()[1])
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize=8,
              frameon=False, ncol=max(1, math.ceil(n / LEGEND_ROWS)), handlelength=3)


def _upper_limit(series: Series) -> float | None:
    """A y limit that leaves out the first 10% of every curve when those early points (the
    loss of an untrained model) are far above the rest and would flatten the comparison."""
    late = [v for _, _, pts in series for _, v in pts[len(pts) // 10:]]
    top = max(v for _, _, pts in series for _, v in pts)
    if not late:
        return None
    lo, hi = min(late), max(late)
    margin = 0.1 * (hi - lo or abs(hi) or 1.0)
    return hi + margin if top > hi + 3 * margin else None


def curves(series: Series, **kwargs) -> bytes | None:
    """PNG of `curves_figure`; None when there is nothing to draw."""
    fig = curves_figure(series, **kwargs)
    return None if fig is None else png(fig)


def bars(labels: list[str], panels: list[tuple[str, list[float | None], str]],
         indices: list[int]) -> bytes | None:
    """PNG of `bars_figure`; None when there is nothing to draw."""
    fig = bars_figure(labels, panels, indices)
    return None if fig is None else png(fig)


def curves_figure(series: Series, *, title: str, xlabel: str, ylabel: str,
                  markers: bool = False, clip_start: bool = False, log_x: bool = False,
                  extra: Series = ()) -> Figure | None:
    """Overlaid curves, one per run; `extra` adds unconnected points ('x') in the runs'
    colours (one-off evaluations beside a sweep). `log_x`: a log-2 x axis when the x values
    span a wide range (memory lengths are usually swept in doublings)."""
    series = [s for s in series if s[2]]
    if not series and not any(pts for _, _, pts in extra):
        return None
    fig = _figure(7.5, 4.5)
    ax = fig.add_subplot(1, 1, 1)
    for i, name, pts in series:
        st = style(i)
        xs, ys = zip(*_thin(pts), strict=True)
        many = len(pts) > 30  # markers only where they still tell points apart
        ax.plot(xs, ys, label=name, color=st["color"], linestyle=st["linestyle"],
                linewidth=1.3, marker=st["marker"] if markers and not many else None,
                markersize=4)
    for i, name, pts in extra:
        if pts:
            xs, ys = zip(*pts, strict=True)
            shown = any(j == i for j, _, _ in series)
            ax.plot(xs, ys, "x", color=style(i)["color"], markersize=7, mew=1.5,
                    label=None if shown else name)
    top = _upper_limit(series) if clip_start and series else None
    if top is not None:
        ax.set_ylim(top=top)
        ax.set_title(f"{title} (y axis cut above {top:.3g}: early steps)", fontsize=10)
    else:
        ax.set_title(title, fontsize=10)
    ax.set(xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    xs = sorted({x for _, _, pts in (*series, *extra) for x, _ in pts})
    if log_x:
        _log_x(ax, xs)
    _legend(ax)
    return fig


def _thin(pts: list, most: int = MAX_POINTS) -> list:
    """Every k-th point (and the last) of a long curve: a 750-pixel-wide plot cannot show
    100k logged steps, and drawing them all makes a 30-run report slow to build."""
    if len(pts) <= most:
        return pts
    step = math.ceil(len(pts) / most)
    return pts[::step] + ([pts[-1]] if (len(pts) - 1) % step else [])


def _log_x(ax, xs: list[float]) -> None:
    positive = [x for x in xs if x > 0]
    if not positive or max(positive) < 8 * min(positive):
        return
    # symlog: linear around 0, so mem_len 0 (no memory) stays on the axis.
    ax.set_xscale("symlog", base=2, linthresh=max(1.0, min(positive)), linscale=0.5)
    if len(xs) <= 12:  # label the lengths that were measured, not powers of two
        ax.set_xticks(xs, [f"{x:g}" for x in xs], fontsize=8)
        ax.xaxis.set_minor_locator(NullLocator())


def bars_figure(labels: list[str], panels: list[tuple[str, list[float | None], str]],
                indices: list[int]) -> Figure | None:
    """Horizontal bars, one row per run (names stay readable for 30 runs), one panel per
    (title, values, number format); a missing value is written 'n/a' instead of a bar."""
    if not labels or not any(v is not None for _, vals, _ in panels for v in vals):
        return None
    n = len(labels)
    fig = _figure(4.0 * len(panels) + 2.0, 0.9 + 0.28 * n)
    axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
    ys = list(range(n))
    colours = [style(i)["color"] for i in indices]
    for ax, (title, values, fmt) in zip(axes, panels, strict=True):
        widths = [v or 0.0 for v in values]
        ax.barh(ys, widths, color=colours, height=0.7)
        top = max(widths) or 1.0
        for y, v in zip(ys, values, strict=True):
            text = "n/a" if v is None else format(v, fmt)
            ax.text((v or 0.0) + 0.01 * top, y, text, va="center", fontsize=7)
        ax.set_xlim(0, top * 1.25)   # room for the value written after the longest bar
        ax.set_title(title, fontsize=10)
        ax.grid(axis="x", alpha=0.3)
        ax.tick_params(axis="x", labelsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(5))   # 5-digit tokens/s labels must not touch
    axes[0].set_yticks(ys, labels, fontsize=8)
    axes[0].invert_yaxis()   # run #1 on top, as in the tables
    return fig
