"""Relative attention equals the paper's A+B+C+D written out term by term (XL §3.3)."""

import pytest
import torch
from reference import rel_score, softmax_attend, tiny_model

from model.attention import softmax_with_lse
from model.backbone import Lengths, causal_allowed
from model.positional import distance_list, skew


def test_skew_picks_the_distance_of_every_query_key_pair():
    n_q, n_k, q_start, k_start = 3, 5, 2, 0
    dist = distance_list(q_start, n_q, k_start, n_k)
    # scores[i, t] = distance t encoded as a number, so the skew must return (i - j) pairs.
    scores = dist.float()[None].expand(n_q, -1).clone()
    out = skew(scores, n_k)
    for i in range(n_q):
        for j in range(n_k):
            assert out[i, j] == (q_start + i) - (k_start + j)


def test_skew_with_causal_distance_list_is_exact_on_and_below_the_diagonal():
    m, l = 4, 3
    dist = distance_list(m, l, 0, m + l, n_dist=m + l)
    out = skew(dist.float()[None].expand(l, -1).clone(), m + l)
    for i in range(l):
        for j in range(m + i + 1):
            assert out[i, j] == m + i - j


def test_skew_with_start_drops_leading_distances_and_keeps_the_rest_exact():
    """Look-ahead layout: queries 0..3, keys 1..4, only keys right of the query matter."""
    n_q, n_k, k_start = 4, 4, 1
    full = distance_list(0, n_q, k_start, n_k)
    start = int((full >= 0).sum())  # drop distances >= 0
    out = skew(full[start:].float()[None].expand(n_q, -1).clone(), n_k, start)
    for i in range(n_q):
        for j in range(n_k):
            if k_start + j > i:
                assert out[i, j] == i - (k_start + j)


@pytest.mark.parametrize("n_q,n_d,n_k,start", [(1, 1, 1, 0), (1, 5, 5, 0), (1, 7, 3, 0),
                                                (4, 1, 1, 3), (3, 3, 3, 0), (5, 9, 5, 0),
                                                (4, 6, 8, 2), (6, 12, 12, 3)])
def test_skew_reads_entry_i_j_at_column_j_plus_q_minus_1_minus_i_minus_start(n_q, n_d, n_k,
                                                                             start):
    """The definition, entry by entry, at the edges too: one query (a token-by-token
    evaluation), one distance, keys beyond the list. Where the column lies outside the
    list the entry is garbage by contract (the caller masks it) and is not checked."""
    scores = torch.randn(2, n_q, n_d)
    out = skew(scores, n_k, start)
    assert out.shape == (2, n_q, n_k)
    for i in range(n_q):
        for j in range(n_k):
            col = j + n_q - 1 - i - start
            if 0 <= col < n_d:
                assert torch.equal(out[:, i, j], scores[:, i, col])


def test_softmax_with_lse_gradients_match_finite_differences():
    scores = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda s: softmax_with_lse(s), (scores,))


def test_softmax_with_lse_equals_torch_softmax_and_logsumexp_with_masked_keys():
    scores = torch.randn(4, 6).masked_fill(torch.rand(4, 6) < 0.3, float("-inf"))
    scores[:, 0] = 0.5  # every row keeps a key
    a = scores.clone().requires_grad_(True)
    b = scores.clone().requires_grad_(True)
    p, lse = softmax_with_lse(a)
    p_ref, lse_ref = torch.softmax(b, -1), torch.logsumexp(b, -1)
    torch.testing.assert_close(p, p_ref)
    torch.testing.assert_close(lse, lse_ref)
    w1, w2 = torch.randn(4, 6), torch.randn(4)
    ((p * w1).sum() + (lse * w2).sum()).backward()
    ((p_ref * w1).sum() + (lse_ref * w2).sum()).backward()
    torch.testing.assert_close(a.grad, b.grad)


def naive_xl_attention(attn, h, mem, u, v, lengths: Lengths, d_model):
    """Per query i (at M+i) and key j: A_ij from the four terms, masked, softmax."""
    cat = torch.cat([mem, h], 1) if mem is not None else h
    m = 0 if mem is None else mem.shape[1]
    n_head, d_head = attn.n_head, attn.d_head
    q = attn.q_net(h).view(*h.shape[:2], n_head, d_head)
    k, val = attn.kv_net(cat).view(*cat.shape[:2], 2, n_head, d_head).unbind(2)
    out = torch.zeros_like(q)
    for b in range(h.shape[0]):
        for i in range(h.shape[1]):
            scores, values = [], []
            for j in range(cat.shape[1]):
                dist = m + i - j
                if dist < 0 or (lengths.same_length and dist >= lengths.mem_len):
                    continue
                delta = min(dist, lengths.clamp_len) if lengths.clamp_len > 0 else dist
                scores.append(rel_score(q[b, i], k[b, j], u, v, attn.r_net.weight, delta,
                                        d_model))
                values.append(val[b, j])
            out[b, i] = softmax_attend(scores, values)[0]
    return attn.layer_norm(h + attn.o_net(out.reshape(*h.shape[:2], -1)))


@pytest.mark.parametrize("impl", ["plain", "fused"])
@pytest.mark.parametrize("mem_now", [0, 5])
@pytest.mark.parametrize("clamp_len", [-1, 3])
@pytest.mark.parametrize("same_length", [False, True])
def test_relative_attention_equals_naive_abcd(impl, mem_now, clamp_len, same_length):
    model = tiny_model("xl", attn_impl=impl, mem_len=4)
    core, attn = model.core, model.core.layers[0].attn
    lengths = Lengths(mem_len=4, clamp_len=clamp_len, same_length=same_length)
    torch.manual_seed(1)
    h = torch.randn(2, 4, 16)
    mem = torch.randn(2, mem_now, 16) if mem_now else None
    dist = distance_list(mem_now, 4, 0, mem_now + 4, n_dist=mem_now + 4)
    allowed = causal_allowed(4, mem_now, torch.full((2,), mem_now), lengths, h.device)
    u, v = core.biases(0)
    with torch.no_grad():
        fast = attn(h, mem, core.r_emb(dist, lengths), u, v, allowed)
        slow = naive_xl_attention(attn, h, mem, u, v, lengths, 16)
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)


def test_same_length_gives_every_query_exactly_mem_len_keys_once_the_cache_is_full():
    lengths = Lengths(mem_len=6, same_length=True)
    allowed = causal_allowed(4, 6, torch.full((3,), 6), lengths, "cpu")
    assert allowed.shape == (3, 4, 10)
    assert (allowed.sum(-1) == 6).all()


@pytest.mark.parametrize("mechanism", ["xl", "lamemo", "rmt"])
def test_fused_and_plain_paths_give_the_same_losses(mechanism):
    x = torch.randint(0, 23, (3, 13))
    losses = {}
    for impl in ("fused", "plain"):
        model = tiny_model(mechanism, attn_impl=impl, mem_len=5 if mechanism != "rmt" else 3)
        state, nll = None, []
        with torch.no_grad():
            for s in range(3):
                out = model(x[:, 4 * s:4 * s + 4], state, targets=x[:, 4 * s + 1:4 * s + 5])
                state, nll = out.state, nll + [out.nll]
        losses[impl] = torch.stack(nll)
    torch.testing.assert_close(losses["fused"], losses["plain"], rtol=1e-5, atol=1e-5)
