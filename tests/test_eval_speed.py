"""Vanilla sliding-window evaluation vs cached evaluation (Transformer-XL §3.1, §3.2, Table 9):
same per-token losses exactly where their contexts coincide, different where they cannot be.

The models are tiny_model's (tests/reference.py): dropout 0, eval mode, parameters sharpened
so that a different context moves the loss visibly (differences below are ~0.1-1 nats, the
equalities hold to ~1e-6).
"""

import pytest
import torch
from reference import tiny_model

from evaluation.speed import cached_nll, compare_speed, vanilla_sliding_nll

TOL = dict(rtol=1e-5, atol=1e-5)
SEG, N = 4, 25  # 24 scored tokens = 6 segments of 4


def tokens(seed: int = 0, n: int = N) -> torch.Tensor:
    return torch.randint(0, 23, (2, n), generator=torch.Generator().manual_seed(seed))


def differs(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a - b).abs() > 1e-3).all())


def test_vanilla_scores_each_token_with_one_plain_forward_of_its_window():
    """The naive reference: token t is the last prediction of model(window) from an empty
    memory, window = the `context` tokens before t (fewer near the start)."""
    model = tiny_model("xl", n_layer=2, mem_len=6)
    x = tokens()
    context = 7
    nll = vanilla_sliding_nll(model, x, context, windows_per_forward=3)
    assert nll.shape == (2, N - 1)
    with torch.no_grad():
        for t in (3, 7, 15, N - 1):  # a short prefix, the first full window, later ones
            lo = max(0, t - context)
            out = model(x[:, lo:t], None, targets=x[:, lo + 1:t + 1])
            torch.testing.assert_close(nll[:, t - 1], out.nll[:, -1], **TOL)


def test_vanilla_result_does_not_depend_on_how_windows_are_batched():
    model = tiny_model("xl", n_layer=2)
    x = tokens(1)
    ref = vanilla_sliding_nll(model, x, 5, windows_per_forward=1)
    torch.testing.assert_close(vanilla_sliding_nll(model, x, 5, windows_per_forward=7), ref,
                               **TOL)
    torch.testing.assert_close(vanilla_sliding_nll(model, x, 5, first=9), ref[:, 8:], **TOL)


@pytest.mark.parametrize("n_layer", [1, 3])
def test_xl_cached_equals_full_prefix_recomputation_until_the_memory_evicts(n_layer):
    """Segment s starts at s*SEG. While s*SEG <= mem_len nothing has left the memory and
    every cached state of every layer is the full-prefix state (induction over segments), so
    the loss equals vanilla's with a context covering the whole prefix. From the first
    segment whose memory has lost a token on, the cached query no longer sees the whole
    prefix that vanilla sees, so at any depth the losses differ there."""
    mem_len = 12
    model = tiny_model("xl", n_layer=n_layer)
    x = tokens(2)
    full = vanilla_sliding_nll(model, x, context=N)
    cached = cached_nll(model, x, SEG, mem_len)
    kept = (mem_len // SEG + 1) * SEG  # targets of segments 0 .. mem_len/SEG
    torch.testing.assert_close(cached[:, :kept], full[:, :kept], **TOL)
    assert differs(cached[:, kept:], full[:, kept:])


def test_one_layer_xl_equals_the_sliding_window_that_sees_the_same_keys():
    """One layer reads only cached embeddings, which carry no context: a cached query sees
    [last mem_len tokens | segment up to itself], exactly a vanilla window. With same_length
    that is mem_len keys at every position; without it, the last query of a segment sees
    mem_len + SEG keys."""
    mem_len = 6
    model = tiny_model("xl", n_layer=1)
    x = tokens(3)
    torch.testing.assert_close(cached_nll(model, x, SEG, mem_len, same_length=True),
                               vanilla_sliding_nll(model, x, mem_len), **TOL)
    last = slice(SEG - 1, None, SEG)
    torch.testing.assert_close(cached_nll(model, x, SEG, mem_len)[:, last],
                               vanilla_sliding_nll(model, x, mem_len + SEG)[:, last], **TOL)


def test_multi_layer_xl_after_eviction_differs_from_every_window_of_the_same_keys():
    """With 2+ layers the memory's upper-layer states were computed with older context than
    any window the query sees, so the same comparison as for 1 layer must fail: the
    recurrence reaches further back than the keys (XL §3.2, O(n_layer x L) dependency)."""
    mem_len = 6
    model = tiny_model("xl", n_layer=2)
    x = tokens(3)
    later = slice(2 * SEG, None)  # segment 2 on: the memory has evicted tokens
    assert differs(cached_nll(model, x, SEG, mem_len, same_length=True)[:, later],
                   vanilla_sliding_nll(model, x, mem_len)[:, later])


def test_lamemo_first_segment_and_one_layer_equal_vanilla_but_refreshed_memory_does_not():
    """LaMemo's current rows attend causally exactly as XL's; its memory rows are refreshed
    with look-ahead attention (Eq. 7-11: they see tokens to their right), which no causal
    recomputation produces. So equality holds (i) in the first segment, where there is no
    memory, (ii) for one layer, whose memory is the FIFO of embeddings (the refreshed top
    layer is only stored, never read), wherever the windows coincide; and it fails for two
    layers from the second segment on, even before anything is evicted."""
    mem_len = 12
    x = tokens(4)
    deep = tiny_model("lamemo", n_layer=2, mem_len=mem_len)
    full, cached = vanilla_sliding_nll(deep, x, N), cached_nll(deep, x, SEG, mem_len)
    torch.testing.assert_close(cached[:, :SEG], full[:, :SEG], **TOL)
    assert differs(cached[:, SEG:mem_len], full[:, SEG:mem_len])

    one = tiny_model("lamemo", n_layer=1, mem_len=6)
    torch.testing.assert_close(cached_nll(one, x, SEG, 6, same_length=True),
                               vanilla_sliding_nll(one, x, 6), **TOL)


def test_cached_evaluation_restores_the_models_lengths_and_mode():
    model = tiny_model("xl", n_layer=1).train()
    before = model.lengths
    cached_nll(model, tokens(), SEG, 10, same_length=True)
    vanilla_sliding_nll(model, tokens(), 5)
    assert model.lengths == before and model.training


def test_speed_comparison_reports_both_methods_at_one_attention_length():
    """Plumbing only (no timing is asserted): lengths add up, every figure is positive."""
    model = tiny_model("xl", n_layer=1)
    res = compare_speed(model, 16, batch=1, tgt_len=4, vanilla_tokens=2, cached_tokens=8,
                        rounds=2)
    assert (res.mem_len, res.tgt_len) == (12, 4)
    assert min(res.vanilla_tokens_per_s, res.cached_tokens_per_s,
               res.same_length_tokens_per_s, res.speedup) > 0
    assert len(res.rounds) == 2
