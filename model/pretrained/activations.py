"""The tanh-approximated GELU of a pretrained checkpoint run as one fused kernel.

GPT-2 and its relatives (gpt_neo, gpt_bigcode, ...) name their activation `gelu_new`:
Hendrycks & Gimpel's tanh approximation of GELU (arXiv:1606.08415, §2),

    gelu(x) ~ 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))

which transformers' `NewGELUActivation` evaluates in Python, one aten op at a time: 8
full-size elementwise kernels in the forward and more in the backward, each tensor
[B, Q, 4d] read from and written to memory. `torch.nn.functional.gelu(x,
approximate="tanh")` is the same formula in one kernel each way (transformers calls it
`gelu_pytorch_tanh`, class `GELUTanh`); the two differ by float rounding only
(tests/test_pretrained_fused.py holds the logits to 1e-5 relative in fp32; BENCHMARKS.md,
"Pretrained backbone: fused activation and regional compile", counts the ops).

`model.hf.fused_gelu` (default true) swaps the modules at load; false keeps the checkpoint's
own Python activation. The checkpoint's config is left as it is (an export writes the
config it read); `effective_activation` is what runs, which the planner counts.
"""

from __future__ import annotations

from torch import nn

ORIGINAL, FUSED = "gelu_new", "gelu_pytorch_tanh"
ACT_FIELDS = ("activation_function", "hidden_act")   # GPT-2's family, Llama's family


def _gelu_new_fields(hf_config) -> list[str]:
    return [f for f in ACT_FIELDS if getattr(hf_config, f, None) == ORIGINAL]


def effective_activation(hf_config, field: str, opts) -> str:
    """The activation that runs for the config field `field` of `hf_config`, under the
    options `opts` (PretrainedOptions)."""
    act = getattr(hf_config, field)
    return FUSED if act == ORIGINAL and opts.fused_gelu else act


def fuse_gelu(base: nn.Module, opts) -> int:
    """Replace every `NewGELUActivation` module of `base` by transformers' fused
    `GELUTanh`, if `opts.fused_gelu` and the config names `gelu_new`; returns how many were
    replaced (and says so on stdout, once per process)."""
    fields = _gelu_new_fields(base.config)
    if not opts.fused_gelu or not fields:
        return 0
    from transformers.activations import GELUTanh, NewGELUActivation
    swapped = 0
    for module in base.modules():
        for name, child in module.named_children():
            # type(), not isinstance: a subclass may compute something else.
            if type(child) is NewGELUActivation:
                setattr(module, name, GELUTanh())
                swapped += 1
    if _first_rank():
        where = ", ".join(f"{f}: {ORIGINAL}" for f in fields)
        if swapped:
            print(f"memtrain: the checkpoint's activation ({where}) runs as the fused "
                  f"{FUSED} (the same tanh approximation, one kernel; {swapped} modules); "
                  "model.hf.fused_gelu=false keeps the original", flush=True)
        else:
            print(f"memtrain: the checkpoint names {where}, but {type(base).__name__} has no "
                  "NewGELUActivation module to replace: its activation runs as written",
                  flush=True)
    return swapped


def _first_rank() -> bool:
    import torch.distributed as dist
    return not dist.is_initialized() or dist.get_rank() == 0
