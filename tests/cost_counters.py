"""Device-independent cost counters for the ARMT hot path (docs/armt.md, "Costs counted on
the CPU"): bytes moved on state-shaped tensors, and the peak of live tensor bytes. Both
watch every aten op through a TorchDispatchMode, so they count what a GPU would execute
(the same ops, the same shapes) while running on the CPU.

- `StateTraffic`: for each op, the bytes of its tensor inputs (read) and outputs (written)
  that are batched (3 dims or more) and whose trailing dimensions are the associative
  state's [d_phi, d_v] or its transpose [d_v, d_phi] (what a matmul against A^T reads): A,
  a layer's A_l, and their gradients; a 2-D weight of the same shape is not state (GPT-2's
  fused [d, 3d] attention weight is when d_phi = 3d). A select's backward that zero-fills a
  whole [B, n_layer, d_phi, d_v] gradient to place one layer's slice counts its full
  output, as the GPU writes it. An allocation moves nothing, an `out=` tensor is written
  only, and an expanded (stride-0) dimension is read once.
- `LiveBytes`: the bytes of every storage an op created that is still referenced, after
  each op; `peak` is the largest sum seen. Parameters and inputs made before the mode was
  entered are not counted (they are the same in every run compared).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _tensors(tree):
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


# Ops that only allocate: a GPU's caching allocator hands out the block, no byte moves.
_ALLOCATIONS = {"empty", "empty_strided", "new_empty", "new_empty_strided"}


def _distinct(t: torch.Tensor) -> int:
    """Elements a read of t touches: an expanded (stride-0) dimension is one element wide."""
    n = 1
    for size, stride in zip(t.shape, t.stride(), strict=True):
        n *= size if stride else 1
    return n


class StateTraffic(TorchDispatchMode):
    """Bytes read and written on tensors whose last two dims are `trailing` or its
    transpose."""

    def __init__(self, trailing: tuple[int, int]):
        super().__init__()
        self.trailing = {tuple(trailing), tuple(trailing)[::-1]}
        self.read = self.written = 0
        self.by_op: Counter = Counter()

    def _bytes(self, tensors) -> int:
        return sum(_distinct(t) * t.element_size() for t in tensors
                   if t.dim() >= 3 and tuple(t.shape[-2:]) in self.trailing)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # A view moves no bytes (its consumer's read is counted), nor does an allocation.
        name = func.overloadpacket.__name__ if isinstance(func, torch._ops.OpOverload) else ""
        if not (isinstance(func, torch._ops.OpOverload) and func.is_view) \
                and name not in _ALLOCATIONS:
            # An `out=` tensor is written, not read.
            read = _tensors((args, {k: v for k, v in kwargs.items() if k != "out"}))
            r, w = self._bytes(read), self._bytes(_tensors(out))
            self.read += r
            self.written += w
            if r or w:
                self.by_op[func.overloadpacket.__name__] += r + w
        return out

    @property
    def total(self) -> int:
        return self.read + self.written


class LiveBytes(TorchDispatchMode):
    """The peak, over ops, of the bytes of storages created inside the mode and alive."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # Forget freed storages first: a new one may reuse a freed one's address.
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        for t in _tensors(out):
            s = t.untyped_storage()
            key = s.data_ptr()
            if key and key not in self.live:
                self.live[key] = (StorageWeakRef(s), s.nbytes())
        self.peak = max(self.peak, self.alive())
        return out

    def alive(self) -> int:
        """Bytes of the storages created inside the mode that are still referenced."""
        return sum(n for ref, n in self.live.values() if not ref.expired())
