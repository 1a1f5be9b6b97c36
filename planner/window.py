"""Peak bytes of one training window per GPU (for `memtrain plan`), from the per-block
accounting of activations.py.

Peak of a window (train/bptt.py `run_window`, one backward), walked block by block in
reverse (head, each layer's FFN then attention, embedding): a block frees what it saved and,
while it runs, adds its backward's allocations: one chunk's re-run logits and their fp32
log-prob gradients (model/loss.py), W's gradient
and, with an adaptive softmax, the [V,d] gradient its clusters' split writes (head); the
score and K, V gradients plus the skew's backward (a [B,H,Q,D] gradient of the positional
scores); 3·[B,Q,d_inner] (FFN: CopySlices of the in-place ReLU); [V,d] (embedding).
A parameter used again in an earlier segment (all when k >= 1, the tied embedding always)
holds a gradient buffer in the autograd engine until its last use. Segment checkpointing
keeps each segment's memory, outputs and the loss's input rows and recomputes one
segment's decoder at a time, layer
checkpointing the same per layer. Validated on CPU against train/memory_probe.py by
benchmarks/bench_memory_plan.py and the tests.
"""

from __future__ import annotations

from dataclasses import dataclass

from .activations import (
    Block,
    Dims,
    Params,
    count_params,
    positional_bytes,
    segment_blocks,
    shapes,
    state_bytes,
    tied_bytes,
)
from .recompute import kept_bytes


@dataclass
class WindowMemory:
    saved: float                 # held after the forward (the carried state's storages not)
    peak: float                  # peak growth over the step: activations, new states, grads
    per_segment: dict            # category -> bytes of one segment's saved tensors
    head_transient: float        # what the head's backward allocates


def _checkpointed(layer: list[Block], kept_in: float, dup: float) -> list[Block]:
    """A layer under `checkpoint_layers`: only its input stays (a block of its own, freed
    when the layer's backward is done); its last block recomputes the rest (less `dup`, the
    input itself when the first projection saves it)."""
    for blk in layer:
        blk.kept = 0.0
    layer[-1].recompute = sum(blk.saved for blk in layer) - dup
    layer[0].saved -= dup
    return [Block("layer input", saved=kept_in), *layer]


def window_memory(dm: Dims, p: Params, n_segments: int, checkpoint_segments: bool,
                  recompute: str = "full", keep_last: int = 0) -> WindowMemory:
    """Peak of one window of n_segments. With checkpoint_segments every segment but the last
    `keep_last` is checkpointed and keeps, besides its inputs and outputs, what `recompute`
    says (recompute.py); the last `keep_last` run as in a plain window."""
    c, sh = dm.cfg, shapes(dm)
    n_ckpt = max(0, n_segments - keep_last) if checkpoint_segments else 0
    seg_blocks = []
    for first in (True, False)[:n_segments]:
        # With segment checkpointing the previous states are alive anyway (counted below).
        emb, layers, head = segment_blocks(dm, p, first_in_window=first or checkpoint_segments)
        emb.add("rel-pos", positional_bytes(dm))
        if c.checkpoint_layers:
            # The layer's input tensor is the checkpoint's argument: XL/RMT queries' input
            # (saved by q_net, so not recomputed); a LaMemo layer's [memory ∘ segment] output
            # of the layer below (its rows are copied, not saved as such), h0 for layer 0.
            row = dm.rows * c.d_model * dm.s
            ins = [(x.input_rows * row, x.input_rows * row if x.input_saved else 0.0)
                   for x in sh.layers]
            layers = [_checkpointed(layer, kept, dup)
                      for layer, (kept, dup) in zip(layers, ins, strict=True)]
        seg_blocks.append([emb, *(blk for layer in layers for blk in layer), head])
    last = seg_blocks[-1]
    cats: dict = {}
    for blk in last:
        for cat, v in blk.parts.items():
            cats[cat] = cats.get(cat, 0.0) + v
    state = new_state = state_bytes(dm)
    if sh.state_aliases_inputs and not c.checkpoint_layers:
        # The mechanism says the new state IS the segment's layer inputs (XL with L = M,
        # model/memory.py `_last`), which the window saves anyway, unless its segment is
        # checkpointed (counted there with state). Per-layer checkpointing frees a layer's
        # input after that layer's backward, but this one stays alive as the state: counted
        # then.
        new_state = 0.0
    outputs = dm.rows * c.tgt_len * 5 + 5056                 # nll, mask, the CPU RNG state
    if dm.kernel == "cuda":   # the segment's token ids, copied to the GPU (the CPU's are
        outputs += dm.rows * (c.tgt_len + 1) * 8             # the data's own tensors)
    held = [sum(blk.held for blk in seg) for seg in seg_blocks]
    saved = held[0] + (n_segments - 1) * held[-1]
    n_plain = n_segments - n_ckpt
    kept = kept_bytes(dm, recompute) if n_ckpt else 0.0
    # The loss runs outside a segment's checkpoint (model/segment_lm.py): what it saves (the
    # head's input rows, the targets) stays from a checkpointed segment too, and its re-run
    # does not make it again.
    loss_kept = last[-1].parts.get("head", 0.0)
    if n_ckpt == 0:
        live = saved + new_state
    else:   # checkpointed segments keep their state, outputs and kept results; then plain
        live = n_ckpt * (state + outputs + kept + loss_kept) + n_plain * held[-1] + \
            (new_state if n_plain else 0.0)
    multi, buffers = n_segments > 1, 0.0
    peak = live
    if n_plain:
        # The last segment's forward, bounded above: all it saves, what the embedding's
        # callers hold and the block whose passing outputs are the largest (a
        # mixture-of-experts layer's k·N routed rows, model/pretrained/shapes.py).
        peak = live + last[0].forward + max(blk.forward for blk in last[1:])
    # Backward, last segment first: the plain ones, then the checkpointed ones. From the
    # second of a kind on every parameter's buffer exists and less is alive, so the later
    # segments cannot peak higher: two of each kind are simulated.
    for recomputed in [False] * min(n_plain, 2) + [True] * min(n_ckpt, 2):
        if recomputed:   # re-run the whole segment (its kept results are part of it)
            live += sum(blk.held for blk in last) - kept - loss_kept
            # The re-run starts when the loss's gradient reaches the decoder's output, which
            # stays alive through it; the forward holds besides its saved tensors what the
            # embedding's callers hold and the largest block's passing outputs.
            out_grad = dm.rows * sh.output_rows * c.d_model * dm.s
            passing = last[0].forward + max(blk.forward for blk in last[1:])
            peak = max(peak, live + buffers + out_grad + passing)
        for blk in reversed(last):
            live += blk.recompute
            peak = max(peak, live + buffers + blk.transient)
            live -= blk.saved
            if multi:        # every parameter is used again in an earlier segment
                buffers = min(buffers + blk.params, p.trained_total * dm.s)
            elif blk.name == "head":   # the tied weight is used again by the embedding
                buffers += tied_bytes(c, p) * dm.s
    return WindowMemory(saved, peak, cats, last[-1].transient)


def predict_window(cfg, rows: int, depth: int, checkpoint_segments: bool,
                   precision: str = "fp32", recompute: str = "full", keep_last: int = 0,
                   kernel: str = "cpu") -> dict:
    """{"saved", "peak"} bytes the plan gives one window of depth+1 segments of `rows` rows
    of the model `cfg` (a ModelConfig) with a full memory: what train/memory_probe.py
    `measure` measures, for the tests and benchmarks/bench_memory_plan.py to compare."""
    w = window_memory(Dims(cfg, rows, cfg.mem_len, precision, kernel=kernel), count_params(cfg),
                      depth + 1, checkpoint_segments, recompute, keep_last)
    return {"saved": w.saved, "peak": w.peak}
