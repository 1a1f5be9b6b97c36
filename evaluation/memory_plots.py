"""Memory analyses: how much, how far back, and through what each mechanism reads its memory.

Three analyses, each one plot (PNG) with the plotted numbers beside it (JSON, same name):

- attention mass against relative distance (Transformer-XL; LaMemo's causal branch, Eq. 2):
  per layer, the share of attention probability on keys d tokens back, averaged over heads
  and query rows; the share on memory keys says how much of the attention the memory gets.
- LaMemo's memorizing coefficient α (Eq. 11) per layer against memory index, 0 = oldest
  (LaMemo Fig. 6): α ≈ 1 keeps the causal context, a smaller α takes in the look-ahead.
- RMT attention maps of one sample over the [read | segment | write] rows and columns
  (RMT Fig. 6), averaged over heads, plus the share of attention each block gives each block.

The model records through `RelativeSelfAttention.attn_log` and `LaMemo.alpha_log`; recording
does not change a forward's result. `memtrain analyze` (evaluation/analyze_cli.py)
runs this on a checkpoint. Layers are numbered from 1 in plots and JSON, as in the papers.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from model.attention import AttentionRecord, AttnLayout
from train.run_dir import atomic_write_json

MAX_PANELS = 8  # layers drawn per figure, evenly spaced (LaMemo Fig. 6 shows 8 of 16)


# ----------------------------------------------------------------------------- records
def block_spans(layout: AttnLayout, start: int, n: int) -> list[tuple[str, int, int]]:
    """(name, lo, hi) of the blocks that axis positions start .. start+n-1 fall in, with
    lo/hi relative to `start` (row or column indices of the probability matrix)."""
    out, pos = [], 0
    for name, length in layout.blocks:
        lo, hi = max(pos, start), min(pos + length, start + n)
        if hi > lo:
            out.append((name, lo - start, hi - start))
        pos += length
    return out


def query_spans(rec: AttentionRecord) -> list[tuple[str, int, int]]:
    return block_spans(rec.layout, rec.layout.query_start, rec.prob.shape[2])


def key_spans(rec: AttentionRecord) -> list[tuple[str, int, int]]:
    return block_spans(rec.layout, rec.layout.key_start, rec.prob.shape[3])


def distance_mass(rec: AttentionRecord) -> tuple[np.ndarray, float, int]:
    """(mass[d] for d = 0, 1, ..., mass on memory keys, number of query rows), each summed
    over batch rows, heads and queries. Distance d = query position - key position; keys
    right of a query (d < 0) are masked in the causal attention this is meant for."""
    _, _, n_q, n_k = rec.prob.shape
    dev = rec.prob.device
    dist = ((rec.layout.query_start + torch.arange(n_q, device=dev))[:, None]
            - (rec.layout.key_start + torch.arange(n_k, device=dev))[None])
    pair = rec.prob.double().sum(dim=(0, 1))  # [Q, K]
    keep = dist >= 0
    mass = torch.bincount(dist[keep], weights=pair[keep], minlength=1)
    memory = sum(float(pair[:, lo:hi].sum()) for name, lo, hi in key_spans(rec)
                 if name == "memory")
    rows = rec.prob.shape[0] * rec.prob.shape[1] * n_q
    return mass.cpu().numpy(), memory, rows


@contextmanager
def recording(core, alpha: bool = False):
    """Give every layer a fresh attention log (and LaMemo a fresh α log) inside the block;
    yields (per-layer record lists, α list or None). Previous settings are restored."""
    logs: list[list[AttentionRecord]] = [[] for _ in core.layers]
    saved = [layer.attn.attn_log for layer in core.layers]
    saved_alpha = getattr(core, "alpha_log", None)
    alphas = [] if alpha else None
    for layer, log in zip(core.layers, logs, strict=True):
        layer.attn.attn_log = log
    if alpha:
        core.alpha_log = alphas
    try:
        yield logs, alphas
    finally:
        for layer, old in zip(core.layers, saved, strict=True):
            layer.attn.attn_log = old
        if alpha:
            core.alpha_log = saved_alpha


# ----------------------------------------------------------------------------- accumulators
class DistanceProfile:
    """Attention mass against relative distance, per layer, over many segments."""

    def __init__(self, n_layer: int):
        self.mass = [np.zeros(1) for _ in range(n_layer)]
        self.memory = np.zeros(n_layer)
        self.rows = np.zeros(n_layer)

    def add(self, layer: int, rec: AttentionRecord) -> None:
        mass, memory, rows = distance_mass(rec)
        cur = self.mass[layer]
        if len(mass) > len(cur):
            cur = self.mass[layer] = np.pad(cur, (0, len(mass) - len(cur)))
        cur[:len(mass)] += mass
        self.memory[layer] += memory
        self.rows[layer] += rows

    def result(self) -> dict:
        n_d = max(len(m) for m in self.mass)
        rows = np.maximum(self.rows, 1)
        return {"distance": list(range(n_d)),
                "mass": [(np.pad(m, (0, n_d - len(m))) / r).tolist()
                         for m, r in zip(self.mass, rows, strict=True)],
                "memory_share": (self.memory / rows).tolist(),
                "query_rows": self.rows.astype(int).tolist()}


class AlphaProfile:
    """Mean α per layer and memory slot; slot 0 is the oldest of mem_len slots. A memory not
    yet full is right-aligned (its newest entry is slot mem_len - 1); entries of rows whose
    memory was reset (beyond the state's `length`) are left out."""

    def __init__(self, n_layer: int, mem_len: int):
        self.mem_len = mem_len
        self.sum = np.zeros((n_layer, mem_len))
        self.count = np.zeros((n_layer, mem_len))

    def add(self, alphas: list[torch.Tensor], length: torch.Tensor) -> None:
        """alphas: one [B, M, H] per layer (LaMemo.alpha_log of one forward)."""
        for layer, a in enumerate(alphas):
            _, m_now, n_head = a.shape
            idx = torch.arange(m_now, device=a.device)
            valid = idx[None] >= (m_now - length.to(a.device))[:, None]  # [B, M]
            total = (a.double() * valid[..., None]).sum(dim=(0, 2))
            slots = self.mem_len - m_now + np.arange(m_now)
            self.sum[layer, slots] += total.cpu().numpy()
            self.count[layer, slots] += valid.sum(0).cpu().numpy() * n_head

    def mean(self) -> np.ndarray:
        """[n_layer, mem_len]; NaN where a slot never held a valid entry."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.count > 0, self.sum / self.count, np.nan)

    def result(self) -> dict:
        return {"memory_index": list(range(self.mem_len)), "alpha": self.mean().tolist(),
                "entries": self.count.astype(int).tolist()}


class RMTBlocks:
    """Share of attention each query block gives each key block, per layer (mean over rows,
    heads and query rows of the block), and the head-mean map of one sample."""

    def __init__(self, n_layer: int):
        self.sums: list[dict] = [{} for _ in range(n_layer)]
        self.rows: list[dict] = [{} for _ in range(n_layer)]
        self.sample: list[dict] | None = None

    def add(self, layer: int, rec: AttentionRecord) -> None:
        qs, ks = query_spans(rec), key_spans(rec)
        per_row = rec.prob.double().mean(dim=(0, 1))  # [Q, K], head and batch mean
        for q_name, q_lo, q_hi in qs:
            rows = per_row[q_lo:q_hi]
            self.rows[layer][q_name] = self.rows[layer].get(q_name, 0) + (q_hi - q_lo)
            into = self.sums[layer].setdefault(q_name, {})
            for k_name, k_lo, k_hi in ks:
                into[k_name] = into.get(k_name, 0.0) + float(rows[:, k_lo:k_hi].sum())

    @staticmethod
    def sample_map(rec: AttentionRecord, row: int = 0) -> dict:
        return {"map": rec.prob[row].mean(dim=0).cpu().numpy(),
                "query_blocks": query_spans(rec), "key_blocks": key_spans(rec)}

    def result(self) -> dict:
        share = [{q: {k: v / self.rows[i][q] for k, v in into.items()}
                  for q, into in layer.items()} for i, layer in enumerate(self.sums)]
        return {"block_share": share}


# ----------------------------------------------------------------------------- running
class MemoryAnalysis:
    """Runs segments through a model with recording on and accumulates the analyses its
    mechanism names (`Mechanism.analyses`, model/mechanisms/: distance for XL, LaMemo and
    ARMT; α for LaMemo, whose core records it; block maps for RMT)."""

    def __init__(self, model):
        self.model = model
        core = model.core
        n_layer = len(core.layers)
        analyses = model.cfg.mech.analyses
        self.mechanism = type(core).__name__
        mem_len = model.lengths.mem_len
        self.distance = DistanceProfile(n_layer) if "distance" in analyses else None
        self.alpha = (AlphaProfile(n_layer, mem_len) if "alpha" in analyses and mem_len > 0
                      and hasattr(core, "alpha_log") else None)
        self.blocks = RMTBlocks(n_layer) if "blocks" in analyses else None
        self.segments = 0

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, state, *, count: bool = True):
        """Run one segment (tokens [B, L]) from `state` (the model in eval mode); add it to
        the analyses if `count`. Returns the new memory state."""
        core = self.model.core
        with recording(core, alpha=self.alpha is not None) as (logs, alphas):
            out = self.model(tokens, state)
        if not count:
            return out.state
        self.segments += 1
        for layer, records in enumerate(logs):
            for rec in records:
                if self.distance is not None and rec.layout.branch == "causal":
                    self.distance.add(layer, rec)
                if self.blocks is not None:
                    self.blocks.add(layer, rec)
        if self.alpha is not None and alphas:
            self.alpha.add(alphas, state.length)
        if self.blocks is not None:
            self.blocks.sample = [RMTBlocks.sample_map(records[-1]) for records in logs]
        return out.state

    def write(self, out_dir: Path, stem: str, meta: dict) -> list[Path]:
        """Write the plots that apply as <name>_<stem>.png and .json; returns the paths."""
        out_dir = Path(out_dir)
        meta = {**meta, "mechanism": self.mechanism, "segments": self.segments}
        files: list[Path] = []
        if self.distance is not None:
            files += plot_distance(self.distance.result(), meta,
                                   out_dir / f"attention_vs_distance_{stem}.png")
        if self.alpha is not None:
            files += plot_alpha(self.alpha.result(), meta,
                                out_dir / f"alpha_by_memory_index_{stem}.png")
        if self.blocks is not None and self.blocks.sample is not None:
            files += plot_rmt_maps(self.blocks.sample, self.blocks.result(), meta,
                                   out_dir / f"rmt_attention_maps_{stem}.png")
        return files

    def summary(self) -> list[str]:
        """One line per analysis with its headline numbers."""
        lines = []
        if self.distance is not None:
            share = self.distance.result()["memory_share"]
            lines.append("attention on memory keys per layer: " + ", ".join(
                f"{i + 1}: {s:.3f}" for i, s in enumerate(share)))
        if self.alpha is not None:
            mean = self.alpha.mean()
            lines.append("mean alpha per layer: " + ", ".join(
                f"{i + 1}: {np.nanmean(a):.3f}" if np.isfinite(a).any() else f"{i + 1}: -"
                for i, a in enumerate(mean)))
        if self.blocks is not None:
            share = self.blocks.result()["block_share"]
            lines.append("segment rows' attention on read memory per layer: " + ", ".join(
                f"{i + 1}: {s.get('segment', {}).get('read', 0.0):.3f}"
                for i, s in enumerate(share)))
        return lines


# ----------------------------------------------------------------------------- plots
def shown_layers(n_layer: int) -> list[int]:
    """At most MAX_PANELS layer indices, evenly spaced, first and last included."""
    return sorted({int(round(x)) for x in np.linspace(0, n_layer - 1, min(n_layer, MAX_PANELS))})


def _figure(width: float, height: float):
    # matplotlib (~0.4 s to import) only when a figure is drawn. Figure + Agg canvas instead
    # of pyplot: no global backend switch, no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _finite(value):
    """NaN/inf -> None, numpy -> lists, recursively, so the JSON is strict."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if isinstance(value, np.ndarray):
        return _finite(value.tolist())
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, np.integer):
        return int(value)
    return value


def _save(fig, data: dict, png: Path) -> list[Path]:
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100, bbox_inches="tight")
    data_path = atomic_write_json(png.with_suffix(".json"), _finite(data), allow_nan=False)
    return [png, data_path]


def _title(meta: dict) -> str:
    return (f"{meta.get('run', '')} {meta.get('checkpoint', '')}, {meta.get('split', '')}: "
            f"{meta['segments']} segments x {meta.get('rows', '?')} rows, mem_len "
            f"{meta.get('mem_len', '?')}, tgt_len {meta.get('tgt_len', '?')}")


def plot_distance(result: dict, meta: dict, png: Path) -> list[Path]:
    """Attention mass against distance, one line per layer, log scale."""
    fig = _figure(7.5, 4.5)
    ax = fig.add_subplot(1, 1, 1)
    dist = np.array(result["distance"])
    for i in shown_layers(len(result["mass"])):
        mass = np.array(result["mass"][i])
        shown = np.where(mass > 0, mass, np.nan)  # log axis: zeros are not drawn
        ax.plot(dist, shown, linewidth=1.2,
                label=f"layer {i + 1} (memory {result['memory_share'][i]:.0%})")
    tgt_len = meta.get("tgt_len")
    if tgt_len and tgt_len < len(dist):
        ax.axvline(tgt_len - 0.5, color="grey", linestyle="--", linewidth=0.8)
        ax.text(tgt_len, 0.02, " d ≥ L: memory keys only", fontsize=8, color="grey",
                transform=ax.get_xaxis_transform())
    ax.set_yscale("log")
    ax.set(xlabel="relative distance d (tokens back)",
           ylabel="attention mass (mean over heads, queries)")
    ax.set_title("Attention mass vs distance\n" + _title(meta), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    data = {"meta": meta, "description": "mass[layer][d]: mean over heads, batch rows and "
            "query rows of the probability on keys d tokens back (each layer sums to 1); "
            "memory_share: the part of it on memory keys", **result,
            "layers": list(range(1, len(result["mass"]) + 1))}
    return _save(fig, data, png)


def plot_alpha(result: dict, meta: dict, png: Path) -> list[Path]:
    """LaMemo Fig. 6: mean α per layer against memory index (0 = oldest)."""
    fig = _figure(7.5, 4.5)
    ax = fig.add_subplot(1, 1, 1)
    alpha = np.array(result["alpha"], dtype=float)
    for i in shown_layers(len(alpha)):
        ax.plot(result["memory_index"], alpha[i], linewidth=1.2, label=f"layer {i + 1}")
    ax.set_ylim(0, 1.05)
    ax.set(xlabel="memory index (0 = oldest)",
           ylabel="memorizing coefficient α (mean over heads, rows)")
    ax.set_title("LaMemo α per layer (Eq. 11; Fig. 6)\n" + _title(meta), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    data = {"meta": meta, "description": "alpha[layer][i]: mean α of memory slot i (0 = "
            "oldest) over heads, batch rows and segments; entries: how many values", **result,
            "layers": list(range(1, len(alpha) + 1))}
    return _save(fig, data, png)


def _mark_blocks(ax, q_blocks, k_blocks) -> None:
    for _, lo, _ in q_blocks[1:]:
        ax.axhline(lo - 0.5, color="white", linewidth=0.9)
    for _, lo, _ in k_blocks[1:]:
        ax.axvline(lo - 0.5, color="white", linewidth=0.9)
    ax.set_yticks([(lo + hi - 1) / 2 for _, lo, hi in q_blocks], [n for n, _, _ in q_blocks],
                  fontsize=7)
    ax.set_xticks([(lo + hi - 1) / 2 for _, lo, hi in k_blocks], [n for n, _, _ in k_blocks],
                  fontsize=7)


def plot_rmt_maps(sample: list[dict], blocks: dict, meta: dict, png: Path) -> list[Path]:
    """RMT Fig. 6: head-mean attention of sample row 0, one panel per shown layer."""
    layers = shown_layers(len(sample))
    cols = min(4, len(layers))
    n_rows = math.ceil(len(layers) / cols)
    fig = _figure(3.6 * cols, 3.3 * n_rows + 0.6)
    for panel, i in enumerate(layers):
        ax = fig.add_subplot(n_rows, cols, panel + 1)
        m = sample[i]["map"]
        image = ax.imshow(m, cmap="viridis", vmin=0.0, vmax=max(float(m.max()), 1e-9),
                          interpolation="nearest", aspect="auto")
        _mark_blocks(ax, sample[i]["query_blocks"], sample[i]["key_blocks"])
        ax.set_title(f"layer {i + 1}", fontsize=9)
        ax.set_xlabel("keys", fontsize=8)
        ax.set_ylabel("queries", fontsize=8)
        fig.colorbar(image, ax=ax, fraction=0.05)
    fig.suptitle("RMT attention, batch row 0 of the last segment, mean over heads\n"
                 + _title(meta), fontsize=9)
    data = {"meta": meta, "description": "maps[layer]: probabilities [query, key] of batch row "
            "0 of the last analysed segment, mean over heads; blocks as (name, first, end); "
            "block_share[layer][query block][key block]: mean over all analysed segments, "
            "rows, heads and the block's query rows of the probability on that key block",
            "layers": [i + 1 for i in layers],
            "maps": [np.round(sample[i]["map"], 6) for i in layers],
            "query_blocks": [sample[i]["query_blocks"] for i in layers],
            "key_blocks": [sample[i]["key_blocks"] for i in layers], **blocks}
    return _save(fig, data, png)
