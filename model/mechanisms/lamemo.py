"""LaMemo (Ji et al. 2022) as a registered mechanism: its options (`model.lamemo`) and their
validation; the forward is model/lamemo.py."""

from __future__ import annotations

from dataclasses import dataclass

from ..memory import LaMemoMemory
from ..typed import ConfigError
from .registry import Mechanism, register

POS_ENCS = ("disentangled", "xl")


@dataclass
class LaMemoOptions:
    """LaMemo (Ji et al. 2022) switches; the defaults are the paper's full model."""

    # ε in Eq. 11; the paper searched {1e-6, 1e-5, 1e-4}, the released code uses 1e-6.
    eps: float = 1e-6
    # Ablation "w/o mem interp" (Table 3): α = 0, so C↔ = C←.
    interpolate: bool = True
    # Ablation "w/o look-ahead" (Table 3): only C→, which is exactly Transformer-XL.
    look_ahead: bool = True
    # "disentangled" (§3.3, Eq. 12: R_|i-j| with v+ / v-) or "xl" (R_{i-j} with negative
    # distances, the ablation that fails to train in Table 3).
    pos_enc: str = "disentangled"


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
            from ..transformer_xl import TransformerXL
            return TransformerXL
        from ..lamemo import LaMemo as Core
        return Core
