"""Memory state carried from one segment to the next: one protocol for every mechanism
(Transformer-XL, LaMemo, RMT, ARMT, and any registered one, model/mechanisms/).

Everything outside model/ (training loop, checkpoints, evaluation, generation) speaks only
this protocol and never asks which mechanism it runs:

    detach()            stop gradients (RMT BPTT window edges; XL/LaMemo are always detached)
    select_rows(index)  keep some batch rows, in the given order
    concat_rows(states) join the rows of several states (e.g. one per rank)
    reset_rows(mask)    forget the memory of the rows whose document starts now
    to(device, dtype)   move; LaMemo's log-normalisers stay float32 whatever dtype is asked
    state_dict() / load_state_dict(d) / MemoryState.from_state_dict(d)

Every state is batch-first and functional: each method returns a new state. Rows of one
batch may hold different amounts of valid memory (documents end at different times), so
caches keep a per-row `length`: the number of valid entries at the END of the cache (the
cache is a FIFO, so the valid part is always its most recent suffix).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import ClassVar

import torch

_REGISTRY: dict[str, type[MemoryState]] = {}


def _register(cls):
    _REGISTRY[cls.kind] = cls
    return cls


def _last(x: torch.Tensor, keep: int) -> torch.Tensor:
    """Last `keep` entries of x along time (dim 1), detached, contiguous, in a storage of
    their own: a slice view would keep all of x's storage alive for as long as the memory
    lives (a carried memory twice its size when the segment is as long as the memory)."""
    if x.shape[1] <= keep:
        return x.detach().contiguous()
    return x[:, x.shape[1] - keep:].detach().clone(memory_format=torch.contiguous_format)


def _fifo(old: torch.Tensor | None, new: torch.Tensor, keep: int) -> torch.Tensor:
    """Last `keep` entries of [old ∘ new] along time (dim 1), detached, copying only those
    (see `_last`)."""
    from_old = keep - new.shape[1]
    if old is None or old.shape[1] == 0 or from_old <= 0:
        return _last(new, keep)
    return torch.cat([old[:, max(0, old.shape[1] - from_old):], new], dim=1).detach()


class MemoryState:
    """Base class: the protocol, implemented once over the dataclass fields."""

    kind: ClassVar[str] = ""
    # Fields that keep float32 whatever dtype the state is moved to.
    fp32_fields: ClassVar[tuple[str, ...]] = ()
    # Fields a saved state may lack (added after states were saved): their default then.
    optional_fields: ClassVar[tuple[str, ...]] = ()

    # -- generic field walking -------------------------------------------------------------
    def _map(self, fn_tensor) -> MemoryState:
        """New state with fn_tensor(name, tensor) applied to every tensor (lists included)."""
        values = {}
        for f in fields(self):
            val = getattr(self, f.name)
            if isinstance(val, torch.Tensor):
                val = fn_tensor(f.name, val)
            elif isinstance(val, list):
                val = [fn_tensor(f.name, t) for t in val]
            elif isinstance(val, MemoryState):
                val = val._map(fn_tensor)
            values[f.name] = val
        return type(self)(**values)

    @property
    def batch_size(self) -> int:
        return int(self.length.shape[0])

    def detach(self) -> MemoryState:
        return self._map(lambda _, t: t.detach())

    def contiguous(self) -> MemoryState:
        """Every tensor in the contiguous layout (a copy only where it is not)."""
        return self._map(lambda _, t: t.contiguous())

    def select_rows(self, index: torch.Tensor) -> MemoryState:
        index = torch.as_tensor(index, dtype=torch.long, device=self.length.device)
        return self._map(lambda _, t: t.index_select(0, index))

    @staticmethod
    def concat_rows(states: list[MemoryState]) -> MemoryState:
        """The rows of `states`, in order, as one state: e.g. the per-rank memories of a
        checkpoint joined before they are split over another number of ranks. The states
        must come from the same step (every tensor is batch-first; cache widths agree)."""
        first = states[0]
        if any(type(s) is not type(first) for s in states):
            raise ValueError(f"cannot join memories of kinds {sorted({s.kind for s in states})}")
        values = {}
        for f in fields(first):
            vals = [getattr(s, f.name) for s in states]
            if isinstance(vals[0], torch.Tensor):
                values[f.name] = torch.cat(vals, dim=0)
            elif isinstance(vals[0], list):
                values[f.name] = [torch.cat(per_entry, dim=0) for per_entry in zip(*vals,
                                                                                   strict=True)]
            elif isinstance(vals[0], MemoryState):
                values[f.name] = MemoryState.concat_rows(vals)
            else:
                values[f.name] = vals[0]  # None: absent in every state
        return type(first)(**values)

    def to(self, device=None, dtype=None) -> MemoryState:
        def move(name, t):
            if dtype is not None and t.is_floating_point():
                return t.to(device=device, dtype=torch.float32 if name in self.fp32_fields
                            else dtype)
            return t.to(device=device)
        return self._map(move)

    def reset_rows(self, mask: torch.Tensor) -> MemoryState:
        raise NotImplementedError

    def nbytes(self) -> int:
        total = 0
        for f in fields(self):
            val = getattr(self, f.name)
            items = val if isinstance(val, list) else [val]
            for t in items:
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
                elif isinstance(t, MemoryState):
                    total += t.nbytes()
        return total

    # -- serialisation ---------------------------------------------------------------------
    def state_dict(self) -> dict:
        out: dict = {"kind": self.kind}
        for f in fields(self):
            val = getattr(self, f.name)
            if isinstance(val, MemoryState):
                val = val.state_dict()
            elif isinstance(val, list):
                val = [t.detach().clone() for t in val]
            elif isinstance(val, torch.Tensor):
                val = val.detach().clone()
            out[f.name] = val
        return out

    @staticmethod
    def from_state_dict(data: dict) -> MemoryState:
        kind = data.get("kind")
        if kind not in _REGISTRY:
            raise ValueError(f"memory state_dict has unknown kind {kind!r}; expected one of "
                             f"{sorted(_REGISTRY)}")
        cls = _REGISTRY[kind]
        values = {}
        for f in fields(cls):
            if f.name not in data and f.name in cls.optional_fields:
                continue
            if f.name not in data:
                raise ValueError(f"{kind} memory state_dict lacks field {f.name!r}")
            val = data[f.name]
            if isinstance(val, dict) and "kind" in val:
                val = MemoryState.from_state_dict(val)
            values[f.name] = val
        return cls(**values)

    def load_state_dict(self, data: dict) -> None:
        """In-place load (torch convention); the kind and batch size must match."""
        other = MemoryState.from_state_dict(data)
        if type(other) is not type(self):
            raise ValueError(f"cannot load a {other.kind!r} memory into a {self.kind!r} one")
        if other.batch_size != self.batch_size:
            raise ValueError(f"memory batch size {other.batch_size} != {self.batch_size}")
        for f in fields(self):
            setattr(self, f.name, getattr(other, f.name))


def _reset_length(length: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask.to(length.device), torch.zeros_like(length), length)


def _zero_rows(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """t [B, ...] with the rows where mask [B] is True set to 0 (torch.where, so NaN/Inf in
    those rows are replaced, not multiplied)."""
    m = mask.to(t.device).view(-1, *([1] * (t.dim() - 1)))
    return torch.where(m, torch.zeros((), dtype=t.dtype, device=t.device), t)


@_register
@dataclass
class XLMemory(MemoryState):
    """Transformer-XL cache: per layer the last M inputs of that layer, stop-gradient.

    hids[l] is [B, M_now, d] (layer l's input, l = 0 being the embeddings); the top layer's
    output is not kept because nothing reads it (the XL code caches it anyway).
    """

    kind: ClassVar[str] = "xl"
    hids: list[torch.Tensor] = field(default_factory=list)
    length: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))

    @property
    def mem_len_now(self) -> int:
        return int(self.hids[0].shape[1]) if self.hids else 0

    def reset_rows(self, mask: torch.Tensor) -> XLMemory:
        # The cached inputs of a reset row are zeroed, not only its length: its keys are
        # masked, but a masked key still enters softmax(A) V with probability 0, and
        # 0 * NaN = NaN, so a NaN/Inf left in the cache (an fp16 overflow) would poison the
        # row for as long as the entry stays in the FIFO.
        return XLMemory(hids=[_zero_rows(h, mask) for h in self.hids],
                        length=_reset_length(self.length, mask))

    def appended(self, layer_inputs: list[torch.Tensor], mem_len: int) -> XLMemory:
        """FIFO update m_{τ+1}^l = SG([m_τ^l ∘ h_τ^l])[-M:] for every layer (Transformer-XL
        §3.2)."""
        n_new = layer_inputs[0].shape[1]
        old = self.hids or [None] * len(layer_inputs)
        hids = [_fifo(m, h, mem_len) for m, h in zip(old, layer_inputs, strict=True)]
        return XLMemory(hids=hids, length=(self.length + n_new).clamp(max=mem_len))


@_register
@dataclass
class LaMemoMemory(MemoryState):
    """LaMemo state (LaMemo Eq. 10-11 and Appendix A; model/mechanisms/lamemo/core.py): cached
    embeddings plus, per layer, the memory's context vectors C_mem [B, M, H, dh] (before W_o) and
    log-normalisers logS_mem [B, M, H] (fp32)."""

    kind: ClassVar[str] = "lamemo"
    fp32_fields: ClassVar[tuple[str, ...]] = ("log_norm",)
    emb: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    context: list[torch.Tensor] = field(default_factory=list)
    log_norm: list[torch.Tensor] = field(default_factory=list)
    length: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))

    @property
    def mem_len_now(self) -> int:
        return int(self.emb.shape[1])

    def reset_rows(self, mask: torch.Tensor) -> LaMemoMemory:
        # Invalid entries must stay finite: masked keys get probability 0, and 0 * NaN is NaN.
        # log_norm = -inf makes α = 0 for them, C = 0 keeps every product finite, and the
        # cached embeddings are zeroed too: every layer's memory keys and values, and the
        # look-ahead queries of the memory rows, are recomputed from them (Eq. 7-9).
        m = mask.to(self.length.device)
        ctx = [torch.where(m[:, None, None, None], torch.zeros_like(c), c) for c in self.context]
        lns = [torch.where(m[:, None, None], torch.full_like(s, float("-inf")), s)
               for s in self.log_norm]
        return LaMemoMemory(emb=_zero_rows(self.emb, mask), context=ctx, log_norm=lns,
                            length=_reset_length(self.length, mask))


@_register
@dataclass
class RMTMemory(MemoryState):
    """RMT state: m memory tokens [B, m, d] (NOT detached: the caller sets the BPTT depth),
    a per-row `fresh` flag (True = use the learned initial memory at the next segment), and
    optionally the XL cache of the Tr-XL + RMT combination (§3.4)."""

    kind: ClassVar[str] = "rmt"
    tokens: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    fresh: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))
    cache: XLMemory | None = None

    @property
    def length(self) -> torch.Tensor:  # rows, for the generic batch_size / select_rows
        return self.fresh

    def reset_rows(self, mask: torch.Tensor) -> RMTMemory:
        m = mask.to(self.fresh.device)
        cache = self.cache.reset_rows(mask) if self.cache is not None else None
        return RMTMemory(tokens=self.tokens, fresh=self.fresh | m, cache=cache)

    def select_rows(self, index: torch.Tensor) -> RMTMemory:
        index = torch.as_tensor(index, dtype=torch.long, device=self.fresh.device)
        cache = self.cache.select_rows(index) if self.cache is not None else None
        return RMTMemory(tokens=self.tokens.index_select(0, index),
                         fresh=self.fresh.index_select(0, index), cache=cache)
