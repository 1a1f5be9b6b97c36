"""ARMT's state path with hand-written backward: what a segment's backward moves on A.

A_l [B, d_phi, d_v] is the largest tensor a segment touches per layer (453 MB for all 12
layers at GPT-2-124M's shape with 32 rows), and plain autograd moves it many times in
backward: the read's and the lookup's gradients of A_l as two bmm outputs, the update's
identity gradient handed on, and two accumulations of the three (docs/armt-costs.md, "State
traffic in backward"). Here each layer's A_l goes through three functions whose backward
assembles dL/dA_l with two baddbmm and writes it straight into its layer's slice of one
[B, n_layer, d_phi, d_v] buffer, which becomes dL/dA without a stack:

  unbind   A -> A_l                      backward: the buffer (each layer wrote its slice)
  read     num_q = phi(q) A_l            backward: d phi(q) = d num_q A_l^T          (reads A_l)
                                          dA_l[slot] = dA_w + phi(q)^T d num_q     (2)
  write    A_l' = A_l + phi(k)^T U,      backward, from g = dL/dA_l':
           U = beta (v - phi(k) A_l / s)  dU = phi(k) g, d phi(k) = U g^T           (reads g twice)
                                          d phi(k) += d num_k A_l^T               (reads A_l)
                                          dA_w = g + phi(k)^T d num_k              (2)

the write taking A_l from the read (`read` returns it), so the two gradients meet in the
baddbmm and autograd never sums two |A_l|-sized tensors. s = phi(k)^T z + eps and
everything on z stay plain autograd (z is d_phi wide, not d_phi x d_v). In a checkpointed
segment's re-run in backward, the write's output A_l' is not computed: only what the
segment saves for backward is needed there, and nothing saves A_l' (the next segment's
input is the first run's). The equations are model/mechanisms/armt/associative.py's; the gradients
equal plain autograd's to rounding (tests/test_armt_costs.py).

Used in a training forward only (autograd on, not under torch.compile, whose tracing of a
Function's backward this file does not need: the plain ops compile as they are).
"""

from __future__ import annotations

import torch
from torch.autograd import Function


def innermost_checkpoint_hooks(kind: str) -> bool:
    """Whether the innermost saved-tensor hooks are torch.utils.checkpoint's `kind`
    ("_checkpoint_hook": a non-reentrant region's first run, which keeps its arguments for
    a re-run; "_recomputation_hook": that re-run in backward); False elsewhere, or if torch
    no longer exposes the hooks."""
    try:
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    except (AttributeError, RuntimeError):
        return False
    return hooks is not None and getattr(hooks[0], "__qualname__", "").startswith(f"{kind}.")


def checkpoint_rerun() -> bool:
    """Inside a checkpoint's re-run (then the write's output is not needed: `_DeltaWrite`);
    False elsewhere (then it is computed as in a first run)."""
    return innermost_checkpoint_hooks("_recomputation_hook")


def fast_path(*tensors: torch.Tensor) -> bool:
    """Whether the hand-written backward applies: autograd recording, eager, float32/64."""
    return (torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and all(t.dtype in (torch.float32, torch.float64) for t in tensors))


class StateGradient:
    """The one buffer dL/dA [B, n_layer, d_phi, d_v] of a segment's incoming A, shared by
    its unbind and every layer's read; allocated in backward by the first read that needs
    it (empty: every slice is written whole before it is read)."""

    def __init__(self, like: torch.Tensor):
        self.shape, self.dtype, self.device = like.shape, like.dtype, like.device
        self.buffer: torch.Tensor | None = None
        self.written: set[int] = set()

    def slot(self, l: int) -> torch.Tensor:
        if self.buffer is None:
            self.buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        self.written.add(l)
        return self.buffer[:, l]

    def take(self, grads) -> torch.Tensor:
        """dL/dA from the per-layer gradients autograd hands the unbind: the slices the
        reads wrote stay where they are; any other layer's gradient is copied in (zeros
        where a layer got none)."""
        buffer = self.buffer
        if buffer is None:
            buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        for l, g in enumerate(grads):
            out = buffer[:, l]
            if l in self.written and g is not None and g.data_ptr() == out.data_ptr() \
                    and g.stride() == out.stride():
                continue
            if g is None:
                out.zero_()
            else:
                out.copy_(g)
        self.buffer, self.written = None, set()
        return buffer


class _Unbind(Function):
    @staticmethod
    def forward(ctx, A, grad):
        ctx.grad = grad
        ctx.set_materialize_grads(False)
        return A.unbind(1)

    @staticmethod
    def backward(ctx, *grads):
        return ctx.grad.take(grads), None


def unbind_layers(A: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], StateGradient | None]:
    """A [B, n_layer, d_phi, d_v] -> its per-layer views, and the buffer the reads write
    their gradients into (None off the fast path: a plain unbind)."""
    if not (A.requires_grad and fast_path(A)):
        return A.unbind(1), None
    grad = StateGradient(A)
    return _Unbind.apply(A, grad), grad


class _Read(Function):
    @staticmethod
    def forward(ctx, A, f, grad, l):
        # phi(q) only for A's gradient (a window's first segment has none to give)
        ctx.save_for_backward(A, f if ctx.needs_input_grad[0] else None)
        ctx.grad, ctx.l = grad, l
        ctx.set_materialize_grads(False)
        return torch.bmm(f, A), A.view_as(A)

    @staticmethod
    def backward(ctx, d_num, d_write):
        A, f = ctx.saved_tensors
        d_f = d_A = None
        if d_num is not None and ctx.needs_input_grad[1]:
            d_f = torch.bmm(d_num, A.transpose(1, 2))
        if ctx.needs_input_grad[0] and (d_num is not None or d_write is not None):
            out = ctx.grad.slot(ctx.l) if ctx.grad is not None else None
            if d_num is None:
                d_A = d_write if out is None else out.copy_(d_write)
            elif d_write is None:
                d_A = torch.bmm(f.transpose(1, 2), d_num, out=out)
            else:
                d_A = torch.baddbmm(d_write, f.transpose(1, 2), d_num, out=out)
        return d_A, d_f, None, None


def read_numerator(A: torch.Tensor, f: torch.Tensor, grad: StateGradient | None = None,
                   l: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(phi(q)^T A [B, n, d_v], A as the write of the same layer must take it). On the fast
    path the gradient of A is assembled here (module docstring); `grad`, `l`: the segment's
    buffer and this layer's slot in it (None: a fresh tensor)."""
    if not fast_path(A, f):
        return torch.bmm(f, A), A
    return _Read.apply(A, f, grad, l)


class _DeltaWrite(Function):
    @staticmethod
    def forward(ctx, A, f, v, beta, s):
        vbar = torch.bmm(f, A) / s[..., None]                  # phi(k)^T A / s  [B, m, d_v]
        w = v - vbar
        U = w * beta[..., None]
        ctx.save_for_backward(A, f, vbar, w, beta, s)
        ctx.set_materialize_grads(False)
        if checkpoint_rerun():
            # Nothing saves A'; the first run's output is the one the next segment read. NaN,
            # not garbage, should anything ever read this one: it would show in the loss.
            return torch.full((), float("nan"), dtype=A.dtype, device=A.device).expand(A.shape)
        return torch.baddbmm(A, f.transpose(1, 2), U)

    @staticmethod
    def backward(ctx, g):
        if g is None:
            return None, None, None, None, None
        A, f, vbar, w, beta, s = ctx.saved_tensors
        need_A, need_f, need_v, need_beta, need_s = ctx.needs_input_grad
        dU = torch.bmm(f, g)                                   # [B, m, d_v]
        dw = dU * beta[..., None]
        d_num = -dw / s[..., None]                             # d vbar = -dw
        d_f = d_A = d_beta = d_s = None
        if need_f:
            d_f = torch.baddbmm(torch.bmm(w * beta[..., None], g.transpose(1, 2)),
                                d_num, A.transpose(1, 2))
        if need_A:
            d_A = torch.baddbmm(g, f.transpose(1, 2), d_num)
        if need_beta:
            d_beta = (dU * w).sum(-1)
        if need_s:
            d_s = (dw * vbar).sum(-1) / s
        return d_A, d_f, (dw if need_v else None), d_beta, d_s


def delta_write(A: torch.Tensor, f: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                s: torch.Tensor) -> torch.Tensor:
    """A + phi(k)^T (beta (v - phi(k)^T A / s)): the delta rule's update of A_l, with
    f = phi(k) [B, m, d_phi], v [B, m, d_v], beta and s [B, m] (s the lookup's divisor,
    phi(k)^T z + eps). A takes the read's pass-through (`read_numerator`) on the fast path."""
    if not fast_path(A, f, v):
        w = v - torch.bmm(f, A) / s[..., None]
        return torch.baddbmm(A, f.transpose(1, 2), w * beta[..., None])
    return _DeltaWrite.apply(A, f, v, beta, s)
