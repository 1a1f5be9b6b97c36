"""The relative-position decoder stack shared by Transformer-XL, LaMemo, RMT and ARMT.

A mechanism's native core (named by its module in model/mechanisms/) is a subclass of
`RelativeBackbone` that decides which rows are queries, which are keys, and what state to
carry; the layers, the global biases u/v and the positional
sinusoid live here once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .attention import DecoderLayer
from .config import ModelConfig
from .positional import clamp_distances, sinusoid


@dataclass
class Lengths:
    """Run-time memory settings; evaluation may use other values than training (XL §3.3:
    "increase [M] by multiple times during evaluation")."""

    mem_len: int
    clamp_len: int = -1
    same_length: bool = False

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> Lengths:
        return cls(cfg.mem_len, cfg.clamp_len, cfg.same_length)


def causal_allowed(n_q: int, m_now: int, length: torch.Tensor | None, lengths: Lengths,
                   device) -> torch.Tensor:
    """Keys a current-segment query may see: bool [B|1, n_q, m_now + n_q].

    Query i sits at m_now + i on the key axis [memory ∘ segment]; key j is allowed if
    j <= m_now + i (causal), if the memory entry is valid for that row (documents reset),
    and, with same_length, if the distance is below mem_len so that every query sees exactly
    mem_len keys itself included (the XL code's triu + tril mask; XL §3.3 evaluation).
    """
    n_k = m_now + n_q
    dist = (m_now + torch.arange(n_q, device=device))[:, None] - torch.arange(n_k, device=device)
    allowed = dist >= 0
    if lengths.same_length:
        allowed &= dist < lengths.mem_len
    allowed = allowed[None]
    if m_now > 0 and length is not None:
        key_valid = torch.arange(n_k, device=device)[None] >= (m_now - length.to(device))[:, None]
        allowed = allowed & key_valid[:, None, :]
    return allowed


class Learned(nn.Module):
    """One learned tensor, handed out by calling the module.

    Parameters a mechanism uses directly (u, v, v−, RMT's initial memory) are fetched by
    calling their own module inside the forward. Under ZeRO-3 that call is what gathers a
    partitioned parameter, and its output tensor is what re-gathers it for backward; a
    parameter read as a plain attribute is missed when gradient reaches it only through the
    memory (e.g. RMT segments whose own loss is not counted).
    """

    def __init__(self, value: torch.Tensor):
        super().__init__()
        self.value = nn.Parameter(value)

    def forward(self) -> torch.Tensor:
        # A copy, not the Parameter itself: ZeRO-3 frees a module's parameters after its
        # forward, which would empty a returned Parameter that the graph still holds.
        return self.value.clone()


class RelativeBackbone(nn.Module):
    """Layers, u/v biases (shared, or per layer with untie_r) and the sinusoid R."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layer))
        shape = (cfg.n_layer, cfg.n_head, cfg.d_head) if cfg.untie_r else (cfg.n_head, cfg.d_head)
        # u and v of A^rel terms (c) and (d): "global" biases shared across layers in the
        # PyTorch code and in LaMemo; the TF SoTA scripts untie them per layer.
        self.rel_u = Learned(torch.zeros(shape))
        self.rel_v = Learned(torch.zeros(shape))
        self.drop = nn.Dropout(cfg.dropout)

    @classmethod
    def segment_shapes(cls, cfg: ModelConfig, rows: int, mem_len: int):
        """One training segment's shapes (model/shapes.py `SegmentShapes`): each mechanism
        states its own, next to its forward."""
        raise NotImplementedError(f"{cls.__name__} states no segment shapes, so `memtrain "
                                  "plan` cannot count it: implement segment_shapes "
                                  "(model/shapes.py)")

    @property
    def u_bias(self) -> nn.Parameter:
        return self.rel_u.value

    @property
    def v_bias(self) -> nn.Parameter:
        return self.rel_v.value

    def bias_tensors(self) -> tuple[torch.Tensor, ...]:
        """(u, v) for this forward: call once per forward, pass to `biases`."""
        return self.rel_u(), self.rel_v()

    def biases(self, layer: int, bias: tuple[torch.Tensor, ...] | None = None,
               future: bool = False):
        """(u, v) of one layer; future=True gives LaMemo's v− (third entry of `bias`)."""
        bias = self.bias_tensors() if bias is None else bias
        u, v = bias[0], bias[2] if future else bias[1]
        if self.cfg.untie_r:
            return u[layer], v[layer]
        return u, v

    def r_emb(self, distances: torch.Tensor, lengths: Lengths, absolute: bool = False,
              dtype: torch.dtype | None = None) -> torch.Tensor:
        """Dropout(R) for a distance list; XL applies dropout to the sinusoid itself."""
        d = clamp_distances(distances.abs() if absolute else distances, lengths.clamp_len)
        r = sinusoid(d, self.cfg.d_model)
        return self.drop(r if dtype is None else r.to(dtype))

    def run_layer(self, fn, *args):
        """Per-layer activation checkpointing (non-reentrant: one backward per step under
        ZeRO-2/3; the RNG state is restored so recomputed dropout masks are identical)."""
        if self.cfg.checkpoint_layers and torch.is_grad_enabled():
            return checkpoint(fn, *args, use_reentrant=False)
        return fn(*args)
