"""What a checkpointed segment keeps under a selective `bptt.recompute` policy (for
`memtrain plan`), counted from the code like activations.py.

train/recompute.py keeps, per checkpointed segment and until that segment's backward, the
outputs of the ops its policy matches, and with save-masks dropout's draws as bits:
- ffn-out: W2's output (the matmul whose reduction size is d_inner), [B, rows, d] per layer
  in the forward's order (`:N`: the first N layers);
- linear: every other mm / addmm output too: q_net, kv_net, r_net (once per call, no batch
  dim), o_net, W1, the adaptive embedding's projections, the softmax head's logits (the
  head cluster over every row, each tail cluster over its Zipf share of the rows);
- attention: the attention matmuls: the content scores [B·H, Q, K], the positional scores
  [B·H, Q, D] and P·V [B·H, Q, dh] (bmm, the one-pass and plain paths), or, where a GPU takes
  SDPA's memory-efficient kernel (XL, RMT), its output (head padded) and fp32 log-sum-exp
  besides the positional matmul;
- masks: one bit per element of every dropout on the CPU (aten.bernoulli_, packed 8 per
  byte). On CUDA dropout is the fused `native_dropout`, which train/recompute.py does not
  replay: it keeps nothing there (and saves no time).
Rows as in activations.py: a full memory, each layer's attention calls and W_o/FFN rows as
the mechanism states them (model/shapes.py; e.g. RMT Q = 2m + L, K = M + Q, D = Q + K − 1).
A call that runs without a graph (LaMemo's top look-ahead) still has its ops matched. A
pretrained decoder lists its own matmul outputs and draws (model/pretrained/shapes.py).
Validated on the CPU by benchmarks/bench_memory_plan.py (the rows with a policy).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from model.attention_kernels import sdpa_head_pad
from model.shapes import SegmentShapes
from train.recompute import parse_policy

from .activations import Dims, shapes


@dataclass
class SegmentOps:
    """Output bytes of one segment's matmuls by kind, and its dropout draws (elements)."""

    ffn_out: list[float] = field(default_factory=list)   # per layer, forward order
    linear: float = 0.0
    attention: float = 0.0
    draws: float = 0.0


def _attention(ops: SegmentOps, dm: Dims, q: int, k: int, dist: int, need_lse: bool) -> None:
    c = dm.cfg
    b, h, dh, s = dm.rows, c.n_head, c.d_head, dm.s
    ops.linear += b * q * h * dh * s + dist * h * dh * s      # q_net, r_net
    ops.attention += b * h * q * dist * s                      # positional scores (bmm)
    if c.attn_impl == "fused" and not need_lse and dm.kernel == "cuda":
        dhp = dh + sdpa_head_pad(dh, "cuda")
        ops.attention += b * h * q * dhp * s + b * h * (-(-q // 32) * 32) * 4
    else:
        ops.attention += b * h * q * k * s + b * h * q * dh * s  # content scores, P·V
    if c.dropatt > 0:
        ops.draws += b * h * q * k


def _output_ffn(ops: SegmentOps, dm: Dims, rows: int) -> None:
    """o_net, its dropout, W1 (+ dropout), W2 (+ dropout) over `rows` rows."""
    c = dm.cfg
    b, d, s = dm.rows, c.d_model, dm.s
    ops.linear += b * rows * d * s + b * rows * c.d_inner * s
    ops.ffn_out.append(b * rows * d * s)
    ops.draws += b * rows * (2 * d + c.d_inner)


def _stated_ops(dm: Dims, sh: SegmentShapes) -> SegmentOps:
    """The ops a stated segment lists (model/shapes.py `StatedBlock.ops`), and each SDPA
    call's outputs: the kernel's output and fp32 log-sum-exp (the CPU's flash kernel: [B,
    H, Q]; the GPU's memory-efficient one: Q padded to 32)."""
    ops = SegmentOps()
    blocks = [sh.embedding, *(blk for layer in sh.layers for blk in layer.blocks), sh.head]
    for blk in blocks:
        for t in blk.ops:
            nbytes = t.nbytes(dm.s, dm.kernel)
            if t.category == "ffn-out":
                ops.ffn_out.append(nbytes)
            elif t.category == "draws":
                ops.draws += nbytes
            elif t.category == "bmm":
                ops.attention += nbytes
            else:
                ops.linear += nbytes
        for a in blk.attention:
            lse = -(-a.queries // 32) * 32 if dm.kernel == "cuda" else a.queries
            ops.attention += dm.rows * a.heads * (a.queries * a.head_dim * dm.s + lse * 4)
    return ops


def segment_ops(dm: Dims) -> SegmentOps:
    """The matmul outputs and dropout draws of one training segment with a full memory."""
    sh = shapes(dm)
    if sh.head is not None:     # a stated segment (a pretrained decoder)
        return _stated_ops(dm, sh)
    c = dm.cfg
    b, n, d, s = dm.rows, c.tgt_len, c.d_model, dm.s
    ops = SegmentOps()
    n_clusters = len(c.cutoffs) + 1
    if c.div_val > 1:                      # adaptive input: every row, every cluster
        ops.linear += n_clusters * b * n * d * s
    ops.draws += b * n * d                 # Dropout(embedding)
    ops.draws += sh.distances * d          # Dropout(R): every distance list
    for layer in sh.layers:
        first = layer.attention[0]
        ops.linear += b * first.kv_input * 2 * c.n_head * c.d_head * s    # kv_net
        for a in layer.attention:         # a call without a graph still runs its ops
            _attention(ops, dm, a.queries, a.keys, a.distances, need_lse=a.need_lse)
        _output_ffn(ops, dm, layer.out_rows)
    ops.draws += b * sh.output_rows * d    # final dropout
    # The softmax head and its loss run outside the segment's checkpoint (model/
    # segment_lm.py): no policy keeps their ops.
    return ops


def kept_bytes(dm: Dims, policy: str) -> float:
    """Bytes one checkpointed segment keeps until its backward under `policy`."""
    p = parse_policy(policy)
    if p.outputs is None and not p.masks:
        return 0.0
    ops = segment_ops(dm)
    kept = ops.draws / 8 if p.masks and dm.kernel == "cpu" else 0.0
    if p.outputs == "ffn-out":
        kept += sum(ops.ffn_out[:p.limit])
    elif p.outputs in ("linear", "matmul"):
        kept += sum(ops.ffn_out) + ops.linear + (ops.attention if p.outputs == "matmul" else 0)
    return kept
