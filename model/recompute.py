"""Which results a checkpointed segment keeps for its backward (`bptt.recompute`).

Checkpointing a segment (`MemoryLM.forward(..., checkpoint_segment=True)`) keeps only its
inputs and re-runs its whole forward inside the backward. A selective policy keeps the
outputs of some ops as well, so the re-run skips them (torch's selective activation
checkpointing: `create_selective_checkpoint_contexts`, non-reentrant, one backward per step,
which every ZeRO stage accepts):

    full           nothing but the inputs; everything is recomputed (the default)
    save-ffn-out   the FFN's second matmul (d_inner -> d_model) in every layer
    save-linear    every linear-layer matmul (aten.mm / aten.addmm): q, k/v, positions, W_o,
                   both FFN matmuls, the softmax head
    save-matmul    save-linear plus the attention matmuls (aten.bmm, SDPA kernels)

Why these: a matmul [N, K] x [K, M] costs N·K·M to recompute and N·M to keep, so the time
saved per kept byte grows with the reduction size K. The FFN's second matmul has the
largest (K = d_inner); the other projections have K = d_model; the attention matmuls
K = d_head or the key count, and their outputs are [B, H, Q, K] score matrices, the most
bytes per second saved. Profile at the bench_bptt RMT shape (4 layers, d_model 256,
segment 128, batch 8, fp32, 1 CPU thread; benchmarks/results/selective_recompute.md): of a
segment's forward, addmm 32%, mm 17%, bmm 15%, dropout's bernoulli_ 22%, the rest
pointwise; the FFN-out matmul saves 5.2 ms per MB kept, the other linear ones 1.3-1.5,
bmm 0.5.

Dropout is recomputed under every policy: checkpoint restores the RNG state before the
re-run and no policy skips a random op, so every mask is drawn again from the same RNG
sequence and is identical (skipping some random ops but not others would shift the
sequence). Caching dropout's noise is not possible on CPU anyway: aten.dropout draws it
with the in-place bernoulli_ into an empty_like tensor whose handle the C++ code keeps.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

RECOMPUTE_POLICIES = ("full", "save-ffn-out", "save-linear", "save-matmul")

_aten = torch.ops.aten
_LINEAR = (_aten.mm.default, _aten.addmm.default)
# Attention matmuls: the plain path's torch.matmul (bmm) and SDPA's kernels, whichever
# this build has (the CPU math path decomposes into bmm + softmax).
_ATTENTION = tuple(getattr(_aten, name).default for name in (
    "bmm", "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    if hasattr(_aten, name))


class _Policy:
    """One checkpointed call's policy: MUST_SAVE for `saved_ops` (with `reduction`: only a
    matmul whose reduction size, the first operand's last dim, is `reduction`), recompute
    the rest; a fresh one per call (it remembers what that call saved).

    A kept output must not change before the backward, or the recompute would read other
    values than the forward did. The one in-place op model/ applies to a matmul output is
    the FFN's ReLU(inplace=True) on W1's output: idempotent, so the recompute's relu_ on the
    kept, already rectified values gives the same tensor; torch's mutation check is switched
    off for that reason, and any other in-place op on a kept output raises here instead."""

    def __init__(self, saved_ops: tuple, reduction: int | None):
        self.saved_ops, self.reduction = saved_ops, reduction
        self.kept: set[int] = set()   # data pointers of the outputs saved so far

    def __call__(self, ctx, func, *args, **kwargs):
        if func in self.saved_ops:
            mat1 = args[1] if func == _aten.addmm.default else args[0]
            if self.reduction is None or mat1.shape[-1] == self.reduction:
                outs = ctx.op_output if isinstance(ctx.op_output, tuple) else (ctx.op_output,)
                self.kept.update(t.data_ptr() for t in outs if isinstance(t, torch.Tensor))
                return CheckpointPolicy.MUST_SAVE
        elif (func._schema.is_mutable and func not in _IDEMPOTENT and args
              and isinstance(args[0], torch.Tensor) and args[0].data_ptr() in self.kept):
            raise RuntimeError(f"{func} changes a tensor that selective recompute keeps for "
                               "the backward; this policy cannot be used with this model")
        return CheckpointPolicy.PREFER_RECOMPUTE


_IDEMPOTENT = (_aten.relu_.default,)


def check_policy(policy: str) -> None:
    if policy not in RECOMPUTE_POLICIES:
        raise ValueError(f"unknown recompute policy {policy!r}; choose "
                         f"{', '.join(RECOMPUTE_POLICIES)}")


def context_fn(policy: str, d_inner: int) -> Callable | None:
    """The `context_fn` for torch.utils.checkpoint.checkpoint; None for full recompute."""
    check_policy(policy)
    if policy == "full":
        return None
    ops, reduction = {"save-ffn-out": (_LINEAR, d_inner), "save-linear": (_LINEAR, None),
                      "save-matmul": (_LINEAR + _ATTENTION, None)}[policy]

    def contexts():
        return create_selective_checkpoint_contexts(_Policy(ops, reduction),
                                                    allow_cache_entry_mutation=True)
    return contexts
