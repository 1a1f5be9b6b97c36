"""Attention kernels for the relative score A_ij = (q_i + u)^T k_j + (q_i + v)^T W_{k,R} R_{i-j}
(Transformer-XL §3.3), and the choice between them.

Three exact ways to compute softmax(A) V (model/attention.py holds the plain reference):

- "one_pass": `relative_softmax`, one autograd node from the two score matmuls to the
  probabilities and the log-normaliser. Forward: the content scores are written into one
  [B, H, Q, K] buffer, the skewed positional term added in place, masked, and torch's fused
  softmax applied (two fp32 [B, H, Q, K] tensors live at once instead of five); backward:
  torch's fused softmax backward and a direct inverse skew (no generic as_strided
  backward). Gives logsumexp_j A_ij with its gradient: what LaMemo needs (LaMemo §3.2, Eq. 11).
- "sdpa": torch's scaled_dot_product_attention with the positional term (and -inf for masked
  keys) as an additive float bias. On CUDA that bias rules out FlashAttention (no attn_mask at
  all) and leaves the memory-efficient kernel (float bias with gradient), pinned with the
  math path as fallback (`sdpa_backends`), which needs the
  head dimension to be a multiple of 8: `sdpa_head_pad` pads q, k, v with zero columns when
  it is not (exact: zero columns add nothing to q·k, the padded output columns are dropped,
  the scale stays 1/sqrt(d_head)). Without a fused kernel SDPA runs its math fallback.
- FlexAttention (`flex_relative_attention`): the positional term as a score_mod reading the
  un-skewed [B, H, Q, D] matrix, the mask as a block mask. Needs torch.compile and has no
  backward on the CPU; measured by benchmarks/bench_lamemo_cost.py --kernels, not chosen.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .positional import skew


def _skew_transpose(grad: torch.Tensor, n_d: int, start: int) -> torch.Tensor:
    """Adjoint of `skew`: [..., Q, K] gradients -> [..., Q, D] gradients of the distance matrix.

    skew reads entry (i, j) at flat offset (Q-1-start) + i*(D-1) + j of each [Q, D] matrix;
    entries read twice (the last key of row i and the first of row i+1 when D == K) get the
    sum of both gradients, exactly as autograd's as_strided backward would give them.
    """
    *batch, n_q, n_k = grad.shape
    out = grad.new_zeros(*batch, n_q, n_d)
    stride = (*out.stride()[:-2], n_d - 1, 1)
    offset = n_q - 1 - start
    if n_d >= n_k:
        # Columns 0..K-2 of the view never alias each other (row stride D-1 >= K-1): copy;
        # then the last column, which may alias the next row's first entry: accumulate.
        out.as_strided((*batch, n_q, n_k - 1), stride, offset).copy_(grad[..., :-1])
        out.as_strided((*batch, n_q), stride[:-1], offset + n_k - 1).add_(grad[..., -1])
        return out
    # Rows overlap by more than one entry: scatter-add every (i, j) to its flat offset.
    idx = (offset + torch.arange(n_q, device=grad.device)[:, None] * (n_d - 1)
           + torch.arange(n_k, device=grad.device)[None])
    flat = out.view(*batch, n_q * n_d)
    flat.index_add_(-1, idx.flatten(), grad.reshape(*batch, n_q * n_k))
    return out


class _RelativeSoftmax(torch.autograd.Function):
    """(p, lse) = (softmax, logsumexp)_j of S = qu k^T + skew(qv R), -inf where not allowed.

    qu = (q + u)/sqrt(dh), qv = (q + v)/sqrt(dh): [B, H, Q, dh]; k [B, H, K, dh];
    r_t [H, dh, D]; allowed bool, broadcastable to [B, H, Q, K]. The scores and the
    softmax are float32 (at least), the matmuls run in their inputs' dtype (autocast too).
    Backward: grad_S = p ⊙ (grad_p − Σ_j grad_p_j p_j + grad_lse) (see softmax_with_lse);
    masked entries have p = 0 so they get no gradient. with_lse False (XL) skips lse.
    """

    @staticmethod
    def forward(ctx, qu, k, qv, r_t, allowed, skew_start: int, with_lse: bool):
        n_k = k.shape[-2]
        bd = torch.matmul(qv, r_t)  # [B, H, Q, D]: (b) + (d) against the distance list
        scores = torch.matmul(qu, k.transpose(-1, -2))  # (a) + (c)
        mm_dtype = scores.dtype
        scores = scores.to(torch.promote_types(mm_dtype, torch.float32))
        scores.add_(skew(bd, n_k, skew_start))
        scores.masked_fill_(~allowed, float("-inf"))
        # torch's softmax kernel (one fused pass per row) is ~4x faster on the CPU than
        # max / subtract / exp / sum / divide as separate tensor ops. The log-normaliser
        # then follows from the largest probability: p_max = exp(max_j s_j − lse), so
        # lse = max_j s_j − log p_max, with p_max >= 1/K (no cancellation, no overflow).
        p = torch.softmax(scores, dim=-1)
        if with_lse:
            lse = scores.amax(dim=-1) - p.amax(dim=-1).log()
        else:
            lse = scores.new_empty(0)
            ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(qu, k, qv, r_t, p)
        ctx.geometry = (bd.shape[-1], skew_start, mm_dtype, with_lse)
        return p, lse

    @staticmethod
    def backward(ctx, grad_p, grad_lse):
        qu, k, qv, r_t, p = ctx.saved_tensors
        n_d, skew_start, mm_dtype, with_lse = ctx.geometry
        grad_lse = grad_lse if with_lse else None
        if grad_p is not None:
            # p ⊙ (grad_p − Σ_j grad_p_j p_j): torch's fused softmax backward.
            g = torch._softmax_backward_data(grad_p, p, -1, p.dtype)
            if grad_lse is not None:
                g.addcmul_(p, grad_lse[..., None])
        else:
            g = p * grad_lse[..., None]
        g = g.to(mm_dtype)
        need = ctx.needs_input_grad
        # Under autocast the forward matmuls ran in mm_dtype: their gradients do too (the
        # engine casts each gradient back to its input's dtype).
        grad_qu = torch.matmul(g, k.to(mm_dtype)) if need[0] else None
        grad_k = torch.matmul(g.transpose(-1, -2), qu.to(mm_dtype)) if need[1] else None
        grad_qv = grad_r = None
        if need[2] or need[3]:
            g_bd = _skew_transpose(g, n_d, skew_start)
            if need[2]:
                grad_qv = torch.matmul(g_bd, r_t.to(mm_dtype).transpose(-1, -2))
            if need[3]:
                grad_r = torch.matmul(qv.to(mm_dtype).transpose(-1, -2), g_bd)
                grad_r = grad_r.sum_to_size(r_t.shape)
        return grad_qu, grad_k, grad_qv, grad_r, None, None, None


def relative_softmax(qu, k, qv, r_t, allowed, skew_start: int = 0, with_lse: bool = True):
    """See _RelativeSoftmax: (probabilities [B, H, Q, K] fp32, logsumexp [B, H, Q] fp32;
    an empty tensor when with_lse is False)."""
    return _RelativeSoftmax.apply(qu, k, qv, r_t, allowed, skew_start, with_lse)


# ----------------------------------------------------------------------------- kernel choice
# The CUDA memory-efficient SDPA kernel reads the head dimension in aligned vectors; torch's
# check (check_head_dim_size_mem_efficient in aten/.../transformers/sdp_utils.cpp, not part
# of the CPU wheel, so not verifiable here) rejects a last dimension that is not a multiple
# of 8 and SDPA then falls back to its math path. FlashAttention accepts no attn_mask at
# all, and XL always needs the positional bias, so it never applies here.
SDPA_HEAD_MULTIPLE = 8


def sdpa_head_pad(d_head: int, device_type: str) -> int:
    """Zero columns to append to q, k, v so that the fused CUDA kernel accepts the head."""
    if device_type != "cuda":
        return 0  # the CPU kernels have no alignment rule (and the bias forces math anyway)
    return -d_head % SDPA_HEAD_MULTIPLE


def choose_kernel(impl: str, device_type: str, *, need_lse: bool, record: bool,
                  grad: bool = True) -> str:
    """Which exact path relative_attention takes: "plain", "one_pass" or "sdpa".

    - impl "plain" or a recording (attn_log wants the probabilities): the plain reference.
    - impl "one_pass" or "sdpa" (set on a layer's `attn.impl` by benchmarks): that kernel.
    - need_lse (LaMemo's branches): "one_pass", the only path whose log-normaliser has a
      gradient (SDPA kernels return none, or one without a backward).
    - CUDA: "sdpa" (memory-efficient kernel with the bias, head padded to a multiple of 8).
    - CPU with gradients: "one_pass". With a float bias SDPA can only take its math path
      here, whose backward keeps more [B, H, Q, K] tensors: one_pass takes less time per
      training call (benchmarks/bench_lamemo_cost.py --kernels).
    - CPU without gradients (evaluation): "sdpa", the faster forward there.
    Timings of both: BENCHMARKS.md, "LaMemo ÷ Transformer-XL time per token, and the
    attention kernels".
    """
    if impl == "plain" or record:
        return "plain"
    if impl in ("one_pass", "sdpa"):
        return impl  # forced (benchmarks, tests); "sdpa" has no log-normaliser
    if need_lse:
        return "one_pass"
    return "sdpa" if device_type == "cuda" or not grad else "one_pass"


def sdpa_backends(device_type: str) -> list | None:
    """The SDPA backends training may take on this device, in torch's order of preference.

    CUDA: the memory-efficient kernel (the only fused one with a float bias and its
    gradient), then the math path as the stated fallback for shapes or dtypes it rejects.
    Pinned rather than left to torch's choice, so that training runs what the GPU preflight
    checks (tests/test_gpu_preflight.py removes the fallback there, so that a shape the
    kernel rejects fails loudly instead of silently running math). CPU: torch's own choice
    (the bias rules out its fused kernels for gradients; evaluation is measured with it)."""
    if device_type != "cuda":
        return None
    from torch.nn.attention import SDPBackend
    return [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa_relative(qu, k, v, bias, *, dropatt: float, scale: float,
                  pad: int | None = None) -> torch.Tensor:
    """SDPA with an additive float bias, the head zero-padded for the fused CUDA kernel.

    qu = q + u (unscaled) [B, H, Q, dh], k, v [B, H, K, dh], bias [B|1, H|1, Q, K] (already
    scaled, -inf where masked). Padding is exact: q·k over the zero columns adds 0, the
    output's zero columns (softmax-weighted zeros) are dropped, `scale` is the unpadded one.
    pad: zero columns to add (default: `sdpa_head_pad` for the device; tests force it).
    """
    if pad is None:
        pad = sdpa_head_pad(qu.shape[-1], qu.device.type)
    if pad:
        qu, k, v = (F.pad(t, (0, pad)) for t in (qu, k, v))
    backends = sdpa_backends(qu.device.type)
    if backends is None:
        out = F.scaled_dot_product_attention(qu, k, v, attn_mask=bias, dropout_p=dropatt,
                                             scale=scale)
    else:
        from torch.nn.attention import sdpa_kernel
        with sdpa_kernel(backends):
            out = F.scaled_dot_product_attention(qu, k, v, attn_mask=bias, dropout_p=dropatt,
                                                 scale=scale)
    return out[..., :out.shape[-1] - pad] if pad else out


# ----------------------------------------------------------------------------- FlexAttention
def flex_relative_attention(qu, k, v, bd, allowed, *, scale: float, skew_start: int = 0,
                            compiled=None):
    """softmax(scale·qu k^T + skew(bd)) V via FlexAttention (benchmark and tests only).

    bd [B, H, Q, D] is the un-skewed positional matrix (already scaled); the score_mod reads
    entry (i, j) at the skew's flat offset (Q-1-start) + i(D-1) + j, which always lies inside
    the matrix (entries the mask removes read a neighbour, as in `skew`). allowed: bool
    [B|1, Q, K]. `compiled`: torch.compile(flex_attention) (flex needs compiling for speed
    and, on the CPU, to run at all with a captured gradient). Returns [B, H, Q, dh].
    """
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    n_b, n_h, n_q, n_d = bd.shape
    n_k = k.shape[-2]
    flat = bd.reshape(n_b, n_h, n_q * n_d)
    offset = n_q - 1 - skew_start
    mask = allowed.expand(n_b, n_q, n_k) if allowed.dim() == 3 else allowed

    def score_mod(score, b, h, qi, kj):
        return score + flat[b, h, offset + qi * (n_d - 1) + kj]

    def mask_mod(b, h, qi, kj):
        return mask[b, qi, kj]

    block_mask = create_block_mask(mask_mod, n_b, None, n_q, n_k, device=qu.device.type)
    fn = compiled if compiled is not None else flex_attention
    return fn(qu, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale)

