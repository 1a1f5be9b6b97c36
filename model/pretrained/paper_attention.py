"""RMT's "paper" pattern around a pretrained decoder as three maskless attention calls.

The pattern (Bulatov et al. 2022, §3; positions.py) over the rows [read | tokens | write],
N = 2m + L:
- a read row attends to the whole read block;
- a token row attends to the read block and to the tokens up to itself;
- a write row attends to every row.

As one boolean [N, N] mask, an attention kernel computes every tile: a flash kernel cannot
skip tiles it does not know to be empty, so the tokens' upper triangle (about half the
work at L >> m) is computed and thrown away. Written instead as

    tokens: causal attention of [read; tokens] over [read; tokens] (square, so `is_causal`
            is exactly "the read block, then the tokens up to itself"), its last L rows;
    read:   the m read rows over the read block, no mask;
    write:  the m write rows over all N rows, no mask;

every call is one a flash kernel runs without a mask, skipping the causal upper triangle
(cuDNN / FlashAttention on CUDA, the flash kernel of the CPU). The work is m^2 + (m+L)^2/2
+ m N score entries against N^2 (L 1,024, m 16: 0.50 of the mask's); the result is the
masked softmax's, to rounding (tests/test_paper_attention.py: against the masked softmax
written from the definition, and through decoders against the mask path).

It runs as a transformers attention function under a name registered per m, set on the
config only for the body of one forward (`paper_attention`), like positions.py's
SDPA_CAUSAL. The boolean mask is still passed: a layer re-run outside that forward would
read it under "sdpa" and compute the same pattern. Where the split does not apply, the
mask path runs as before: the eager kernel, models that build their own masks (traits.py
`attention` "mask"), and under `model.checkpoint_layers`, whose re-run of each layer in
backward happens outside the forward (the split's rounding there would differ from the
forward's).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from .positions import memory_attention_mask
from .traits import traits_of

MODES = ("split", "mask")


def split_paper_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          m: int, dropout: float = 0.0, scale: float | None = None,
                          enable_gqa: bool = False) -> torch.Tensor:
    """Attention [B, H, N, D] of the "paper" pattern over rows [read (m) | tokens | write
    (m)] in three maskless calls (module docstring). key/value [B, H_kv, N, D]."""
    n = query.shape[-2]
    first = n - m                                          # read + tokens
    kw = dict(dropout_p=dropout, scale=scale, enable_gqa=enable_gqa)
    tokens = F.scaled_dot_product_attention(query[:, :, :first], key[:, :, :first],
                                            value[:, :, :first], is_causal=True, **kw)
    read = F.scaled_dot_product_attention(query[:, :, :m], key[:, :, :m], value[:, :, :m],
                                          **kw)
    write = F.scaled_dot_product_attention(query[:, :, first:], key, value, **kw)
    return torch.cat([read, tokens[:, :, m:], write], dim=2)


def _attention_function(m: int):
    def forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                scaling: float | None = None, **kwargs):
        for name in ("softcap", "position_bias", "s_aux"):
            if kwargs.get(name) is not None:
                raise ValueError(f"model.hf.paper_attention 'split': this model's attention "
                                 f"adds {name}, which the split does not apply; set "
                                 "model.hf.paper_attention=mask")
        groups = getattr(module, "num_key_value_groups", 1)
        out = split_paper_attention(query, key, value, m, dropout, scaling,
                                    enable_gqa=groups > 1)
        return out.transpose(1, 2).contiguous(), None
    return forward


def _registered(m: int) -> str:
    from transformers import AttentionInterface
    name = f"memtrain_rmt_paper_{m}"
    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, _attention_function(m))
    return name


def splits(base, mode: str, checkpoint_layers: bool) -> bool:
    """Whether the "paper" forward of `base` runs as the split (module docstring)."""
    return (mode == "split" and not checkpoint_layers
            and base.config._attn_implementation == "sdpa"
            and traits_of(base).attention == "interface")


@contextmanager
def paper_attention(base, m: int, n_tok: int, dtype: torch.dtype, device, split: bool
                    ) -> Iterator[torch.Tensor]:
    """For one forward of `base` over [read | tokens | write]: yields the mask to pass;
    with `split`, the config's attention implementation is the split for the body of the
    with-block."""
    config = base.config
    impl = config._attn_implementation
    mask = memory_attention_mask(m, n_tok, dtype, impl, device, "paper")
    if not split:
        yield mask
        return
    config._attn_implementation = _registered(m)
    try:
        yield mask
    finally:
        config._attn_implementation = impl
