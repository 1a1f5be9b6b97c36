"""fp16 (V100) numerics of the memory models, checked on the CPU.

1. A row reset must clear what the row cached, not only its valid length: masked keys still
   enter softmax(A) V with probability 0, and 0 * NaN = NaN, so a NaN/Inf left in the cache
   by an fp16 overflow would poison the row until it left the FIFO.
2. The attention scores (q+u)^T k and (q+v)^T W R must not be formed unscaled in fp16: they
   overflow 65504 long before the scaled scores (sqrt(d_head) times smaller) do.
"""

import pytest
import torch
from reference import sharpened_model

from model.attention import RelativeSelfAttention

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
    nlls = []
    for s in range(0, tokens.shape[1], SEG):
        out = model(tokens[:, s:s + SEG], state, targets=targets[:, s:s + SEG])
        nlls.append(out.nll)
        state = out.state
    return nlls, state


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
