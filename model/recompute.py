"""Which results a checkpointed segment keeps for its backward (`bptt.recompute`).

Checkpointing a segment (`MemoryLM.forward(..., checkpoint_segment=True)`) keeps only its
inputs and re-runs its whole forward inside the backward. A selective policy keeps the
outputs of some ops as well, so the re-run skips them:

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

How: `torch.utils.checkpoint.checkpoint(..., use_reentrant=False, context_fn=...)` (one
backward per step, what every ZeRO stage needs) with two dispatch modes of our own, the
mechanism of torch's `create_selective_checkpoint_contexts` with two differences:
- torch's recompute mode requires the re-run to call exactly the forward's ops in order,
  and under ZeRO-3 it does not: DeepSpeed's hooks re-gather the parameters with other ops
  ("aten.empty encountered during backward but not found in storage"). Here only the kept
  ops are matched, one by one per op, with their input shapes checked; any other op runs.
- torch hands the model the very tensor it keeps, and the model changes some matmul
  outputs in place (the FFN's ReLU(inplace=True) on W1's output; the one-pass attention
  kernel adds the positional term to the content scores in place), so the re-run would
  read changed values. Here the model gets a copy (a memcpy, small beside the matmul).

Dropout is recomputed under every policy: checkpoint restores the RNG state before the
re-run and no policy skips a random op, so every mask is drawn again from the same RNG
sequence and is identical (skipping some random ops but not others would shift the
sequence). Caching dropout's noise is not possible on CPU anyway: aten.dropout draws it
with the in-place bernoulli_ into an empty_like tensor whose handle the C++ code keeps.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

RECOMPUTE_POLICIES = ("full", "save-ffn-out", "save-linear", "save-matmul")

_aten = torch.ops.aten
_LINEAR = (_aten.mm.default, _aten.addmm.default)
# Attention matmuls: the plain path's torch.matmul (bmm) and SDPA's kernels, whichever
# this build has (the CPU math path decomposes into bmm + softmax).
_ATTENTION = tuple(getattr(_aten, name).default for name in (
    "bmm", "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    if hasattr(_aten, name))


class _Rule:
    """Keep the outputs of `ops`; with `reduction`, only of a matmul whose reduction size
    (its first matrix operand's last dim) is `reduction`."""

    def __init__(self, ops: tuple, reduction: int | None):
        self.ops, self.reduction = ops, reduction

    def __call__(self, func, args) -> bool:
        if func not in self.ops:
            return False
        if self.reduction is None:
            return True
        mat1 = args[1] if func == _aten.addmm.default else args[0]
        return mat1.shape[-1] == self.reduction


def _shapes(args) -> tuple:
    return tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))


class _Keep(TorchDispatchMode):
    """Forward of a checkpointed segment: keep what the rule says, hand the model a copy."""

    def __init__(self, rule: _Rule, store: dict):
        super().__init__()
        self.rule, self.store = rule, store

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.rule(func, args):
            return out
        self.store[func].append((_shapes(args), out))
        return tree_map_only(torch.Tensor, torch.clone, out)


class _Reuse(TorchDispatchMode):
    """Recompute inside the backward: a kept op returns what the forward kept (once, then
    released); every other op runs."""

    def __init__(self, rule: _Rule, store: dict):
        super().__init__()
        self.rule, self.store = rule, store
        self.used: dict = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.rule(func, args):
            return func(*args, **(kwargs or {}))
        kept, i = self.store[func], self.used[func]
        self.used[func] += 1
        if i >= len(kept) or kept[i] is None or kept[i][0] != _shapes(args):
            raise RuntimeError(f"selective recompute: call {i} of {func} in the recompute "
                               "does not match the forward (or a second backward through "
                               "the same checkpoint); the segment's forward must be "
                               "deterministic in its matmuls")
        out = kept[i][1]
        kept[i] = None   # the backward owns it now; freed when it is done with it
        return out


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
    rule = _Rule(ops, reduction)

    def contexts():
        store: dict = defaultdict(list)   # one per checkpointed call: op -> [(shapes, out)]
        return _Keep(rule, store), _Reuse(rule, store)
    return contexts
