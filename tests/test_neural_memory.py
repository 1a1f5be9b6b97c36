"""Titans' neural memory (model/mechanisms/titans/neural_memory.py) against a token-by-token float64
loop written from the paper's equations (Behrouz, Zhong, Mirrokni 2025, §3.1 Eq. 10-14, and the
chunked form of §3.2: inside a chunk every gradient is taken at the chunk's start weights).
"""

from __future__ import annotations

import math

import pytest
import torch

from model.mechanisms.titans.neural_memory import NeuralMemory, NeuralMemoryState, mlp

D_MODEL, D_MEM = 12, 6


def naive(weights, momentum, k, v, theta, eta, alpha, chunk, clip=None):
    """Eq. 12-14 one token at a time, the gradient by autograd at the weights of the token's
    chunk start M_{t'}, t' = t - mod(t, chunk) (§3.2); chunk = 1 is the plain recurrence.
    `clip`: each token's gradient of each matrix scaled to at most that norm."""
    weights = [w.clone() for w in weights]
    momentum = [s.clone() for s in momentum]
    for t in range(k.shape[1]):
        if t % chunk == 0:
            at = [w.detach().clone().requires_grad_(True) for w in weights]
        with torch.enable_grad():
            loss = (mlp(at, k[:, t:t + 1]) - v[:, t:t + 1]).square().sum()      # Eq. 12
            grads = torch.autograd.grad(loss, at)
        for i, g in enumerate(grads):
            if clip is not None:
                norm = g.flatten(1).norm(dim=1)[:, None, None]
                g = g * torch.clamp(clip / norm, max=1.0)
            momentum[i] = eta[:, t, None, None] * momentum[i] - theta[:, t, None, None] * g
            weights[i] = (1 - alpha[:, t, None, None]) * weights[i] + momentum[i]   # Eq. 13
    return weights, momentum


def _setup(depth: int, chunk: int, n: int, seed: int = 0, clip=None):
    torch.manual_seed(seed)
    mem = NeuralMemory(D_MODEL, D_MEM, depth=depth, chunk_size=chunk, max_lr=0.7,
                       max_momentum=0.9, max_forget=0.5, forget_bias=-1.0,
                       max_grad_norm=clip).double()
    x = torch.randn(3, n, D_MODEL, dtype=torch.float64)
    weights = [w.detach()[None].repeat(3, 1, 1) + 0.1 * torch.randn(3, *w.shape,
                                                                      dtype=torch.float64)
               for w in mem.initial_weights()]
    momentum = [0.05 * torch.randn_like(w) for w in weights]
    return mem, x, weights, momentum


def _naive_inputs(mem, x):
    k = torch.nn.functional.normalize(mem.k_proj(x), dim=-1)
    v = mem.v_proj(x)
    theta, log_eta, log_keep = mem.gate_values(x, torch.float64)
    return k, v, theta, log_eta.exp(), 1 - log_keep.exp()


@pytest.mark.parametrize("depth,chunk,n,clip", [(1, 1, 7, None), (2, 1, 7, None),
                                                (2, 4, 11, None), (3, 5, 10, None),
                                                (2, 16, 5, None), (2, 4, 11, 0.5)])
def test_chunked_parallel_update_equals_the_token_by_token_float64_recurrence(depth, chunk, n,
                                                                              clip):
    """The chunked form (w_i coefficients, one matmul per matrix) equals Eq. 13-14 run token
    by token, for a linear and deep memories, chunks that divide the sequence, a ragged last
    chunk, a sequence shorter than one chunk, and with the per-token gradient clip."""
    mem, x, weights, momentum = _setup(depth, chunk, n, clip=clip)
    with torch.no_grad():
        got_w, got_s, _ = mem.update(weights, momentum, x)
    want_w, want_s = naive(weights, momentum, *_naive_inputs(mem, x), chunk, clip)
    for got, want in zip(got_w + got_s, want_w + want_s, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_each_token_reads_the_memory_of_its_chunk_start():
    mem, x, weights, momentum = _setup(2, 4, 10)
    with torch.no_grad():
        _, _, reads = mem.update(weights, momentum, x, read=x)
        k, v, theta, eta, alpha = _naive_inputs(mem, x)
        for start in (0, 4, 8):
            w_start, _ = naive(weights, momentum, k[:, :start], v[:, :start], theta, eta,
                               alpha, 4) if start else (weights, None)
            torch.testing.assert_close(reads[:, start:start + 4],
                                       mem.retrieve(w_start, x[:, start:start + 4]))


def test_a_sequence_shorter_than_a_chunk_still_updates_the_memory():
    mem, x, weights, momentum = _setup(2, 64, 3)
    with torch.no_grad():
        new_w, new_s, _ = mem.update(weights, momentum, x[:, :1])
    assert all((a - b).abs().max() > 1e-4 for a, b in zip(new_w + new_s, weights + momentum,
                                                          strict=True))


def test_gradient_reaches_the_projections_and_gates_through_the_inner_update():
    mem, x, _, _ = _setup(2, 4, 9)
    fresh = NeuralMemoryState.empty(3, 1, mem.shapes).to(dtype=torch.float64)
    weights, momentum = fresh.layer(0, mem.initial_weights())
    new_w, _, _ = mem.update(weights, momentum, x)
    mem.retrieve(new_w, x).square().sum().backward()
    for name, p in mem.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_state_stays_float32_under_bf16_and_tracks_float32():
    torch.manual_seed(0)
    mem = NeuralMemory(D_MODEL, D_MEM, depth=2, chunk_size=4)
    state = NeuralMemoryState.empty(2, 1, mem.shapes)
    x = torch.randn(2, 8, D_MODEL)
    w, s = state.layer(0, mem.initial_weights())
    with torch.no_grad():
        w32, s32, _ = mem.update(w, s, x)
        w16, s16, _ = mem.to(torch.bfloat16).update(w, s, x.bfloat16())
    assert all(t.dtype == torch.float32 for t in w16 + s16)
    assert state.to(dtype=torch.bfloat16).weights[0].dtype == torch.float32
    for a, b in zip(w16, w32, strict=True):
        assert (a - b).norm() / b.norm() < 0.02


def test_reset_rows_give_a_fresh_document_and_replace_non_finite_values():
    mem = NeuralMemory(D_MODEL, D_MEM, depth=2)
    state = NeuralMemoryState.empty(2, 1, mem.shapes)
    state = NeuralMemoryState(weights=[w + float("nan") for w in state.weights],
                              momentum=state.momentum, fresh=torch.zeros(2, dtype=torch.bool))
    reset = state.reset_rows(torch.tensor([True, False]))
    w, s = reset.layer(0, mem.initial_weights())
    assert reset.fresh.tolist() == [True, False]
    torch.testing.assert_close(w[0][0], mem.initial_weights()[0])
    assert torch.isfinite(reset.weights[0][0]).all() and torch.isnan(w[0][1]).all()
    loaded = NeuralMemoryState.from_state_dict(reset.state_dict())
    assert loaded.fresh.tolist() == [True, False]


def _run_at_the_bounds(depth: int, clip, segments: int) -> float:
    """The largest |weight| over `segments` segments of 16 tokens with every gate at its
    bound (theta = max_lr = 1, eta = max_momentum = 0.99, no forgetting), or inf."""
    torch.manual_seed(0)
    mem = NeuralMemory(32, 16, depth=depth, chunk_size=16, max_lr=1.0, max_momentum=0.99,
                       max_forget=0.0, max_grad_norm=clip)
    with torch.no_grad():
        mem.gates.bias.copy_(torch.tensor([30.0, 30.0, -30.0]))   # sigmoid = 1, 1, 0
        weights, momentum = NeuralMemoryState.empty(2, 1, mem.shapes).layer(
            0, mem.initial_weights())
        largest = 0.0
        for _ in range(segments):
            weights, momentum, _ = mem.update(weights, momentum, 3 * torch.randn(2, 16, 32))
            top = max(float(w.abs().max()) for w in weights)
            if not math.isfinite(top):
                return math.inf
            largest = max(largest, top)
    return largest


@pytest.mark.parametrize("depth", [1, 4])
def test_at_every_bound_the_clipped_memory_stays_finite_and_the_unclipped_one_does_not(depth):
    """The bounds together (model.titans.max_lr <= 1, max_momentum < 1, memory_depth <= 4,
    max_forget 0) with the gates saturated: the clipped memory stays finite over 300
    segments, its weights levelling off (measured: largest |w| 178 linear, 498 at depth 4,
    the same at 100 segments within 30%); without the clip the same memory overflows
    within 100 segments (a deep one in the first few)."""
    assert _run_at_the_bounds(depth, 1.0, 300) < 1e3
    assert _run_at_the_bounds(depth, None, 100) == math.inf


@pytest.mark.parametrize("max_forget", [1.0, 0.5])
def test_a_saturated_gate_gives_finite_gradients(max_forget):
    """The gates at +-40 before their sigmoid (sigmoid rounds to 1 or 0 in float32): the
    update and its gradient stay finite. With log(1 - alpha) formed as log1p(-alpha) a
    saturated forget gate at max_forget 1 is log(0), and its gradient NaN (the NaN the
    associative-retrieval stability run hit at step 1000)."""
    torch.manual_seed(0)
    mem = NeuralMemory(D_MODEL, D_MEM, depth=2, chunk_size=4, max_forget=max_forget)
    x = torch.randn(2, 8, D_MODEL)
    for bias in (40.0, -40.0):
        with torch.no_grad():
            mem.gates.bias.fill_(bias)
        mem.zero_grad()
        weights, momentum = NeuralMemoryState.empty(2, 1, mem.shapes).layer(
            0, mem.initial_weights())
        new_w, new_s, _ = mem.update(weights, momentum, x)
        mem.retrieve(new_w, x).square().sum().backward()
        assert all(torch.isfinite(t).all() for t in new_w + new_s)
        assert all(torch.isfinite(p.grad).all() for p in mem.parameters()), bias


def test_the_convolution_is_causal_per_channel_and_runs_across_segments():
    """§4.4's convolution after a projection, written as a loop: k_t = b + sum_j w_j *
    (x_{t-c+1+j} W_K) per channel, zeros before the sequence. The module gives it for the
    whole sequence and for two segments with the carried tail; the memory written over the
    two segments (chunk boundaries alike) equals the one written over the whole, reads
    included."""
    torch.manual_seed(0)
    c, n, cut = 3, 12, 8
    mem = NeuralMemory(D_MODEL, D_MEM, depth=2, chunk_size=4, conv_size=c).double()
    x = torch.randn(2, n, D_MODEL, dtype=torch.float64)
    zero = torch.zeros(2, c - 1, D_MODEL, dtype=torch.float64)
    proj, conv = mem.k_proj(x), mem.convs["k"]
    want = torch.stack([conv.bias + sum(conv.weight[:, 0, j] * proj[:, t - c + 1 + j]
                                        for j in range(c) if t - c + 1 + j >= 0)
                        for t in range(n)], dim=1)
    with torch.no_grad():
        torch.testing.assert_close(mem.project("k", x, zero)[0], want)
        head, rest = x[:, :cut], x[:, cut:]
        tail = mem.carry(zero, head)
        assert torch.equal(tail, x[:, cut - c + 1:cut])
        # a segment shorter than the tail keeps the older rows before it
        assert torch.equal(mem.carry(tail, rest[:, :1]), torch.cat([tail[:, 1:], rest[:, :1]], 1))
        torch.testing.assert_close(mem.project("k", rest, tail)[0], want[:, cut:])
        fresh = NeuralMemoryState.empty(2, 1, mem.shapes).to(dtype=torch.float64)
        w, s = fresh.layer(0, mem.initial_weights())
        whole = mem.update(w, s, x, read=x, tail=zero)
        first = mem.update(w, s, head, read=head, tail=zero)
        second = mem.update(first[0], first[1], rest, read=rest, tail=tail)
    for got, want_t in zip(second[0] + second[1], whole[0] + whole[1], strict=True):
        torch.testing.assert_close(got, want_t, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(torch.cat([first[2], second[2]], dim=1), whole[2])
    with pytest.raises(ValueError, match="one stream"):
        mem.update(w, s, head, read=head.clone(), tail=zero)
