"""Transformer-XL (Dai et al. 2019) as a registered mechanism: no options of its own (its
lengths are `model.mem_len`, `clamp_len`, `same_length`); the forward is
model/mechanisms/xl/core.py. mem_len 0 is the no-memory baseline."""

from __future__ import annotations

from ...memory import XLMemory
from ...registry import Mechanism, register


@register
class XL(Mechanism):
    name = "xl"
    state = XLMemory

    def core_class(self, cfg) -> type:
        from .core import TransformerXL
        return TransformerXL
