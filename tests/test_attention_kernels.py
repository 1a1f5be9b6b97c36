"""The attention kernels (model/attention_kernels.py) are exact: each equals the plain
reference path of relative_attention (itself checked term by term against XL §3.3 in
test_attention.py), forward and backward; the kernel choice is the documented one."""

import math
import os
import shutil

import pytest
import torch
from reference import tiny_model

from model.attention import relative_attention
from model.attention_kernels import (
    _skew_transpose,
    choose_kernel,
    relative_softmax,
    sdpa_head_pad,
    sdpa_relative,
)
from model.backbone import Lengths, causal_allowed
from model.positional import distance_list, skew


def _inputs(n_q, n_k, n_dist, d_head, batch=2, n_head=3, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype).requires_grad_(True)

    return (rand(batch, n_q, n_head, d_head), rand(batch, n_k, n_head, d_head),
            rand(batch, n_k, n_head, d_head), rand(n_dist, n_head, d_head),
            rand(n_head, d_head), rand(n_head, d_head))


def _causal_case(mem, seg, d_head, same_length=False, short_row=True):
    """XL / LaMemo causal branch: keys [memory ∘ segment], one batch row with a short memory
    (a document reset), distance list of n_k entries (the garbage above the diagonal is
    masked)."""
    lengths = Lengths(mem_len=mem or seg, same_length=same_length)
    length = torch.tensor([mem, mem // 2 if short_row else mem])
    allowed = causal_allowed(seg, mem, length if mem else None, lengths, "cpu")
    return _inputs(seg, mem + seg, mem + seg, d_head), allowed, 0


def _lookahead_case(mem, seg, d_head):
    """LaMemo look-ahead branch (Eq. 7-9): memory rows attend to the keys right of them in
    the window [max(1, M-N+1), M]; the distance list skips the non-negative distances."""
    win_start = max(1, mem - seg + 1)
    n_win = mem + 1 - win_start
    allowed = (win_start + torch.arange(n_win)[None] > torch.arange(mem)[:, None])[None]
    skew_start = mem - win_start
    n_dist = len(distance_list(0, mem, win_start, n_win)) - skew_start
    return _inputs(mem, n_win, n_dist, d_head), allowed, skew_start


def _run(tensors, allowed, skew_start, impl, need_lse, grad_seed=1):
    """Outputs (and lse) of relative_attention, and the gradients of a random projection of
    them with respect to every input."""
    out, lse = relative_attention(*tensors, allowed, impl=impl, need_lse=need_lse,
                                  skew_start=skew_start)
    gen = torch.Generator().manual_seed(grad_seed)
    loss = (out * torch.randn(out.shape, generator=gen, dtype=out.dtype)).sum()
    if need_lse:
        loss = loss + (lse * torch.randn(lse.shape, generator=gen, dtype=lse.dtype)).sum()
    grads = torch.autograd.grad(loss, tensors)
    return out, lse, grads


def _assert_same(fast, ref):
    out, lse, grads = fast
    out_ref, lse_ref, grads_ref = ref
    torch.testing.assert_close(out, out_ref)
    if lse_ref is not None:
        torch.testing.assert_close(lse.double(), lse_ref.double())
    for name, g, g_ref in zip(("q", "k", "v", "r", "u", "v_bias"), grads, grads_ref,
                              strict=True):
        torch.testing.assert_close(g, g_ref, msg=lambda m, n=name: f"grad of {n}: {m}")


@pytest.mark.parametrize("d_head", [41, 8])
@pytest.mark.parametrize("mem", [0, 5])
@pytest.mark.parametrize("need_lse", [False, True])
@pytest.mark.parametrize("same_length", [False, True])
def test_one_pass_kernel_equals_plain_path_on_the_causal_branch(d_head, mem, need_lse,
                                                                 same_length):
    tensors, allowed, start = _causal_case(mem, 4, d_head, same_length)
    assert choose_kernel("fused", "cpu", need_lse=need_lse, record=False) == "one_pass"
    _assert_same(_run(tensors, allowed, start, "fused", need_lse),
                 _run(tensors, allowed, start, "plain", need_lse))


@pytest.mark.parametrize("mem,seg", [(6, 4), (4, 6), (5, 5)])
def test_one_pass_kernel_equals_plain_path_on_the_lookahead_window(mem, seg):
    tensors, allowed, start = _lookahead_case(mem, seg, 41)
    _assert_same(_run(tensors, allowed, start, "fused", True),
                 _run(tensors, allowed, start, "plain", True))


def test_one_pass_kernel_passes_gradcheck_for_probabilities_and_log_normaliser():
    lengths = Lengths(mem_len=3)
    allowed = causal_allowed(3, 3, torch.tensor([3]), lengths, "cpu")
    q, k, _, r, u, v = (t.detach() for t in _inputs(3, 6, 6, 4, batch=1, n_head=2,
                                                    dtype=torch.float64))
    scale = 1 / math.sqrt(4)
    qu = ((q + u) * scale).transpose(1, 2).requires_grad_(True)
    qv = ((q + v) * scale).transpose(1, 2).requires_grad_(True)
    kh = k.transpose(1, 2).requires_grad_(True)
    r_t = r.permute(1, 2, 0).requires_grad_(True)
    mask = allowed[:, None]
    assert torch.autograd.gradcheck(lambda *a: relative_softmax(*a, mask, 0),
                                     (qu, kh, qv, r_t))


@pytest.mark.parametrize("n_q,n_d,n_k,start", [(4, 7, 7, 0), (4, 8, 7, 0), (5, 4, 5, 2),
                                               (3, 5, 6, 1)])
def test_skew_transpose_is_the_adjoint_of_skew(n_q, n_d, n_k, start):
    """<skew(x), g> == <x, skew^T(g)> for every x, g: including D == K (rows share an
    entry, whose gradient must be the sum of both reads) and D < K (rows overlap more)."""
    x = torch.randn(2, n_q, n_d, dtype=torch.float64)
    g = torch.randn(2, n_q, n_k, dtype=torch.float64)
    lhs = (skew(x, n_k, start) * g).sum()
    rhs = (x * _skew_transpose(g, n_d, start)).sum()
    torch.testing.assert_close(lhs, rhs)
    xg = x.clone().requires_grad_(True)
    (auto,) = torch.autograd.grad((skew(xg, n_k, start) * g).sum(), xg)
    torch.testing.assert_close(_skew_transpose(g, n_d, start), auto)


@pytest.mark.parametrize("pad", [7, 0])
def test_sdpa_with_zero_padded_head_equals_plain_path(pad):
    """d_head 41 (the WikiText-103 configs) padded to 48 for the fused CUDA kernel: the
    same outputs and gradients as the unpadded plain path (here SDPA's CPU kernel)."""
    tensors, allowed, start = _causal_case(5, 4, 41)
    ref = _run(tensors, allowed, start, "plain", False)
    q, k, v, r, u, vb = tensors
    scale = 1 / math.sqrt(41)
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    bd = skew(torch.matmul((qh + vb[:, None]) * scale, r.permute(1, 2, 0)), k.shape[1])
    bias = bd.masked_fill(~allowed[:, None], float("-inf"))
    out = sdpa_relative(qh + u[:, None], kh, vh, bias, dropatt=0.0, scale=scale, pad=pad)
    out = out.transpose(1, 2)
    assert out.shape == q.shape
    gen = torch.Generator().manual_seed(1)
    loss = (out * torch.randn(out.shape, generator=gen, dtype=out.dtype)).sum()
    _assert_same((out, None, torch.autograd.grad(loss, tensors)), ref)


def test_training_sdpa_on_cuda_is_pinned_to_the_memory_efficient_kernel_then_math(
        monkeypatch):
    """What the GPU preflight checks is what training runs: on CUDA, SDPA may take the
    memory-efficient kernel or the math fallback, never another fused kernel of torch's
    choosing. The CPU cannot run CUDA kernels, so the CUDA pin is applied to a CPU call and
    the backend flags SDPA sees are read inside it."""
    from torch.nn.attention import SDPBackend

    from model import attention_kernels
    assert attention_kernels.sdpa_backends("cuda") == [SDPBackend.EFFICIENT_ATTENTION,
                                                        SDPBackend.MATH]
    assert attention_kernels.sdpa_backends("cpu") is None
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        b = torch.backends.cuda
        seen.append((b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(),
                     b.math_sdp_enabled(), b.cudnn_sdp_enabled()))
        return real(*args, **kwargs)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(attention_kernels, "sdpa_backends",
                        lambda device_type, pin=attention_kernels.sdpa_backends: pin("cuda"))
    q = torch.randn(1, 2, 3, 8)
    sdpa_relative(q, q, q, torch.zeros(1, 1, 3, 3), dropatt=0.0, scale=0.3, pad=0)
    assert seen == [(False, True, True, False)]   # flash, memory-efficient, math, cuDNN


def test_head_padding_is_asked_only_on_cuda_and_only_up_to_a_multiple_of_eight():
    assert [sdpa_head_pad(d, "cuda") for d in (41, 64, 48, 1, 8)] == [7, 0, 0, 7, 0]
    assert sdpa_head_pad(41, "cpu") == 0


def test_kernel_choice_follows_device_lse_and_recording():
    assert choose_kernel("plain", "cuda", need_lse=False, record=False) == "plain"
    assert choose_kernel("fused", "cuda", need_lse=False, record=True) == "plain"
    # LaMemo's branches need a differentiable log-normaliser: never SDPA.
    assert choose_kernel("fused", "cuda", need_lse=True, record=False) == "one_pass"
    assert choose_kernel("fused", "cuda", need_lse=False, record=False) == "sdpa"
    assert choose_kernel("fused", "cpu", need_lse=False, record=False) == "one_pass"
    # Evaluation on the CPU: SDPA's forward (math path) is the faster one there.
    assert choose_kernel("fused", "cpu", need_lse=False, record=False, grad=False) == "sdpa"
    assert choose_kernel("fused", "cpu", need_lse=True, record=False, grad=False) == "one_pass"
    # Forced kernels (benchmarks): honoured, except that a recording always takes plain.
    assert choose_kernel("sdpa", "cpu", need_lse=False, record=False) == "sdpa"
    assert choose_kernel("one_pass", "cuda", need_lse=False, record=False) == "one_pass"
    assert choose_kernel("one_pass", "cpu", need_lse=True, record=True) == "plain"


def test_sdpa_kernel_refuses_to_serve_a_log_normaliser_request():
    tensors, allowed, start = _causal_case(5, 4, 8)
    with pytest.raises(ValueError, match="log-normaliser"):
        relative_attention(*tensors, allowed, impl="sdpa", need_lse=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_pass_kernel_under_autocast_equals_plain_path(dtype):
    tensors, allowed, start = _causal_case(5, 4, 8)
    tensors = tuple(t.detach().float().requires_grad_(True) for t in tensors)
    with torch.autocast("cpu", dtype=dtype):
        fast = _run(tensors, allowed, start, "fused", True)
        ref = _run(tensors, allowed, start, "plain", True)
    assert fast[0].dtype == ref[0].dtype == dtype
    _assert_same(fast, ref)


def test_lamemo_training_losses_state_and_gradients_equal_the_plain_reference():
    """LaMemo through the one-pass kernel (attn_impl "fused") against the plain path: the
    same per-token losses, memory state (contexts and log-normalisers) and parameter
    gradients over segments that fill, refresh and roll the memory."""
    x = torch.randint(0, 23, (2, 17), generator=torch.Generator().manual_seed(0))
    runs = {}
    for impl in ("fused", "plain"):
        model = tiny_model("lamemo", attn_impl=impl, mem_len=6, n_layer=3).train()
        state, nll = None, []
        for s in range(4):
            out = model(x[:, 4 * s:4 * s + 4], state, targets=x[:, 4 * s + 1:4 * s + 5])
            out.loss.backward()
            state, nll = out.state.detach(), nll + [out.nll.detach()]
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        runs[impl] = torch.stack(nll), state, grads
    (nll_f, st_f, g_f), (nll_p, st_p, g_p) = runs["fused"], runs["plain"]
    torch.testing.assert_close(nll_f, nll_p, rtol=1e-5, atol=1e-5)
    for a, b in zip([*st_f.context, *st_f.log_norm], [*st_p.context, *st_p.log_norm],
                    strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert g_f.keys() == g_p.keys() and "core.rel_v_future.value" in g_f
    for name in g_p:
        torch.testing.assert_close(g_f[name], g_p[name], rtol=1e-4, atol=1e-5,
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None,
                    reason="torch.compile's CPU backend needs a C++ compiler")
def test_flex_attention_forward_with_positional_score_mod_equals_plain_path():
    """FlexAttention (forward only: it has no backward on the CPU) with the positional term
    as a score_mod over the un-skewed matrix and the causal + document-reset block mask.
    d_head 41, memory, one short row. Compiles once (~30 s on a cold inductor cache)."""
    from torch.nn.attention.flex_attention import flex_attention

    from model.attention_kernels import flex_relative_attention

    tensors, allowed, _ = _causal_case(8, 8, 41)
    q, k, v, r, u, vb = (t.detach() for t in tensors)
    scale = 1 / math.sqrt(41)
    with torch.no_grad():
        ref, _ = relative_attention(q, k, v, r, u, vb, allowed, impl="plain")
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
        bd = torch.matmul((qh + vb[:, None]) * scale, r.permute(1, 2, 0))
        out = flex_relative_attention(qh + u[:, None], kh, vh, bd, allowed, scale=scale,
                                      compiled=torch.compile(flex_attention))
    torch.testing.assert_close(out.transpose(1, 2), ref)
