"""Relative multi-head attention (Transformer-XL §3.3), shared by every native mechanism
(Transformer-XL, LaMemo, RMT, ARMT).

The score of query i against key j is (Dai et al. 2019, Eq. for A^rel, grouped as in the XL
code and the slides):

    A_ij = (q_i + u)^T k_j  +  (q_i + v)^T W_{k,R} R_{i-j}          scaled by 1/sqrt(d_head)
           \\_ (a) + (c) _/     \\________ (b) + (d) _________/

Two settings of `impl` compute softmax(A) V:
- "plain": both terms as matmuls, masked softmax, dropout, matmul. The reference.
- "fused": the fastest exact kernel for the device, picked by
  `attention_kernels.choose_kernel`: torch's scaled_dot_product_attention with the
  positional term as an additive bias (plus -inf for masked keys; head padded for the fused
  CUDA kernel) on CUDA and for CPU evaluation; the one-pass kernel `relative_softmax` (one
  score buffer, fused softmax, custom backward) for CPU training and wherever the
  log-normaliser is needed.
LaMemo needs each query's log-normaliser logsumexp_j A_ij (with its gradient, Eq. 11); it is
returned on request by the plain and one-pass paths (SDPA kernels do not expose it
differentiably).

For analyses, `RelativeSelfAttention.attn_log` set to a list records every call's
probabilities with an `AttnLayout` saying which rows and columns are memory, segment, or
RMT read/write tokens (evaluation/memory_plots.py plots them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .attention_kernels import choose_kernel, relative_softmax, sdpa_relative
from .positional import skew


class _SoftmaxWithLogNormaliser(torch.autograd.Function):
    """p = softmax(s) and lse = logsumexp(s) from ONE exponential pass, both differentiable.

    torch.softmax plus torch.logsumexp would exponentiate the scores twice forward and again
    in logsumexp's backward. Here: d p_j/d s_k = p_j (δ_jk − p_k) and d lse/d s_k = p_k, so
    grad_s = p ⊙ (grad_p − Σ_j grad_p_j p_j + grad_lse). Rows need >= 1 finite score.
    """

    @staticmethod
    def forward(ctx, scores):
        row_max = scores.amax(dim=-1, keepdim=True)
        p = torch.exp(scores - row_max)
        z = p.sum(dim=-1, keepdim=True)
        p.div_(z)
        ctx.save_for_backward(p)
        return p, (row_max + z.log()).squeeze(-1)

    @staticmethod
    def backward(ctx, grad_p, grad_lse):
        (p,) = ctx.saved_tensors
        inner = -(grad_p * p).sum(dim=-1, keepdim=True) if grad_p is not None else 0.0
        if grad_lse is not None:
            inner = inner + grad_lse[..., None]
        return p * (grad_p + inner) if grad_p is not None else p * inner


def softmax_with_lse(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax, logsumexp) over the last dim, in at least float32 (fp16/bf16 are upcast)."""
    return _SoftmaxWithLogNormaliser.apply(
        scores.to(torch.promote_types(scores.dtype, torch.float32)))


@dataclass(frozen=True)
class AttnLayout:
    """Where the query rows and key columns of one attention call sit on the sequence axis.

    The axis is the concatenation of `blocks` (name, length), oldest first: XL and LaMemo
    (("memory", M), ("segment", L)); RMT (("cache", C), ("read", m), ("segment", L),
    ("write", m)). Query row i sits at query_start + i and key column j at key_start + j, so
    their difference is the relative distance the call encodes with R_{i-j}. A plain
    dataclass, not a tuple: ZeRO-3's forward hooks pass it through untouched.
    """

    blocks: tuple[tuple[str, int], ...]
    query_start: int
    key_start: int
    branch: str = "causal"  # LaMemo: "causal" (Eq. 2) or "look_ahead" (Eq. 7-9)

    @classmethod
    def memory_then_segment(cls, n_q: int, n_k: int) -> AttnLayout:
        """Queries are the last n_q of n_k keys, the rest is memory (XL, LaMemo causal)."""
        n_mem = n_k - n_q
        return cls((("memory", n_mem), ("segment", n_q)), n_mem, 0)


@dataclass
class AttentionRecord:
    """One recorded attention call (analysis only; see RelativeSelfAttention.attn_log)."""

    prob: torch.Tensor      # [B, H, Q, K] float32, detached, before dropout; masked keys 0
    layout: AttnLayout


def relative_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    r: torch.Tensor,
    u_bias: torch.Tensor,
    v_bias: torch.Tensor,
    allowed: torch.Tensor,
    *,
    dropatt: float = 0.0,
    impl: str = "fused",
    need_lse: bool = False,
    skew_start: int = 0,
    probs: list | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attend Q query rows to K key rows with relative positions.

    q [B, Q, H, dh]; k, v [B, K, H, dh]; r [D, H, dh]: W_{k,R} R for the distance list of
    `positional.distance_list` (row t is distance d_max - t); u_bias, v_bias [H, dh];
    allowed: bool, broadcastable to [B, Q, K] (True = may attend). Every query row must have
    at least one allowed key. skew_start: how many leading distances r omits (see `skew`).
    dropatt is applied to the probabilities (pass 0 in eval). probs: a list to append the
    probabilities [B, H, Q, K] to (float32, detached, before dropout); forces the plain path.
    Returns (out [B, Q, H, dh], lse [B, Q, H] in float32 or None).
    """
    n_k = k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1])
    qh = q.transpose(1, 2)  # [B, H, Q, dh]
    kh = k.transpose(1, 2)
    vh = v.transpose(1, 2)
    mask = allowed[:, None] if allowed.dim() == 3 else allowed  # [B|1, 1, Q, K]
    kernel = choose_kernel(impl, q.device.type, need_lse=need_lse, record=probs is not None,
                           grad=torch.is_grad_enabled())
    # The 1/sqrt(d_head) scale (Vaswani et al. 2017 §3.2.1; XL §3.3 keeps it) is applied to
    # the query side BEFORE each matmul: the same scores, but in fp16 (V100) the unscaled
    # products (q+u)^T k and (q+v)^T W R can exceed 65504 and become inf before any later
    # scaling could bring them back, while the scaled ones are sqrt(d_head) times smaller.
    if kernel == "one_pass":
        prob32, lse = relative_softmax((qh + u_bias[:, None, :]) * scale, kh,
                                       (qh + v_bias[:, None, :]) * scale, r.permute(1, 2, 0),
                                       mask, skew_start, with_lse=need_lse)
        out = _weighted_values(prob32, vh, dropatt)
        return out.transpose(1, 2), lse.transpose(1, 2) if need_lse else None

    # (b) + (d): one matmul against the distance list, then the skew picks R_{i-j}.
    bd = skew(torch.matmul((qh + v_bias[:, None, :]) * scale, r.permute(1, 2, 0)), n_k,
              skew_start)
    if kernel == "sdpa":
        if need_lse:
            raise ValueError("the sdpa kernel returns no log-normaliser (need_lse)")
        # The content term's scale stays inside the kernel (fp32 accumulation in the GPU
        # kernels; the math fallback splits it over q and k before its matmul).
        out = sdpa_relative(qh + u_bias[:, None, :], kh, vh, bd.masked_fill(~mask, float("-inf")),
                            dropatt=dropatt, scale=scale)
        return out.transpose(1, 2), None

    # (a) + (c): content addressing plus the global content bias u. The two terms are
    # added in at least float32 (the softmax below runs in float32 anyway): two large fp16
    # terms must not overflow in their sum either.
    ac = torch.matmul((qh + u_bias[:, None, :]) * scale, kh.transpose(-1, -2))
    ac = ac.to(torch.promote_types(ac.dtype, torch.float32))
    scores = (ac + bd).masked_fill(~mask, float("-inf"))
    lse = None
    if need_lse:
        # Kept in float32: the LaMemo state stores log-normalisers so that fp16/bf16
        # exponentials never overflow (LaMemo §3.2, "logsumexp and logaddexp").
        prob32, lse = softmax_with_lse(scores)
        lse = lse.transpose(1, 2)
    else:
        prob32 = torch.softmax(scores.float(), dim=-1)
    if probs is not None:
        probs.append(prob32.detach())
    return _weighted_values(prob32, vh, dropatt).transpose(1, 2), lse


def _weighted_values(prob32: torch.Tensor, vh: torch.Tensor, dropatt: float) -> torch.Tensor:
    """Dropout(p) V, the probabilities cast to the values' dtype (fp16/bf16 under autocast)."""
    prob = prob32.to(vh.dtype)
    if dropatt > 0:
        prob = F.dropout(prob, p=dropatt, training=True)
    return torch.matmul(prob, vh)


class RelativeSelfAttention(nn.Module):
    """The attention sub-layer: projections, relative attention, output, residual, LayerNorm.

    No biases in the q/k/v/o projections nor in W_{k,R} (XL code). Post-LN by default
    (XL, LaMemo and RMT all train post-LN); `pre_lnorm` is the usual alternative.
    """

    def __init__(self, d_model: int, n_head: int, d_head: int, dropout: float, dropatt: float,
                 pre_lnorm: bool, impl: str):
        super().__init__()
        self.n_head, self.d_head = n_head, d_head
        # Separate q and kv projections (the XL code fuses them): XL needs queries only for
        # the current rows, and under ZeRO-3 a parameter is gathered only inside its own
        # module's call, so no code may slice a fused weight from outside.
        self.q_net = nn.Linear(d_model, n_head * d_head, bias=False)
        self.kv_net = nn.Linear(d_model, 2 * n_head * d_head, bias=False)
        self.r_net = nn.Linear(d_model, n_head * d_head, bias=False)
        self.o_net = nn.Linear(n_head * d_head, d_model, bias=False)
        self.layer_norm = nn.LayerNorm(d_model)
        self.drop = nn.Dropout(dropout)
        self.dropatt = dropatt
        self.pre_lnorm = pre_lnorm
        self.impl = impl
        # Set to a list to record every attend call as an AttentionRecord (analyses such as
        # attention mass against distance). Recording takes the plain path; None (the
        # default) leaves the call exactly as it is.
        self.attn_log: list[AttentionRecord] | None = None

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(*x.shape[:-1], self.n_head, self.d_head)

    def project_q(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre_lnorm:
            x = self.layer_norm(x)
        return self._heads(self.q_net(x))

    def project_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pre_lnorm:
            x = self.layer_norm(x)
        k, v = self.kv_net(x).chunk(2, dim=-1)
        return self._heads(k), self._heads(v)

    def project_r(self, r_emb: torch.Tensor) -> torch.Tensor:
        """R (already dropped out, [D, d_model]) -> W_{k,R} R as [D, H, dh]."""
        return self._heads(self.r_net(r_emb))

    def attend(self, q, k, v, r, u_bias, v_bias, allowed, need_lse=False, skew_start=0,
               layout: AttnLayout | None = None):
        """relative_attention with this layer's dropout and path. layout describes the rows
        and columns for a recording (default: keys are [memory ∘ queries' segment])."""
        if self.attn_log is not None:
            return self._attend_recorded(q, k, v, r, u_bias, v_bias, allowed, need_lse,
                                         skew_start, layout)
        return relative_attention(q, k, v, r, u_bias, v_bias, allowed,
                                  dropatt=self.dropatt if self.training else 0.0,
                                  impl=self.impl, need_lse=need_lse, skew_start=skew_start)

    def _attend_recorded(self, q, k, v, r, u_bias, v_bias, allowed, need_lse, skew_start,
                         layout):
        probs: list[torch.Tensor] = []
        out = relative_attention(q, k, v, r, u_bias, v_bias, allowed,
                                 dropatt=self.dropatt if self.training else 0.0, impl="plain",
                                 need_lse=need_lse, skew_start=skew_start, probs=probs)
        if layout is None:
            layout = AttnLayout.memory_then_segment(q.shape[1], k.shape[1])
        self.attn_log.append(AttentionRecord(probs[0], layout))
        return out

    def output(self, residual: torch.Tensor, attn_vec: torch.Tensor) -> torch.Tensor:
        """attn_vec [B, T, H, dh] (before W_o) -> LN(residual + Dropout(W_o attn_vec))."""
        out = self.drop(self.o_net(attn_vec.reshape(*attn_vec.shape[:2], -1)))
        if self.pre_lnorm:
            return residual + out
        return self.layer_norm(residual + out)

    def forward(self, h, mem, r_emb, u_bias, v_bias, allowed, layout=None):
        """Transformer-XL attention: queries from h, keys/values from [SG(mem) ∘ h]."""
        cat = h if mem is None or mem.shape[1] == 0 else torch.cat([mem, h], dim=1)
        q = self.project_q(h)
        k, v = self.project_kv(cat)
        vec, _ = self.attend(q, k, v, self.project_r(r_emb), u_bias, v_bias, allowed,
                             layout=layout)
        return self.output(h, vec)


class PositionwiseFF(nn.Module):
    """LN(x + Dropout(W2 Dropout(ReLU(W1 x + b1)) + b2)) with inner size d_inner (XL code)."""

    def __init__(self, d_model: int, d_inner: int, dropout: float, pre_lnorm: bool):
        super().__init__()
        self.core = nn.Sequential(
            nn.Linear(d_model, d_inner), nn.ReLU(inplace=True), nn.Dropout(dropout),
            nn.Linear(d_inner, d_model), nn.Dropout(dropout),
        )
        self.layer_norm = nn.LayerNorm(d_model)
        self.pre_lnorm = pre_lnorm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre_lnorm:
            return x + self.core(self.layer_norm(x))
        return self.layer_norm(x + self.core(x))


class DecoderLayer(nn.Module):
    """One relative-position decoder layer; mechanisms call its parts or its forward."""

    def __init__(self, cfg):
        super().__init__()
        self.attn = RelativeSelfAttention(cfg.d_model, cfg.n_head, cfg.d_head, cfg.dropout,
                                          cfg.dropatt, cfg.pre_lnorm, cfg.attn_impl)
        self.ff = PositionwiseFF(cfg.d_model, cfg.d_inner, cfg.dropout, cfg.pre_lnorm)

    def forward(self, h, mem, r_emb, u_bias, v_bias, allowed, layout=None):
        return self.ff(self.attn(h, mem, r_emb, u_bias, v_bias, allowed, layout))
