"""LaMemo (Ji et al. 2022) as a registered mechanism: its options (`model.lamemo`) and their
validation; the forward is model/mechanisms/lamemo/core.py."""

from __future__ import annotations

from ...memory import LaMemoMemory
from ...registry import Mechanism, register
from ...typed import ConfigError
from .options import POS_ENCS, LaMemoOptions


@register
class LaMemo(Mechanism):
    name = "lamemo"
    section = "lamemo"
    options = LaMemoOptions
    state = LaMemoMemory
    # α per layer against memory index (LaMemo Fig. 6) beside the causal branch's distances.
    analyses = ("distance", "alpha")

    def validate(self, cfg) -> None:
        o = cfg.lamemo
        if o.eps <= 0:
            raise ConfigError("model.lamemo.eps", f"must be > 0, got {o.eps}")
        if o.pos_enc not in POS_ENCS:
            raise ConfigError("model.lamemo.pos_enc", f"unknown {o.pos_enc!r}; choose "
                              "'disentangled' or 'xl'")

    def check_lengths(self, cfg, mem_len, clamp_len, same_length, section) -> None:
        if mem_len == 0:
            raise ConfigError(f"{section}.mem_len", "LaMemo refreshes a memory; mem_len must "
                              "be > 0 (use mechanism 'xl' with mem_len 0 for the no-memory "
                              "baseline)")

    def core_class(self, cfg) -> type:
        if not cfg.lamemo.look_ahead:
            # LaMemo Table 3 "w/o look-ahead": only C→, which is exactly Transformer-XL.
            from ..xl.core import TransformerXL
            return TransformerXL
        from .core import LaMemo as Core
        return Core
