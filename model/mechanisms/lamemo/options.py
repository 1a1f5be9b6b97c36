"""LaMemo's options, `model.lamemo` (a field of model/config.py `ModelConfig`): the
dataclass alone, so that the config can declare it without importing the mechanism."""

from __future__ import annotations

from dataclasses import dataclass

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
