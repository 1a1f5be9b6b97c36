"""Recurrent Memory Transformer (Bulatov et al. 2022): mask, recurrence, BPTT depth, loss."""

import pytest
import torch
from reference import tiny_model

from model.mechanisms.rmt.core import rmt_allowed

# RMT §3 as a table, for m = 2 memory tokens, L = 3 tokens, an XL cache of 2.
# Rows: read r0 r1 | tokens t0 t1 t2 | write w0 w1. Columns: cache c0 c1 | same as rows.
# 1 = may attend. Memory blocks see each other in full; tokens are causal among themselves;
# nothing but the write block sees the write block.
PAPER_TABLE = {
    False: [  # read_mem_from_cache = False (LM default)
        # c0 c1 r0 r1 t0 t1 t2 w0 w1
        [0, 0, 1, 1, 0, 0, 0, 0, 0],  # r0
        [0, 0, 1, 1, 0, 0, 0, 0, 0],  # r1
        [1, 1, 1, 1, 1, 0, 0, 0, 0],  # t0
        [1, 1, 1, 1, 1, 1, 0, 0, 0],  # t1
        [1, 1, 1, 1, 1, 1, 1, 0, 0],  # t2
        [0, 0, 1, 1, 1, 1, 1, 1, 1],  # w0
        [0, 0, 1, 1, 1, 1, 1, 1, 1],  # w1
    ],
    True: [
        [1, 1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 1, 1, 1, 1],
        [1, 1, 1, 1, 1, 1, 1, 1, 1],
    ],
}


@pytest.mark.parametrize("read_mem_from_cache", [False, True])
def test_attention_mask_equals_the_papers_table(read_mem_from_cache):
    got = rmt_allowed(2, 3, 2, None, read_mem_from_cache, "cpu")[0].int()
    assert got.tolist() == PAPER_TABLE[read_mem_from_cache]


def test_invalid_cache_entries_of_a_reset_row_are_masked():
    got = rmt_allowed(2, 3, 2, torch.tensor([2, 1, 0]), False, "cpu").int()
    assert got[0, 2:5, :2].tolist() == [[1, 1]] * 3
    assert got[1, 2:5, :2].tolist() == [[0, 1]] * 3
    assert got[2, 2:5, :2].tolist() == [[0, 0]] * 3


@pytest.mark.parametrize("mem_len", [0, 5])
def test_read_and_write_memory_of_next_segment_equal_this_segments_write_output(mem_len):
    model = tiny_model("rmt", mem_len=mem_len)
    m = model.cfg.rmt.num_mem_tokens
    seen = []
    model.core.layers[0].register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
    x = torch.randint(0, 23, (2, 12))
    state = None
    with torch.no_grad():
        for s in range(3):
            prev = state
            state = model(x[:, 4 * s:4 * s + 4], state).state
            layer0_input = seen[-1]
            if prev is None:  # first segment: the learned initial memory, both blocks
                init = model.core.init_memory.expand(2, -1, -1)
                torch.testing.assert_close(layer0_input[:, :m], init)
            else:
                torch.testing.assert_close(layer0_input[:, :m], prev.tokens)
                torch.testing.assert_close(layer0_input[:, -m:], prev.tokens)


@pytest.mark.parametrize("pre_lnorm", [False, True])
def test_the_memory_holds_its_m_rows_only_not_the_whole_segment_output(pre_lnorm):
    """The next memory is the write block [B, m, d] in a storage of its own: a view would
    keep the segment's [B, 2m+L, d] output alive, in a checkpointed BPTT window once per
    segment."""
    model = tiny_model("rmt", mem_len=0, pre_lnorm=pre_lnorm)
    m, d = model.cfg.rmt.num_mem_tokens, model.cfg.d_model
    x = torch.randint(0, 23, (1, 5))   # one row: the write block of a view is contiguous too
    tokens = model(x[:, :-1], None, targets=x[:, 1:]).state.tokens
    assert tokens.shape == (1, m, d)
    assert tokens.untyped_storage().nbytes() == m * d * tokens.element_size()


@pytest.mark.parametrize("k", [0, 1, 2])
def test_bptt_depth_k_reaches_memory_k_segments_back_and_not_k_plus_1(k):
    """The model never detaches the memory; the caller's detach sets the depth. With the
    memory detached before segment T-1-k, the last loss has a gradient w.r.t. the memory
    entering segment T-1-k and exactly none w.r.t. the one entering T-2-k."""
    model = tiny_model("rmt").train()
    n_seg = 5
    x = torch.randint(0, 23, (2, 4 * n_seg + 1))
    state, entering = None, []
    for s in range(n_seg):
        if state is not None:
            if s == n_seg - 1 - k:
                state = state.detach()
            if not state.tokens.requires_grad:  # a detached leaf: make it a probe
                state.tokens.requires_grad_(True)
            state.tokens.retain_grad()
            entering.append(state.tokens)
        else:
            entering.append(None)
        out = model(x[:, 4 * s:4 * s + 4], state, targets=x[:, 4 * s + 1:4 * s + 5])
        state = out.state
    out.loss.backward()
    reached = entering[n_seg - 1 - k]
    assert reached.grad is not None and reached.grad.abs().sum() > 0
    beyond = entering[n_seg - 2 - k]
    assert beyond.grad is None or (beyond.grad == 0).all()


def test_loss_covers_only_masked_in_token_positions():
    model = tiny_model("rmt")
    x = torch.randint(0, 23, (2, 4))
    y = torch.randint(0, 23, (2, 4))
    mask = torch.tensor([[False, False, True, True], [False, True, True, True]])
    with torch.no_grad():
        out = model(x, targets=y, loss_mask=mask)
        assert out.nll.shape == (2, 4)  # token rows only, no memory rows
        assert (out.nll[~mask] == 0).all() and (out.nll[mask] > 0).all()
        assert out.n_tokens == mask.sum()
        y2 = y.clone()
        y2[~mask] = (y[~mask] + 1) % 23  # change only the source part's targets
        torch.testing.assert_close(model(x, targets=y2, loss_mask=mask).loss, out.loss)


def test_auxiliary_memory_loss_is_weighted_and_kept_apart_from_the_lm_loss():
    model = tiny_model("rmt", rmt={"num_mem_tokens": 2, "mem_loss_weight": 0.01,
                                   "mem_loss_token": 5})
    x = torch.randint(0, 23, (2, 4))
    with torch.no_grad():
        out = model(x, targets=x)
        # RMT §3.4: every write row predicts mem_loss_token, weighted by mem_loss_weight.
        write = out.state.tokens.reshape(-1, out.state.tokens.shape[-1])
        unweighted = model.softmax(write, torch.full((write.shape[0],), 5)).mean()
    assert out.aux_loss is not None and out.aux_loss > 0
    torch.testing.assert_close(out.aux_loss, 0.01 * unweighted)
    torch.testing.assert_close(out.loss, out.nll.sum() / out.n_tokens)   # the LM loss only


@pytest.mark.parametrize("pre_lnorm, memory_norm, bounded", [
    (False, "unit", True), (True, "unit", True), (True, "embedding", True),
    (True, "none", False)])
def test_memory_norm_stays_bounded_over_a_long_stream(pre_lnorm, memory_norm, bounded):
    """The write outputs re-enter the stack as the next segment's inputs. Pre-LN does not
    normalise its residual stream, so without the memory's own LayerNorm the memory norm
    grows with every segment (x44 over 200 segments at init) until tokens cannot use it."""
    model = tiny_model("rmt", mem_len=0, pre_lnorm=pre_lnorm,
                       rmt={"num_mem_tokens": 2, "memory_norm": memory_norm})
    x = torch.randint(0, 23, (2, 4 * 100))
    state, norms = None, []
    with torch.no_grad():
        for s in range(100):
            state = model(x[:, 4 * s:4 * s + 4], state).state
            norms.append(state.tokens.norm(dim=-1).mean())
    assert (max(norms) < 1.5 * norms[0]) == bounded
