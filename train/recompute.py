"""Which results a checkpointed segment keeps for its backward (`bptt.recompute`).

Checkpointing a segment (train/segment_checkpoint.py) keeps only its
inputs and re-runs its whole forward inside the backward. A selective policy keeps the
outputs of some ops as well, so the re-run skips them:

    full                nothing but the inputs; everything is recomputed (the default)
    save-masks          dropout's 0/1 draws, 8 per byte: the recompute draws no random
                        numbers (on CPU dropout's RNG is a fifth of the forward)
    save-ffn-out        the FFN's second matmul (d_inner -> d_model) in every layer;
                        save-ffn-out:N (and save-masks+ffn-out:N) in the first N layers
                        only, a point between save-masks and save-masks+ffn-out
    save-linear         every linear-layer matmul (aten.mm / aten.addmm): q, k/v,
                        positions, W_o, both FFN matmuls, the softmax head
    save-matmul         save-linear plus the attention matmuls (aten.bmm, SDPA kernels)
    save-masks+X        the masks and what save-X keeps

Why these: a matmul [N, K] x [K, M] costs N·K·M to recompute and N·M to keep, so the time
saved per kept byte grows with the reduction size K. The FFN's second matmul has the
largest (K = d_inner); the other projections have K = d_model; the attention matmuls
K = d_head or the key count, and their outputs are [B, H, Q, K] score matrices, the most
bytes per second saved. The measured profile (which ops a segment's forward spends its
time in, and the time each policy saves per MB kept) is in BENCHMARKS.md, "Selective
recompute".

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

Dropout: without save-masks it is recomputed: checkpoint restores the RNG state before the
re-run and no op that draws is skipped, so every mask is drawn again from the same RNG
sequence and is identical. save-masks keeps the draws of aten.bernoulli_ (how aten.dropout
draws its noise on CPU: bernoulli_ into an empty_like tensor, then scaled in place) as bits
and writes them back into the recompute's tensor instead of drawing; 0/1 values, so exact.
If the forward drew anything else (e.g. CUDA's fused native_dropout), no draw is replayed,
since skipping some draws but not others would shift the RNG sequence: everything is drawn
again as without save-masks.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

_aten = torch.ops.aten
_LINEAR = (_aten.mm.default, _aten.addmm.default)
# Attention matmuls: the plain path's torch.matmul (bmm) and SDPA's kernels, whichever
# this build has (the CPU math path decomposes into bmm + softmax).
_ATTENTION = tuple(getattr(_aten, name).default for name in (
    "bmm", "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    if hasattr(_aten, name))


class _Rule:
    """Keep the outputs of `ops` (with `reduction`: only of a matmul whose reduction size,
    its first matrix operand's last dim, is `reduction`); `masks`: keep dropout's 0/1 draws
    as bits; `limit`: keep only the first `limit` such outputs of a checkpointed call."""

    def __init__(self, ops: tuple, reduction: int | None, masks: bool,
                 limit: int | None = None):
        self.ops, self.reduction, self.masks, self.limit = ops, reduction, masks, limit

    def beyond_limit(self, nth_match: int) -> bool:
        return self.limit is not None and nth_match > self.limit

    def __call__(self, func, args) -> bool:
        if func not in self.ops:
            return False
        if self.reduction is None:
            return True
        mat1 = args[1] if func == _aten.addmm.default else args[0]
        return mat1.shape[-1] == self.reduction


@dataclass
class _Store:
    """What one checkpointed call keeps: op -> [(input shapes, output)], the packed masks,
    and whether the forward drew random numbers other than bernoulli_ (then no mask is
    replayed: skipping some draws would shift the others)."""

    outputs: dict = field(default_factory=lambda: defaultdict(list))
    masks: list = field(default_factory=list)
    other_random: bool = False


_BERNOULLI = _aten.bernoulli_.float


def _pack(draw: torch.Tensor) -> torch.Tensor:
    """bernoulli_'s 0/1 values -> 8 per byte (1/32 of the fp32 noise). On the CPU numpy's
    packbits, ~15x faster than the torch ops of `_pack_on_device` (which would eat a third
    of the RNG time saved), copied into a tensor of torch's allocator so that its memory
    shows where torch's is counted (profilers, benchmarks/bench_memory_plan.py)."""
    if draw.device.type == "cpu":
        bits = np.packbits(draw.detach().reshape(-1).ne(0).numpy())  # numpy has no bf16
        packed = torch.empty(bits.size, dtype=torch.uint8)
        packed.numpy()[:] = bits
        return packed
    return _pack_on_device(draw)


def _pack_on_device(draw: torch.Tensor) -> torch.Tensor:
    """`_pack` with torch ops on the draw's device (no copy to the host); numpy's bit order,
    the first value in the most significant bit."""
    flat = (draw.reshape(-1) != 0).to(torch.uint8)
    flat = torch.cat([flat, flat.new_zeros(-flat.numel() % 8)])
    # The bit weights 128 .. 1 made on the device: torch.tensor([...], device=) would copy
    # them from the host, a blocking copy that waits for the GPU at every draw.
    shift = torch.arange(7, -1, -1, dtype=torch.uint8, device=flat.device)
    return (flat.view(-1, 8) << shift).sum(1, dtype=torch.uint8)


def _unpack_into(target: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    n = target.numel()
    if packed.device.type == "cpu":
        bits = torch.from_numpy(np.unpackbits(packed.numpy(), count=n))
    else:
        bits = _unpack_on_device(packed, n)
    return target.copy_(bits.view(target.shape))


def _unpack_on_device(packed: torch.Tensor, n: int) -> torch.Tensor:
    shift = torch.arange(7, -1, -1, dtype=torch.uint8, device=packed.device)
    return ((packed[:, None] >> shift) & 1).reshape(-1)[:n]


def _draws(func, args, kwargs) -> bool:
    """Whether this call draws random numbers: an op tagged as seeded, except an attention
    kernel called with dropout_p 0 (SDPA's kernels are tagged whatever their dropout; the
    WT103 configs have no attention dropout), which draws nothing and cannot shift the
    sequence the masks come from."""
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return False
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == "dropout_p":
            value = kwargs.get("dropout_p") if kwargs and "dropout_p" in kwargs else (
                args[i] if i < len(args) else arg.default_value)
            return value != 0
    return True


def _shapes(args) -> tuple:
    return tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))


class _Keep(TorchDispatchMode):
    """Forward of a checkpointed segment: keep what the rule says, hand the model a copy."""

    def __init__(self, rule: _Rule, store: _Store):
        super().__init__()
        self.rule, self.store = rule, store
        self.matched = 0   # ops the rule matched so far; `_Reuse` counts them the same way

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.rule.masks and _draws(func, args, kwargs):
            if func == _BERNOULLI and not kwargs:
                self.store.masks.append((tuple(out.shape), _pack(out)))
            elif not self.store.other_random:
                self.store.other_random = True
                # Python shows a warning once per call site: one line per run, not per step.
                warnings.warn(f"bptt.recompute save-masks: the forward drew random numbers "
                              f"with {func} (e.g. CUDA's fused dropout), not bernoulli_; "
                              "its dropout masks are drawn again in the recompute (exact, "
                              "but no time saved)", stacklevel=2)
        if not self.rule(func, args):
            return out
        self.matched += 1
        if self.rule.beyond_limit(self.matched):
            return out
        self.store.outputs[func].append((_shapes(args), out))
        return tree_map_only(torch.Tensor, torch.clone, out)


class _Reuse(TorchDispatchMode):
    """Recompute inside the backward: a kept op returns what the forward kept (once, then
    released), a kept dropout draw is written back instead of drawn; every other op runs."""

    def __init__(self, rule: _Rule, store: _Store):
        super().__init__()
        self.rule, self.store = rule, store
        self.used: dict = defaultdict(int)
        self.matched = 0

    def _next(self, kept: list, key, shapes: tuple):
        i = self.used[key]
        self.used[key] += 1
        if i >= len(kept) or kept[i] is None or kept[i][0] != shapes:
            raise RuntimeError(f"selective recompute: call {i} of {key} in the recompute "
                               "does not match the forward (or a second backward through "
                               "the same checkpoint); the segment's forward must run the "
                               "same matmuls and dropouts")
        out = kept[i][1]
        kept[i] = None   # the backward owns it now; freed when it is done with it
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func == _BERNOULLI and self.store.masks and not self.store.other_random:
            return _unpack_into(args[0], self._next(self.store.masks, func,
                                                    tuple(args[0].shape)))
        if not self.rule(func, args):
            return func(*args, **(kwargs or {}))
        self.matched += 1   # the forward kept only the first `limit` matches, in this order
        if self.rule.beyond_limit(self.matched):
            return func(*args, **(kwargs or {}))
        return self._next(self.store.outputs[func], func, _shapes(args))


@dataclass(frozen=True)
class Policy:
    """A parsed `bptt.recompute`: which op outputs a checkpointed segment keeps (None,
    "ffn-out", "linear" or "matmul"), whether dropout's draws, and in how many layers
    (`limit`, ffn-out only). planner/recompute.py counts their bytes from this."""

    outputs: str | None = None
    masks: bool = False
    limit: int | None = None


# name -> (outputs kept, keep dropout masks)
_POLICIES = {
    "full": (None, False),
    "save-masks": (None, True),
    "save-ffn-out": ("ffn-out", False),
    "save-masks+ffn-out": ("ffn-out", True),
    "save-linear": ("linear", False),
    "save-masks+linear": ("linear", True),
    "save-matmul": ("matmul", False),
    "save-masks+matmul": ("matmul", True),
}
_OPS = {"ffn-out": _LINEAR, "linear": _LINEAR, "matmul": _LINEAR + _ATTENTION}
RECOMPUTE_POLICIES = tuple(_POLICIES)


def parse_policy(policy: str) -> Policy:
    """"save-ffn-out:2" -> Policy("ffn-out", False, 2): keep W2's output in the first 2
    layers of each checkpointed segment only; a name without ":N" keeps it in every layer.
    Raises ValueError naming the problem."""
    name, _, limit = policy.partition(":")
    if name not in _POLICIES:
        raise ValueError(f"unknown recompute policy {name!r}; choose "
                         f"{', '.join(RECOMPUTE_POLICIES)}")
    outputs, masks = _POLICIES[name]
    if not limit:
        return Policy(outputs, masks)
    if outputs != "ffn-out":
        raise ValueError(f"{policy!r}: a layer count (':N') applies to the ffn-out policies "
                         "only")
    if not limit.isdigit() or int(limit) < 1:
        raise ValueError(f"{policy!r}: the layer count after ':' must be an integer >= 1")
    return Policy(outputs, masks, int(limit))


def context_fn(policy: str, d_inner: int) -> Callable | None:
    """The `context_fn` for torch.utils.checkpoint.checkpoint; None for full recompute."""
    p = parse_policy(policy)
    if p == Policy():
        return None
    rule = _Rule(_OPS.get(p.outputs, ()), d_inner if p.outputs == "ffn-out" else None,
                 p.masks, p.limit)

    def contexts():
        store = _Store()   # one per checkpointed call
        return _Keep(rule, store), _Reuse(rule, store)
    return contexts
