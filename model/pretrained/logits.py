"""The logits a pretrained causal LM's own forward makes of its last hidden states.

The wrapper runs the base model's decoder stack itself (`base.base_model`) and applies the
head itself, so whatever the architecture's `*ForCausalLM.forward` does to the logits after
the head must be done here too: the steps traits.py reads from its config
(`logits_scaling`, `logit_scale`, `final_logit_softcapping`), with the operation the
load-time probe found its forward to do (probe.py: the steps are tried against the model's
own logits once, and a model whose logits none of them reproduce is refused by name rather
than trained on wrong logits).
"""

from __future__ import annotations

import torch

from .traits import traits_of

OPERATIONS = {
    "divide": lambda logits, v: logits / v,
    "multiply": lambda logits, v: logits * v,
    # Gemma 2/3 (modeling_gemma2.py): logits / cap, tanh, * cap.
    "softcap": lambda logits, v: torch.tanh(logits / v) * v,
}


def post_process(logits: torch.Tensor, steps) -> torch.Tensor:
    """`steps`: ((operation, value), ...) in order (traits.py `Traits.logits`)."""
    for op, value in steps:
        logits = OPERATIONS[op](logits, value)
    return logits


def lm_logits(base, hidden: torch.Tensor, head_out: torch.Tensor | None = None
              ) -> torch.Tensor:
    """The logits `base`'s own forward computes from `hidden` (its decoder's last hidden
    states after the final norm): the output head, then the architecture's post-processing.
    `head_out`: the head's output already computed (by the loss's padded GEMM,
    model/loss.py), to which only the post-processing is applied."""
    logits = base.get_output_embeddings()(hidden) if head_out is None else head_out
    return post_process(logits, traits_of(base).logits)
