"""ARMT's hand-written state backward (model/mechanisms/armt/associative_grad.py) against plain
autograd over the same equations (model/mechanisms/armt/associative.py), in float64: every input's
gradient, for the ways a segment uses A_l (read then write, a read alone, a write alone, a state
that needs no gradient, a layer whose gradient never arrives)."""

from __future__ import annotations

import pytest
import torch

import model.mechanisms.armt.associative_grad as ag
from model.mechanisms.armt.associative import AssociativeLayer, AssociativeMemory

B, N, M, D, DK, LAYERS = 2, 5, 3, 8, 4, 3


def layer(seed: int, **kw) -> AssociativeLayer:
    torch.manual_seed(seed)
    lay = AssociativeLayer(D, DK, **kw).double()
    with torch.no_grad():
        lay.v_proj.weight.normal_(0, 0.5)
    return lay


def inputs(seed: int, requires_grad: bool = True):
    g = torch.Generator().manual_seed(seed)
    blocks = [layer(seed + i) for i in range(LAYERS)]
    d_phi = blocks[0].d_phi
    A = torch.rand(B, LAYERS, d_phi, D, generator=g, dtype=torch.float64)
    z = torch.rand(B, LAYERS, d_phi, generator=g, dtype=torch.float64) + 0.5
    h = torch.randn(B, N + M, D, generator=g, dtype=torch.float64)
    for t in (A, z, h):
        t.requires_grad_(requires_grad or t is h)
    return blocks, A, z, h


def segment(blocks, A, z, h, use: str) -> torch.Tensor:
    """A scalar of one segment over every layer: `use` is "both" (read, then the write with
    the read's A), "read" (no write), "write" (the write with A_l from the unbind)."""
    state = AssociativeMemory(A=A, z=z, writes=torch.zeros(B, dtype=torch.long))
    A_in, z_in, grad = state.layers()
    total, A_new = h.sum() * 0, []
    for i, block in enumerate(blocks):
        A_i = A_in[i]
        if use in ("both", "read"):
            h, A_i = block.read_passing(A_in[i], z_in[i], h, grad, i)
        if use in ("both", "write"):
            A_w, z_w = block.write(A_i, z_in[i], torch.tanh(h[:, N:]))
            A_new.append(A_w)
            total = total + (A_w * torch.cos(A_w)).sum() + z_w.sum()
    return total + (h * h.roll(1, -1)).sum()


def grads(use: str, fast: bool, seed: int = 0, requires_grad: bool = True):
    blocks, A, z, h = inputs(seed, requires_grad)
    with pytest.MonkeyPatch.context() as mp:
        if not fast:
            mp.setattr(ag, "fast_path", lambda *t: False)
        loss = segment(blocks, A, z, h, use)
        wrt = [t for t in (A, z, h) if t.requires_grad]
        params = [p for b in blocks for p in b.parameters()]
        return loss, torch.autograd.grad(loss, wrt + params, allow_unused=True)


@pytest.mark.parametrize("use", ["both", "read", "write"])
@pytest.mark.parametrize("requires_grad", [True, False])
def test_hand_written_state_backward_equals_plain_autograd_in_float64(use, requires_grad):
    """Loss and every gradient (A, z, h, each layer's W_q, W_k, W_v and gate) equal plain
    autograd's to 1e-12 relative: only the order of sums differs."""
    loss, fast = grads(use, True, requires_grad=requires_grad)
    ref_loss, plain = grads(use, False, requires_grad=requires_grad)
    assert torch.equal(loss, ref_loss) or float((loss - ref_loss).abs()) <= 1e-12 * float(
        ref_loss.abs())
    for f, p in zip(fast, plain, strict=True):
        assert (f is None) == (p is None)
        if f is not None:
            assert float((f - p).norm()) <= 1e-12 * float(p.norm()) + 1e-300, use


def test_the_state_gradient_is_written_in_place_not_stacked():
    """dL/dA comes back as the one buffer every layer's read wrote its slice of (no copy
    of per-layer gradients), and a layer no loss reaches gets zeros, not stale memory."""
    blocks, A, z, h = inputs(1)
    state = AssociativeMemory(A=A, z=z, writes=torch.zeros(B, dtype=torch.long))
    A_in, z_in, grad = state.layers()
    assert grad is not None
    out = 0
    for i, block in enumerate(blocks[:-1]):       # the last layer's A_l is never read
        h, A_i = block.read_passing(A_in[i], z_in[i], h, grad, i)
        out = out + block.write(A_i, z_in[i], h[:, N:])[0].sum()
    (dA,) = torch.autograd.grad(out + h.sum(), A)
    assert torch.equal(dA[:, -1], torch.zeros_like(dA[:, -1]))
    assert dA[:, :-1].abs().sum() > 0


def test_gradcheck_of_the_write_and_the_read():
    """Numerical against analytical Jacobians of the two Functions themselves (float64)."""
    g = torch.Generator().manual_seed(2)
    A = torch.rand(2, 6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    f = torch.rand(2, 3, 6, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    beta = torch.rand(2, 3, generator=g, dtype=torch.float64, requires_grad=True)
    r = torch.rand(2, 3, generator=g, dtype=torch.float64, requires_grad=True) + 0.5
    assert torch.autograd.gradcheck(ag.delta_write, (A, f, v, beta, r))
    q = torch.rand(2, 5, 6, generator=g, dtype=torch.float64, requires_grad=True)

    def read_then_write(A, q, f, v, beta, r):
        num, A_pass = ag.read_numerator(A, q)
        return num.sin().sum() + ag.delta_write(A_pass, f, v, beta, r).cos().sum()
    assert torch.autograd.gradcheck(read_then_write, (A, q, f, v, beta, r))


def test_a_checkpoint_re_run_does_not_compute_the_written_state():
    """In a non-reentrant checkpoint's re-run the write returns a NaN placeholder for A'
    (nothing saves it; with early stop, the default, the re-run ends at the write's saves
    and never gets there): the gradients are still those without checkpointing, so nothing
    read it."""
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop
    blocks, A, z, h = inputs(3)
    seen = []

    def body(A, z, h):
        state = AssociativeMemory(A=A, z=z, writes=torch.zeros(B, dtype=torch.long))
        A_in, z_in, grad = state.layers()
        h, A_i = blocks[0].read_passing(A_in[0], z_in[0], h, grad, 0)
        A_w, _ = blocks[0].write(A_i, z_in[0], h[:, N:])
        seen.append(bool(A_w.isnan().all()))
        return h, A_w

    with set_checkpoint_early_stop(False):     # the re-run goes past the write
        h1, A1 = checkpoint(body, A, z, h, use_reentrant=False)
    loss = (h1 * h1).sum() + (A1 * A1).sum()
    got = torch.autograd.grad(loss, (A, z, h))
    h2, A2 = body(A, z, h)
    want = torch.autograd.grad((h2 * h2).sum() + (A2 * A2).sum(), (A, z, h))
    assert seen == [False, True, False]     # first run, re-run, plain run
    for a, b in zip(got, want, strict=True):
        assert float((a - b).norm()) <= 1e-12 * float(b.norm())
