"""fp16 (V100) numerics of the memory models, checked on the CPU.

1. A row reset must clear what the row cached, not only its valid length: masked keys still
   enter softmax(A) V with probability 0, and 0 * NaN = NaN, so a NaN/Inf left in the cache
   by an fp16 overflow would poison the row until it left the FIFO.
2. The attention scores (q+u)^T k and (q+v)^T W R must not be formed unscaled in fp16: they
   overflow 65504 long before the scaled scores (sqrt(d_head) times smaller) do.
"""

import math

import pytest
import torch
from reference import run_segments, sharpened_model

from model.attention import RelativeSelfAttention, relative_attention

VOCAB, SEG, MEM, BATCH = 50, 4, 6, 3
SETUPS = {"xl": ("xl", MEM), "lamemo": ("lamemo", MEM), "rmt": ("rmt", 0),
          "rmt+cache": ("rmt", MEM)}


def make_model(setup: str, impl: str):
    mechanism, mem_len = SETUPS[setup]
    model = sharpened_model(mechanism, mem_len, vocab=VOCAB, seg=SEG)
    for m in model.modules():
        if isinstance(m, RelativeSelfAttention):
            m.impl = impl
    return model


def run(model, tokens, targets, state=None):
    return run_segments(model, tokens, targets, SEG, state)


def poison_row(state, row: int):
    """Every float entry of one row NaN, as an fp16 overflow in the forward leaves it."""
    def fill(_, t):
        if not t.is_floating_point() or t.dim() == 0 or t.shape[0] != BATCH:
            return t
        t = t.clone()
        t[row] = float("nan")
        return t
    return state._map(fill)


# ----------------------------------------------------------------------------- row reset
@pytest.mark.parametrize("impl", ["fused", "plain"])
@pytest.mark.parametrize("setup", SETUPS)
def test_a_reset_row_with_nan_in_its_cache_runs_like_a_fresh_row(setup, impl):
    model = make_model(setup, impl)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (BATCH, 4 * SEG), generator=g)
    targets = torch.randint(0, VOCAB, (BATCH, 4 * SEG), generator=g)
    r = 1
    mask = torch.tensor([False, True, False])
    with torch.no_grad():
        _, state = run(model, tokens[:, :2 * SEG], targets[:, :2 * SEG])
        rest, rest_t = tokens[:, 2 * SEG:], targets[:, 2 * SEG:]
        clean, _ = run(model, rest, rest_t, state.reset_rows(mask))
        got, after = run(model, rest, rest_t, poison_row(state, r).reset_rows(mask))
        fresh, _ = run(model, rest[r:r + 1], rest_t[r:r + 1], None)
    for seg in range(2):   # the reset segment, and the next one (through the new memory)
        assert torch.isfinite(got[seg]).all(), f"segment {seg}: {got[seg]}"
        torch.testing.assert_close(got[seg][r:r + 1], fresh[seg], atol=1e-5, rtol=1e-5)
        # Other rows: exactly as without the poison.
        assert torch.equal(got[seg][~mask], clean[seg][~mask])
    assert all(torch.isfinite(t).all() for t in _floats(after) if t.numel())


def _floats(state):
    out = []
    state._map(lambda _, t: out.append(t) or t)
    return [t for t in out if t.is_floating_point() and not t.isneginf().any()]


def test_reset_zeroes_the_cached_tensors_of_that_row_only():
    model = make_model("xl", "fused")
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, 2 * SEG), generator=g)
    with torch.no_grad():
        _, state = run(model, tokens, tokens)
    reset = state.reset_rows(torch.tensor([False, True, False]))
    for old, new in zip(state.hids, reset.hids, strict=True):
        assert (new[1] == 0).all() and torch.equal(new[[0, 2]], old[[0, 2]])
    assert reset.length.tolist() == [MEM, 0, MEM]


# ----------------------------------------------------------------------------- scores
def _attention_inputs(magnitude: float, dh: int = 64, seed: int = 0):
    """Queries, keys and W R whose unscaled products reach ~dh * magnitude^2 (over 65504 for
    magnitude 40, dh 64), while the scaled ones stay ~8x smaller (finite in fp16)."""
    g = torch.Generator().manual_seed(seed)
    B, Q, M, H = 2, 5, 3, 2
    K = Q + M
    q = magnitude + torch.randn(B, Q, H, dh, generator=g)
    k = magnitude + torch.randn(B, K, H, dh, generator=g)
    v = torch.randn(B, K, H, dh, generator=g)
    r = magnitude + torch.randn(K, H, dh, generator=g)
    u, vb = torch.randn(H, dh, generator=g), torch.randn(H, dh, generator=g)
    dist = (M + torch.arange(Q))[:, None] - torch.arange(K)
    allowed = (dist >= 0)[None]
    return (q, k, v, r, u, vb), allowed


@pytest.mark.parametrize("impl,need_lse", [("plain", False), ("plain", True),
                                           ("fused", False)])
def test_fp16_scores_do_not_overflow_where_the_scaled_scores_fit(impl, need_lse):
    tensors, allowed = _attention_inputs(40.0)
    tensors = [t.half() for t in tensors]
    q, k, v, r, u, vb = (t.float() for t in tensors)  # the same inputs, for float32
    unscaled = torch.einsum("bqhd,bkhd->bhqk", q + u, k).abs().max().item()
    assert unscaled > 65504 > unscaled / math.sqrt(64) * 2   # the regime of the bug
    out, lse = relative_attention(*tensors, allowed, impl=impl, need_lse=need_lse)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    # Scores this large are one-hot in any precision, and fp16 rounds them in steps of 8:
    # which key wins may differ from float32, so the output is checked to be an average of
    # the value rows, and the log-normaliser (smooth in the scores) against float32.
    lo, hi = v.amin(dim=1, keepdim=True), v.amax(dim=1, keepdim=True)
    assert ((out.float() >= lo - 1e-2) & (out.float() <= hi + 1e-2)).all()
    if need_lse:
        _, ref_lse = relative_attention(q, k, v, r, u, vb, allowed, impl="plain",
                                        need_lse=True)
        assert lse.dtype == torch.float32 and torch.isfinite(lse).all()
        torch.testing.assert_close(lse, ref_lse, rtol=2e-3, atol=0.0)


def test_fp16_sum_of_the_two_scaled_terms_is_formed_in_float32():
    # Each scaled term fits fp16 (~41k) but their sum (~82k) does not.
    tensors, allowed = _attention_inputs(80.0)
    out, lse = relative_attention(*(t.half() for t in tensors), allowed, impl="plain",
                                  need_lse=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


def test_prescaled_scores_match_the_reference_in_float64():
    # Scaling q before the matmul is the same number: float64 agrees to rounding.
    tensors, allowed = _attention_inputs(1.0, dh=16)
    t64 = [t.double() for t in tensors]
    plain, lse = relative_attention(*t64, allowed, impl="plain", need_lse=True)
    fused, _ = relative_attention(*t64, allowed, impl="fused")
    q, k, v, r, u, vb = t64
    # Direct evaluation of A^rel (XL §3.3): r row t is distance (K - 1) - t.
    K = k.shape[1]
    M = K - q.shape[1]
    ac = torch.einsum("bqhd,bkhd->bhqk", q + u, k)
    i = torch.arange(q.shape[1])[:, None] + M
    j = torch.arange(K)[None]
    rr = r[(K - 1 - (i - j)).clamp(0, K - 1)]            # [Q, K, H, dh]
    bd = torch.einsum("bqhd,qkhd->bhqk", q + vb, rr)
    scores = ((ac + bd) / math.sqrt(16)).masked_fill(~allowed[:, None], float("-inf"))
    want = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
    torch.testing.assert_close(plain, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fused, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse.double(), torch.logsumexp(scores, -1).transpose(1, 2),
                               rtol=1e-6, atol=1e-6)
