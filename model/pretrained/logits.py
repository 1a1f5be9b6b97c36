"""The logits a pretrained causal LM's own forward makes of its last hidden states, and a
load-time check that the wrapper makes the same.

The wrapper runs the base model's decoder stack itself (`base.base_model`) and applies the
head itself, so whatever the architecture's `*ForCausalLM.forward` does to the logits after
the head must be done here too: the `logits` of its entry in architectures.py (of the
architectures listed there, in transformers 5.24 only Granite does anything; the others
return the head's output as is). An architecture that post-processes in a way not listed
here is caught when the model is built (`check_logits`), rather than trained on wrong
logits.
"""

from __future__ import annotations

import torch

from ..typed import ConfigError
from .architectures import ARCHITECTURES

PROBE_TOKENS = 4
# The two paths run the same modules on the same input, so they agree to the last bit in
# practice; the tolerance only absorbs kernel choices (a different fused path for one of
# them), far below any rescaling of the logits.
_RTOL = 1e-3


def lm_logits(base, hidden: torch.Tensor, head_out: torch.Tensor | None = None
              ) -> torch.Tensor:
    """The logits `base`'s own forward computes from `hidden` (its decoder's last hidden
    states after the final norm): the output head, then the architecture's post-processing.
    `head_out`: the head's output already computed (by the loss's padded GEMM,
    model/loss.py), to which only the post-processing is applied."""
    logits = base.get_output_embeddings()(hidden) if head_out is None else head_out
    arch = ARCHITECTURES.get(base.config.model_type)
    post = arch.logits if arch is not None else None
    return post(logits, base.config) if post is not None else logits


@torch.no_grad()
def check_logits(base) -> None:
    """Refuse (ConfigError on model.hf.path, naming the architecture) a base model whose own
    forward gives other logits than the wrapper's path with no memory tokens: the decoder
    stack on the token embeddings, then `lm_logits`. Runs PROBE_TOKENS tokens in eval mode.
    Skipped when the input embeddings hold no values: a ZeRO-3 sharded load (no elements
    on this rank) or a shapes-only model on the meta device."""
    weight = base.get_input_embeddings().weight
    if weight.numel() == 0 or weight.is_meta:
        return
    ids = (torch.arange(PROBE_TOKENS, device=weight.device) % base.config.vocab_size)[None]
    was_training = base.training
    base.eval()
    try:
        hidden = base.base_model(inputs_embeds=base.get_input_embeddings()(ids),
                                 use_cache=False)[0]
        ours = lm_logits(base, hidden).float()
        theirs = base(input_ids=ids, use_cache=False).logits.float()
    finally:
        base.train(was_training)
    same_shape = ours.shape == theirs.shape
    err = float((ours - theirs).abs().max()) if same_shape else float("inf")
    scale = float(theirs.abs().max())
    if not err <= _RTOL * scale:
        raise ConfigError("model.hf.path", f"{base.config.model_type!r} post-processes its "
                          f"logits in a way the wrapper does not reproduce (its forward's "
                          f"logits differ from the head's by up to {err:.3g}, largest logit "
                          f"{scale:.3g}); model/pretrained/logits.py lists what is reproduced")
