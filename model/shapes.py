"""The shapes of one training segment, as each mechanism states them for a memory count.

Every mechanism's native class (model/mechanisms/xl/core.py, lamemo.py, rmt.py, armt.py) has a
classmethod `segment_shapes(cfg, rows, mem_len) -> SegmentShapes`: one segment of `rows`
batch rows with a full memory of `mem_len` entries, told as the rows and columns of its
attention calls, the rows through each layer's W_o and FFN, what else a layer saves for
backward, and the state it carries to the next segment. The GPU-memory planner (planner/)
turns these into bytes and never asks which mechanism it plans; the mechanism registry
(model/mechanisms/) picks the class for `ModelConfig.mechanism` (`model.lm.core_class`).

A layer whose code is not ours (a pretrained Hugging Face decoder, model/pretrained/shapes.py)
is stated tensor by tensor instead (`StatedLayer`): the tensors each stretch of its forward
saves for backward, what its backward allocates while it runs, the trained parameters it
uses, and its `scaled_dot_product_attention` calls, whose kernel-dependent tensors the
planner counts; the segment's embedding and head likewise (`SegmentShapes.embedding`,
`head`).

Row counts of attention calls and layers are per batch row (the planner multiplies by the
batch); `TensorShape.shape` is a whole tensor, batch included. For Transformer-XL (§3.3):
one call per layer with Q = L queries, K = M + L keys and D = M + L distances.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionShape:
    """One `relative_attention` call (model/attention.py) of a layer."""

    queries: int                # Q: query rows
    keys: int                   # K: key columns
    distances: int              # D: relative distances its positional term covers
    q_input: int                # rows of q_net's input
    kv_input: int               # rows of kv_net's input ([memory ∘ input]); equal to
    #                             q_input: the same tensor as q_net's (no memory)
    mask_per_row: bool          # the bool mask is [B, Q, K] (per-row memory validity), not
    #                             [1, Q, K]
    need_lse: bool = False      # its caller reads the log-sum-exp (LaMemo's interpolation)
    shares_kv: bool = False     # K and V are views of the previous call's kv_net output
    graph: bool = True          # runs with autograd recording (LaMemo's top look-ahead not)
    q_input_is_state: bool = False  # in a window's first segment q_net reads the carried
    #                             state itself (no new tensor; post-LN)


@dataclass(frozen=True)
class TensorShape:
    """A tensor (or `count` of them, e.g. one per layer), batch dim included. dtype:
    "model" (the model's dtype), "fp32", "int64", "bool", "cast": a model-dtype copy of an
    fp32 tensor, which does not exist when the model runs in fp32; and two whose bytes
    depend on the kernel (`kernel` "cuda" or "cpu"): "mask", a dropout's saved mask (CUDA's
    fused dropout keeps 1-byte masks, the CPU the noise in the model dtype), and "stat",
    LayerNorm's saved mean or rstd (fp32 on CUDA, the model dtype on the CPU).
    `category`: what it is, for the planner's breakdown (stated layers only)."""

    shape: tuple[int, ...]
    dtype: str = "model"
    count: int = 1
    category: str = "extra"

    def nbytes(self, model_bytes: int, kernel: str = "cuda") -> int:
        per = {"model": model_bytes, "fp32": 4, "int64": 8, "bool": 1,
               "cast": model_bytes if model_bytes != 4 else 0,
               "mask": 1 if kernel == "cuda" else model_bytes,
               "stat": 4 if kernel == "cuda" else model_bytes}
        return self.count * math.prod(self.shape) * per[self.dtype]


@dataclass(frozen=True)
class LayerShape:
    """One decoder layer: its attention calls in forward order (the first one's kv_net and
    parameters are the layer's), then W_o, dropout, LayerNorm and the FFN over out_rows."""

    attention: tuple[AttentionShape, ...]
    out_rows: int
    input_rows: int             # rows of the layer's input (what per-layer checkpointing keeps)
    input_saved: bool           # the first projection saves that input itself (q_net)
    saved: tuple[TensorShape, ...] = ()       # other tensors its forward saves
    state_read: tuple[TensorShape, ...] = ()  # carried-state tensors its backward reads (made
    #                                           inside the window from the second segment on)


@dataclass(frozen=True)
class SdpaShape:
    """One `torch.nn.functional.scaled_dot_product_attention` call with a [1, 1, Q, K] boolean
    mask, per batch row: its q, k and v are stated by the caller (saved tensors of its
    block); the planner adds what the kernel keeps (its output, log-sum-exp, the mask in the
    model dtype) and allocates in backward, which depend on the device."""

    queries: int
    keys: int
    heads: int                  # query heads (keys and values repeated to as many)
    head_dim: int
    # False: a call with no mask (the causal flag or none), so nothing of a mask is kept;
    # RMT's "paper" pattern split into maskless calls (model/pretrained/paper_attention.py).
    masked: bool = True


@dataclass(frozen=True)
class StatedBlock:
    """A stretch of a stated layer's forward (see the module docstring): `saved` the tensors
    autograd keeps for it (each storage once); while its backward runs, `alive` the
    gradients that stay alive through all of it (the residual stream's) and, besides them,
    `phases`: what each step allocates at once (the largest counts, as does each SDPA
    call's, which the planner adds); `trained_params` the elements of the trained
    parameters it uses (their gradients); `attention` its SDPA calls; `ops` the outputs a
    selective `bptt.recompute` policy can keep (train/recompute.py), by category: "linear"
    (an mm / addmm output), "ffn-out" (the matmul reducing over d_inner), "bmm" (kept with
    the attention matmuls), "draws" (a dropout's random draws, one bool per element)."""

    name: str
    saved: tuple[TensorShape, ...] = ()
    alive: tuple[TensorShape, ...] = ()
    phases: tuple[tuple[TensorShape, ...], ...] = ()
    trained_params: int = 0
    attention: tuple[SdpaShape, ...] = ()
    ops: tuple[TensorShape, ...] = ()
    # What its forward holds at once beyond what it saves (an output not kept for backward
    # while the next op reads it): a checkpointed segment's re-run peaks there.
    forward: tuple[TensorShape, ...] = ()


@dataclass(frozen=True)
class StatedLayer:
    """A decoder layer stated block by block, in forward order (the planner walks the
    backward in reverse)."""

    blocks: tuple[StatedBlock, ...]
    input_rows: int             # rows of the layer's input (what per-layer checkpointing keeps)
    input_saved: bool = False   # its first block saves that input itself


@dataclass(frozen=True)
class SegmentShapes:
    layers: tuple[LayerShape | StatedLayer, ...]
    distances: int              # rows of Dropout(R), every distance list of the segment
    output_rows: int            # rows of the stack's output (its final dropout)
    state: tuple[TensorShape, ...]   # the state carried to the next segment
    state_text: str             # the same, in words and shapes
    state_aliases_inputs: bool = False  # the new state IS the segment's layer inputs (no copy)
    memory_norm_rows: int = 0   # rows of a LayerNorm over a view of the output (RMT's memory
    #                             LayerNorm over the write rows); 0: none
    aux_targets: int = 0        # per-row targets of an auxiliary softmax loss
    saved_label: str = ""       # what the layers' `saved` tensors are, for a breakdown
    mem_len_adds: str | None = None   # what a mem_len > 0 would add beside the state
    # Stated instead of counted by the planner's model of the native embedding and softmax
    # (planner/activations.py): the input side (embedding, memory rows) and the output side
    # (final norm, vocabulary head, loss) of a stated decoder.
    embedding: StatedBlock | None = None
    head: StatedBlock | None = None

    def state_bytes(self, model_bytes: int) -> int:
        return sum(t.nbytes(model_bytes) for t in self.state)


@dataclass(frozen=True)
class MemoryRows:
    """What a mechanism adds to a pretrained decoder's segment (model/pretrained/shapes.py
    states the base model's own blocks around it): its `Mechanism.pretrained_rows`."""

    rows: int                   # rows through every decoder layer (tokens and memory)
    own_mask: bool              # the base model's own causal mask (no mask passed in)
    input_rows: int             # rows of a layer's input kept by layer checkpointing
    state: tuple[TensorShape, ...]   # the state carried to the next segment
    state_text: str
    # Carried-state tensors every layer's backward reads (their gradient stays alive
    # through the whole segment's backward).
    state_read: tuple[TensorShape, ...] = ()
    blocks: tuple[StatedBlock, ...] = ()        # its stated blocks before a layer's own
    embedding_saved: tuple[TensorShape, ...] = ()   # what its input side keeps
    saved_label: str = ""
    # The attention calls of one layer where the mechanism runs its own (each a
    # maskless call on grouped keys; their outputs concatenated into the rows the output
    # projection reads); empty: one SDPA call over all rows.
    sdpa_calls: tuple[SdpaShape, ...] = ()


def xl_cache(cfg, rows: int, mem_len: int) -> tuple[tuple[TensorShape, ...], str]:
    """An XL cache (model/memory.py `XLMemory`): per layer its last mem_len inputs."""
    if mem_len == 0:
        return (), ""
    shape = (rows, mem_len, cfg.d_model)
    return ((TensorShape(shape, count=cfg.n_layer),),
            f"XL cache {cfg.n_layer} x [{', '.join(map(str, shape))}]")
