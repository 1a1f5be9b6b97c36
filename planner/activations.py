"""Bytes of one training window per GPU, counted from the code (for `memtrain plan`).

Activations are the tensors autograd saves for backward, read off model/ one by one (B rows
per rank, L segment, M memory, K keys, D distances, H heads, dh, d, d_inner, V vocabulary,
s bytes of the model dtype: 4 fp32, 2 bf16/fp16; each storage counted once):
- attention (model/attention.py, `relative_attention`; Transformer-XL §3.3), the kernel that
  model/attention_kernels.py `choose_kernel` picks in training:
  - one-pass relative softmax (CPU training; LaMemo's branches everywhere): (q+u), (q+v),
    K as a view of kv_net's output (V shares that storage; LaMemo's look-ahead reads the
    causal call's), W_kR R once per call, the fp32 probabilities [B,H,Q,K]; then P·V keeps
    a [B·H,K,dh] copy of V and P in the model dtype or dropped out (with its dropatt mask).
  - SDPA's memory-efficient kernel on a GPU (XL, RMT): the positional term as a float bias;
    it keeps q+u, k, v (copies padded to a multiple of 8 in the head when d_head is not),
    the bias [B,H,Q,K] (last dim padded to 16) in the model dtype, its output and an fp32
    log-sum-exp; the positional matmul its (q+v) copy and R expanded to [B·H,dh,D].
  - plain reference (`attn_impl: plain`): the folded operands of both score matmuls, the
    bool mask [B|1,Q,K], the fp32 softmax output, P in the model dtype, any dropatt mask and
    a V copy.
  The linear layers keep their inputs: the layer input, [memory ∘ input] (kv_net),
  [B,Q,H·dh] (o_net) and the dropped-out R (once per segment).
- sub-layers: a dropout mask per dropout (bool on CUDA, `native_dropout`; the noise in the
  model dtype on CPU); LayerNorm its input and row mean/rstd (fp32 on CUDA); the FFN W1's
  input, ReLU output and W2's input [B,Q,d_inner]; pre-LN the LayerNorms' inputs and outputs.
- the rows, keys and distances of each layer's attention calls, the rows through its W_o and
  FFN, what else it saves and the state it carries: as each mechanism states them
  (`segment_shapes`, model/shapes.py; XL Q = L, K = M+L; LaMemo's look-ahead and
  interpolation, Ji et al. 2022 Eq. 7-11, in model/mechanisms/lamemo/core.py; RMT Q = 2m+L, D =
  Q+K-1, Bulatov et al. 2022 §3, in model/mechanisms/rmt/core.py). Nothing here asks which mechanism
  it counts.
- a layer stated tensor by tensor (a pretrained Hugging Face decoder, `StatedLayer` from
  model/pretrained/shapes.py): its blocks' saved tensors, backward phases and trained
  parameters as stated, plus what each `scaled_dot_product_attention` call's kernel keeps
  (`_sdpa`); its embedding and head likewise stated, and its parameter counts its own
  (`shape_class(cfg).parameter_counts`: only what `model.hf.finetune` trains gets
  gradients).
- head (model/adaptive.py, in chunks of rows recomputed in backward: model/loss.py): W's
  input [N, d] (N = B·L) and the targets; backward holds one chunk's fp32 log-softmax;
  adaptive softmax (Grave et al. 2016): the concatenated head weight, the head log-softmax and
  its row copy, each tail cluster's rows' log-softmax. Rows per cluster: a Zipf law (rank^-1)
  over the frequency-sorted vocabulary (natural text puts more in the head: an upper bound).
Memory state (model/memory.py): the FIFO copies the last M rows of [old ∘ new] into a storage
of their own, so a state costs the bytes of the tensors its mechanism lists; when a mechanism
says the new state IS the segment's layer inputs (XL with L = M: no copy), the window saves
them anyway.

The peak of a window from these blocks: window.py. Validated on CPU by
benchmarks/bench_memory_plan.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from model import ModelConfig, build_model
from model.attention_kernels import sdpa_head_pad
from model.backbones import shape_class
from model.loss import chunk_rows
from model.shapes import LayerShape, SdpaShape, SegmentShapes, StatedBlock, StatedLayer


@dataclass
class Dims:
    """Shapes and byte sizes of one rank's window (`kernel`: "cuda" or "cpu")."""

    cfg: ModelConfig
    rows: int                 # B: stream rows of this rank
    mem_len: int              # M (XL cache; RMT's XL cache beside the memory tokens)
    precision: str = "bf16"
    kernel: str = "cuda"

    @property
    def s(self) -> int:       # bytes per element of the model dtype
        return 4 if self.precision == "fp32" else 2

    @property
    def mask(self) -> int:    # dropout mask bytes per element (LayerNorm stats: ln_stat)
        return 1 if self.kernel == "cuda" else self.s

    ln_stat = property(lambda self: 4 if self.kernel == "cuda" else self.s)


@dataclass
class Block:
    """A stretch of the forward: what it saves, what its backward allocates while it runs,
    its parameter-gradient bytes; in a checkpointed layer what it keeps and recomputes."""

    name: str
    saved: float = 0.0
    transient: float = 0.0
    params: float = 0.0
    kept: float | None = None      # None: what it saves stays until its backward
    recompute: float = 0.0
    forward: float = 0.0           # held by its forward beyond what it saves (a re-run's peak)
    parts: dict = field(default_factory=dict)  # category -> bytes, for the breakdown

    def add(self, category: str, nbytes: float) -> None:
        self.saved += nbytes
        self.parts[category] = self.parts.get(category, 0.0) + nbytes

    @property
    def held(self) -> float:
        return self.saved if self.kept is None else self.kept


@dataclass
class Params:
    total: int                   # Ψ (tied weights once)
    embedding: int               # AdaptiveEmbedding (incl. the weight tied into the softmax)
    head_only: int               # softmax parameters not shared with the embedding
    attn: int                    # one layer's attention sub-layer
    ff: int                      # one layer's FFN
    other: int                   # u, v (v-), RMT initial memory and memory LayerNorm
    largest_module: int          # the largest single tensor (ZeRO-3 gathers it whole)
    # What trains (None: everything): gradients, optimizer state and the autograd engine's
    # gradient buffers are counted for these only. A pretrained base may be frozen or
    # adapted (`model.hf.finetune`).
    trained: int | None = None
    # Elements of a trained weight shared by the input embedding and the output head (None:
    # the native rule, `ModelConfig.tie_weight`).
    tied: int | None = None

    @property
    def trained_total(self) -> int:
        return self.total if self.trained is None else self.trained

    @property
    def frozen(self) -> int:
        return self.total - self.trained_total


def count_params(cfg: ModelConfig) -> Params:
    """Exact parameter counts of the model, built on the meta device (no memory)."""
    counts = getattr(shape_class(cfg), "parameter_counts", None)
    if counts is not None:   # a model that counts its own (model/pretrained/shapes.py)
        c = counts(cfg)
        return Params(c.total, 0, 0, 0, 0, 0, c.largest, trained=c.trained, tied=c.tied)
    with torch.device("meta"):
        model = build_model(ModelConfig.from_dict(cfg.to_dict()))
    emb_ids = {id(p) for p in model.embedding.parameters()}
    n = lambda ps: sum(p.numel() for p in ps)  # noqa: E731
    layer = model.core.layers[0]
    total, emb = n(model.parameters()), n(model.embedding.parameters())
    head_only = n(p for p in model.softmax.parameters() if id(p) not in emb_ids)
    attn, ff = n(layer.attn.parameters()), n(layer.ff.parameters())
    other = total - emb - head_only - cfg.n_layer * (attn + ff)
    return Params(total, emb, head_only, attn, ff, other,
                  max(p.numel() for p in model.parameters()))


def head_cluster_rows(cfg: ModelConfig) -> list[float]:
    """Fraction of target tokens in each softmax cluster under a Zipf law (module doc)."""
    ends = [0, *cfg.cutoffs, cfg.vocab_size]
    norm = math.log(cfg.vocab_size) + 0.5772  # harmonic number H_V
    cum = [0.0] + [min(1.0, (math.log(e) + 0.5772) / norm) for e in ends[1:]]
    return [cum[i + 1] - cum[i] for i in range(len(ends) - 1)]


def _attention(pos: Block, blk: Block, dm: Dims, q: int, k: int, dist: int, mask_rows: int,
               need_lse: bool = False, kv_saved: bool = False) -> None:
    """Saved tensors of one `relative_attention` call (module docstring, first item), for the
    kernel `attention_kernels.choose_kernel` picks in training: the positional matmul's in
    `pos`, whose backward runs the skew's backward with the score gradient and the K, V
    gradients (kv_net's output waits for both) alive; the rest in `blk`, whose backward holds
    the fp32 probability gradients. kv_saved: K and V are views of a kv_net output that an
    earlier call already keeps (LaMemo's look-ahead reads the causal call's keys)."""
    c = dm.cfg
    b, h, dh, s = dm.rows, c.n_head, c.d_head, dm.s
    a_k, resid = b * h * q * k, 3 * b * q * c.d_model * s
    pos.transient = a_k * (s + 8) + b * h * q * dist * (s + 8) + resid + 2 * b * k * h * dh * s
    blk.transient = a_k * 8 + resid
    if c.attn_impl == "fused" and not need_lse and dm.kernel == "cuda":
        # memory-efficient SDPA kernel: q+u, out, k and v, bias, logsumexp; the head padded
        # to a multiple of 8 (new q, k, v copies) when d_head is not one already.
        dhp = dh + sdpa_head_pad(dh, "cuda")
        pos.add("rel-pos", b * h * q * dh * s + b * h * dh * dist * s)   # (q+v) copy, R expanded
        blk.add("scores", mask_rows * q * k)                              # bool mask
        blk.add("qkv", 2 * b * h * q * dhp * s + 2 * b * k * h * dhp * s)
        blk.add("scores", b * h * q * (-(-k // 16) * 16) * s + b * h * (-(-q // 32) * 32) * 4)
        return
    if c.attn_impl == "fused":
        # One-pass relative softmax (CPU training; LaMemo's branches everywhere): it keeps
        # (q+u), (q+v), K as a view of kv_net's output (whose storage V shares), R's
        # projection once per call (no batch copy) and the fp32 probabilities; no mask.
        pos.add("rel-pos", b * h * q * dh * s + dist * h * dh * s)
        blk.add("qkv", b * h * q * dh * s + b * h * dh * k * s)        # (q+u), V copy
        if not kv_saved:
            blk.add("qkv", 2 * b * k * h * dh * s)                    # kv_net's output
        blk.add("scores", a_k * 4)
        if c.dropatt > 0:                                             # mask, dropped P
            blk.add("scores", a_k * dm.mask + a_k * s)
        elif s != 4:
            blk.add("scores", a_k * s)                                # P in the model dtype
        return
    # The plain reference path keeps the model dtype.
    pos.add("rel-pos", b * h * q * dh * s + b * h * dh * dist * s)   # (q+v) copy, R expanded
    blk.add("scores", mask_rows * q * k)                              # bool mask
    blk.add("qkv", b * h * q * dh * s + 2 * b * h * dh * k * s)       # (q+u), K^T, V copies
    blk.add("scores", a_k * 4)                                        # fp32 softmax output
    if s != 4 or c.dropatt > 0:
        blk.add("scores", a_k * s)                                    # P in dtype / dropped P
    if c.dropatt > 0:
        blk.add("scores", a_k * dm.mask)


def _post_attention(blk: Block, dm: Dims, rows: int) -> None:
    """o_net input, dropout, residual LayerNorm (post-LN) over `rows` query rows."""
    c = dm.cfg
    b, d, s = dm.rows, c.d_model, dm.s
    blk.add("qkv", b * rows * c.n_head * c.d_head * s)                # o_net input
    blk.add("dropout", b * rows * d * dm.mask * (c.dropout > 0))
    if not c.pre_lnorm:
        blk.add("layernorm", b * rows * d * s + 2 * b * rows * dm.ln_stat)


def _ffn(dm: Dims, rows: int, params: int) -> list[Block]:
    """[W1 input, ReLU output, dropout mask] and [W2 input, mask, LayerNorm] over `rows`."""
    c = dm.cfg
    b, d, di, s = dm.rows, c.d_model, c.d_inner, dm.s
    inner, outer = Block("ffn", params=params * s), Block("ffn-out")
    if c.pre_lnorm:   # LN(x): its input (the residual) and its output (W1's input)
        inner.add("layernorm", b * rows * d * s + 2 * b * rows * dm.ln_stat)
    inner.add("ffn", b * rows * (d * s + di * s + di * dm.mask * (c.dropout > 0)))
    outer.add("ffn", b * rows * (di * s + d * dm.mask) * (c.dropout > 0))   # W2 input, mask
    if not c.pre_lnorm:
        outer.add("layernorm", b * rows * d * s + 2 * b * rows * dm.ln_stat)
    # In-place ReLU on Linear's output view: CopySlices' backward clones the gradient into a
    # new base and runs threshold_backward on it (3 x [B,R,d_inner]).
    inner.transient = 3 * b * rows * di * s + b * rows * d * s
    outer.transient = b * rows * di * s + 2 * b * rows * d * s
    return [inner, outer]


def _projections(blk: Block, dm: Dims, q_rows: int, kv_rows: int) -> None:
    """Inputs of q_net and kv_net: the layer input, and [memory ∘ input] when there is a
    memory (a new tensor); pre-LN saves the LayerNorms' inputs and outputs instead."""
    b, d, s = dm.rows, dm.cfg.d_model, dm.s
    blk.add("qkv", b * q_rows * d * s)
    if kv_rows != q_rows:
        blk.add("qkv", b * kv_rows * d * s)
    if dm.cfg.pre_lnorm:   # LN(h) for q and LN([mem ∘ h]) for kv: outputs + stats
        blk.add("layernorm", b * (q_rows + kv_rows) * (d * s + 2 * dm.ln_stat))


def _attention_blocks(dm: Dims, params: int, q_rows: int, kv_rows: int, q: int, k: int,
                      dist: int, mask_rows: int, need_lse: bool = False,
                      kv_saved: bool = False) -> list[Block]:
    pos, blk = Block("attention-positions", params=params * dm.s), Block("attention")
    _projections(pos, dm, q_rows, kv_rows)
    _attention(pos, blk, dm, q, k, dist, mask_rows, need_lse, kv_saved)
    return [pos, blk]


def _sdpa(blk: Block, dm: Dims, a: SdpaShape) -> float:
    """What torch's scaled_dot_product_attention keeps besides q, k and v (stated by its
    caller) for a call with a [1, 1, Q, K] boolean mask; returns what its backward
    allocates (the output's gradient, then q's, k's and v's).
    On a GPU the mask rules out the flash kernel and the memory-efficient one runs: it keeps
    its output [B, Q, H, dh] (which W_o reads: `transpose(1, 2).contiguous()` copies
    nothing), an fp32 log-sum-exp [B, H, Q padded to 32] and the mask converted to a bias
    in the model dtype, K padded to 16 (head dims not a multiple of 8: padded q, k, v
    copies). On the CPU the flash kernel for CPU: output, fp32 log-sum-exp [B, H, Q], the
    mask in the model dtype. A call without a mask (`a.masked` false) keeps no mask, and on
    a GPU runs the flash kernel: its log-sum-exp is [B, H, Q]."""
    b, s, h, dh, q, k = dm.rows, dm.s, a.heads, a.head_dim, a.queries, a.keys
    blk.add("qkv", b * q * h * dh * s)                                   # output
    if dm.kernel == "cuda":
        pad = sdpa_head_pad(dh, "cuda")
        if pad:
            blk.add("qkv", b * h * (q + 2 * k) * (dh + pad) * s)
        if a.masked:
            blk.add("scores", b * h * (-(-q // 32) * 32) * 4 + q * (-(-k // 16) * 16) * s)
        else:
            blk.add("scores", b * h * q * 4)
    else:
        blk.add("scores", b * h * q * 4 + (q * k * s if a.masked else 0))
    return b * h * (2 * q + 2 * k) * dh * s


def _stated_block(dm: Dims, sb: StatedBlock) -> Block:
    """A block stated tensor by tensor (model/shapes.py `StatedBlock`): its backward holds
    the `alive` gradients and the largest of its phases and SDPA calls."""
    nbytes = lambda ts: sum(t.nbytes(dm.s, dm.kernel) for t in ts)  # noqa: E731
    blk = Block(sb.name, params=sb.trained_params * dm.s)
    for t in sb.saved:
        blk.add(t.category, t.nbytes(dm.s, dm.kernel))
    phases = [nbytes(ph) for ph in sb.phases] + [_sdpa(blk, dm, a) for a in sb.attention]
    blk.transient = nbytes(sb.alive) + max(phases, default=0.0)
    blk.forward = nbytes(sb.forward)
    return blk


def _layer_blocks(dm: Dims, p: Params, layer: LayerShape | StatedLayer, first_in_window: bool
                  ) -> list[Block]:
    """A layer's blocks from its shapes (model/shapes.py): each attention call with a graph,
    what else it saves, then W_o, LayerNorm and the FFN over its out_rows; a stated layer's
    blocks as stated."""
    if isinstance(layer, StatedLayer):
        return [_stated_block(dm, sb) for sb in layer.blocks]
    c = dm.cfg
    b, s = dm.rows, dm.s
    blocks: list[Block] = []
    for j, a in enumerate(x for x in layer.attention if x.graph):
        blocks += _attention_blocks(dm, p.attn if j == 0 else 0, a.q_input, a.kv_input,
                                    a.queries, a.keys, a.distances, b if a.mask_per_row else 1,
                                    need_lse=a.need_lse, kv_saved=a.shares_kv)
        if a.q_input_is_state and first_in_window and not c.pre_lnorm:
            # q_net reads the carried state itself (contiguous since the FIFO copies it:
            # no new tensor).
            blocks[-2].add("qkv", -b * a.q_input * c.d_model * s)
    last = blocks[-1]
    if layer.saved:
        last.add("extra", sum(t.nbytes(s) for t in layer.saved))
    if layer.state_read and not first_in_window:   # the previous segment's state (FIFO copies)
        last.add("extra", sum(t.nbytes(s) for t in layer.state_read))
    _post_attention(last, dm, layer.out_rows)
    return [*blocks, *_ffn(dm, layer.out_rows, p.ff)]


def _embedding(dm: Dims, p: Params) -> Block:
    c = dm.cfg
    b, n, s = dm.rows, c.tgt_len, dm.s
    blk = Block("embedding", params=(p.embedding - tied_bytes(c, p) + p.other) * s)
    blk.add("head", b * n * 8)                                          # token ids
    blk.add("dropout", b * n * c.d_model * dm.mask * (c.dropout > 0))
    blk.transient = p.embedding * s + b * n * c.d_model * s             # dense [V, d] grad
    return blk


def tied_bytes(c: ModelConfig, p: Params) -> int:
    """Elements of the trained weight the head shares with the embedding."""
    if p.tied is not None:
        return p.tied
    return p.embedding if c.tie_weight else 0


def _head(dm: Dims, p: Params, rows_out: int, n_rows: int) -> Block:
    """Final dropout over `rows_out` rows, the (adaptive) log-softmax over n_rows targets,
    in chunks of rows recomputed in backward (model/loss.py): forward keeps only the head's
    input rows and the targets; backward holds one chunk's logits and their gradients."""
    c = dm.cfg
    d, s = c.d_model, dm.s
    blk = Block("head", params=(p.head_only + tied_bytes(c, p)) * s)
    blk.add("dropout", dm.rows * rows_out * d * dm.mask * (c.dropout > 0))
    blk.add("head", n_rows * d * s + n_rows * 9)                       # W input, index, mask
    ends = [0, *c.cutoffs, c.vocab_size]
    if not c.cutoffs:
        rows = min(n_rows, chunk_rows(c.vocab_size))
        # A chunk's re-run logits and their float32 log-softmax, its gradient and the
        # logits' gradient; W's gradient from the matmul (the whole matrix: no split)
        blk.transient = 3 * rows * c.vocab_size * 4 + c.vocab_size * d * s
        return blk
    frac = head_cluster_rows(c)
    v_head = ends[1] + len(ends) - 2
    rows = min(n_rows, chunk_rows(v_head))
    # One chunk's re-run: the concatenated head weight, its log-softmax and a copy, each
    # tail cluster's rows and log-softmax; then their gradients.
    chunk = v_head * d * s + rows * v_head * 4 * (1 + frac[0])
    for i in range(1, len(ends) - 1):
        rows_i = rows * frac[i]
        chunk += rows_i * (d * s + 16) + rows_i * (ends[i + 1] - ends[i]) * 4
    # The split's [V, d] gradient (model/adaptive.py `_cluster_params`) beside the largest
    # cluster's weight gradient: the fit to the measured WikiText-103 rows (BENCHMARKS.md).
    biggest = max([v_head] + [ends[i + 1] - ends[i] for i in range(1, len(ends) - 1)])
    blk.transient = chunk + 3 * rows * v_head * 4 + p.embedding * s + biggest * d * s
    return blk


def shapes(dm: Dims) -> SegmentShapes:
    """The segment's shapes as its mechanism states them (model/shapes.py)."""
    return shape_class(dm.cfg).segment_shapes(dm.cfg, dm.rows, dm.mem_len)


def segment_blocks(dm: Dims, p: Params, first_in_window: bool = False
                   ) -> tuple[Block, list[list[Block]], Block]:
    """(embedding, per-layer blocks, head) of one segment with a full memory."""
    c, sh = dm.cfg, shapes(dm)
    b = dm.rows
    layers = [_layer_blocks(dm, p, layer, first_in_window) for layer in sh.layers]
    if sh.head is not None:      # stated embedding and head
        return _stated_block(dm, sh.embedding), layers, _stated_block(dm, sh.head)
    head = _head(dm, p, sh.output_rows, b * c.tgt_len)
    if sh.memory_norm_rows:   # a LayerNorm over rows of the output (a view of its storage)
        head.add("layernorm", b * sh.output_rows * c.d_model * dm.s
                 + 2 * b * sh.memory_norm_rows * dm.ln_stat)
    if sh.aux_targets:
        aux = _head(dm, p, 0, b * sh.aux_targets)
        head.add("head", aux.saved)
        head.transient = max(head.transient, aux.transient)
    return _embedding(dm, p), layers, head


def positional_bytes(dm: Dims) -> float:
    """Dropped-out R read by every layer's r_net, saved once per segment (distances)."""
    return shapes(dm).distances * dm.cfg.d_model * dm.s


def state_bytes(dm: Dims) -> float:
    """One memory state as the model leaves it (module docstring, "Memory state")."""
    return shapes(dm).state_bytes(dm.s)
