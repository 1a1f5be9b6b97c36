"""What every mechanism with memory tokens shares, on either backbone: the learned initial
memory and the LayerNorm its carried write outputs pass (RMT, ARMT with carried tokens,
Titans' persistent rows around a pretrained decoder), the write rows, the XL cache kept
beside the memory tokens. A mechanism takes these from here, never from another
mechanism's module.
"""

from __future__ import annotations

import torch
from torch import nn

from .backbone import Learned, Lengths
from .config import ModelConfig
from .memory import XLMemory


def memory_token_parameters(cfg: ModelConfig, memory_norm: str
                            ) -> tuple[Learned, nn.LayerNorm | None]:
    """The learned initial memory [m, d] and, where the write outputs are carried, the
    LayerNorm they pass before becoming the next memory (RMT here; ARMT with carried tokens,
    model/mechanisms/armt/core.py)."""
    # Learnable initial memory, broadcast over the batch (RMT code). Drawn at the scale of a
    # scaled token embedding, N(0, init_std * sqrt(d)), rows independent; the authors'
    # N(0, 1) with `[randn(1, d)] * m` makes all rows one vector. Measured on copy
    # (docs/rmt.md): the init is not what decides learning, the layer norm placement is;
    # pre-LN learns from either init, post-LN from neither.
    std = cfg.init_std * cfg.d_model ** 0.5
    memory_init = Learned(torch.randn(cfg.mech.num_mem_tokens(cfg), cfg.d_model) * std)
    # Pre-LN leaves the residual stream unnormalised, and the write outputs become the next
    # segment's layer-0 inputs, so without a norm the memory grows with every segment it
    # passes (measured at init: x44 over 200 segments of a stream) until the tokens cannot
    # use it. Post-LN outputs are already normalised. Its gain is `memory_norm` (the
    # mechanism's option: `model.rmt.memory_norm`, `model.armt.memory_norm`)
    # (docs/rmt.md has what each choice measured).
    norm = None
    if cfg.pre_lnorm and memory_norm != "none":
        norm = nn.LayerNorm(cfg.d_model)
        if memory_norm == "embedding":
            nn.init.constant_(norm.weight, std)
    return memory_init, norm


def write_rows(h: torch.Tensor, start: int, norm: nn.Module | None = None) -> torch.Tensor:
    """The write outputs h[:, start:] that become the next memory (RMT, and ARMT's carried
    tokens, on either backbone): through the memory LayerNorm, or a copy of the rows, not a
    view: a view keeps the whole [B, rows, d] output alive for as long as the memory lives,
    which under segment checkpointing is every segment of the BPTT window (the next segment
    keeps its input memory)."""
    write = h[:, start:]
    return norm(write) if norm is not None else write.clone()


def side_cache(state, lengths: Lengths, bsz: int, device) -> XLMemory | None:
    """The XL cache kept beside the memory tokens (Tr-XL + RMT, §3.4; ARMT's sliding
    window), or None: whether there is one is decided by the run-time mem_len (evaluation
    may switch it on or off), and a state that has none yet starts it empty."""
    if lengths.mem_len == 0:
        return None
    if state.cache is not None:
        return state.cache
    return XLMemory(length=torch.zeros(bsz, dtype=torch.long, device=device))


def pretrained_memory_init(cfg, base, m: int, memory_scale: float | None):
    """The learned initial memory [m, d] around a pretrained model, drawn at the scale of the
    pretrained token rows the memory sits among: the embedding weight's std (unless
    `memory_scale` gives it: a sharded base has no materialised embeddings to measure) times
    the factor the embedding module itself multiplies its output by (Gemma's sqrt(d_model),
    transformers' `*ScaledWordEmbedding.scalar_embed_scale`; 1 for the others); None for
    m = 0."""
    if not m:
        return None
    embedding = base.get_input_embeddings()
    if memory_scale is None:
        weight = embedding.weight
        if weight.numel() == 0:
            raise ValueError("the input embeddings are not materialised (a sharded "
                             "load): pass memory_scale")
        memory_scale = float(weight.detach().float().std())
    rows = float(getattr(embedding, "scalar_embed_scale", 1.0))
    return Learned(torch.randn(m, cfg.d_model) * (memory_scale * rows))
