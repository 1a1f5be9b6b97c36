"""Load a pretrained causal LM's weights (and tokenizer), and decide which of them train.
"""

from __future__ import annotations

import torch

from memtrain.extras import missing_extra

from ..typed import ConfigError
from .activations import fuse_gelu
from .checkpoint_config import _source


def load_base(cfg, dtype: torch.dtype = torch.float32):
    """The pretrained AutoModelForCausalLM of `cfg.hf`, in `dtype`, with no KV cache; a
    `gelu_new` activation runs fused unless `model.hf.fused_gelu` is false
    (activations.py)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # one bar per load floods every rank's log
    source = _source(cfg.hf)   # its ConfigError names its own field
    try:
        model = AutoModelForCausalLM.from_pretrained(
            **source, dtype=dtype, attn_implementation=cfg.hf.attn_implementation)
    except (OSError, ValueError) as err:
        raise ConfigError("model.hf.path", f"cannot load {cfg.hf.path!r}: "
                          f"{str(err).splitlines()[0]}") from err
    model.config.use_cache = False
    fuse_gelu(model, cfg.hf)
    return model


def apply_finetune(base, opts) -> None:
    """Which base weights train (`model.hf.finetune`), in place: all of them; none
    ("frozen"); or low-rank adapters that peft injects into the base model's own modules
    ("lora", Hu et al. 2021), the base frozen. The memory parameters are not in `base`:
    they always train."""
    if opts.finetune == "full":
        return
    if opts.finetune == "lora":
        problem = missing_extra("lora")
        if problem:
            raise ConfigError("model.hf.finetune", problem)
        from peft import LoraConfig, inject_adapter_in_model
        lora = LoraConfig(r=opts.lora_r, lora_alpha=opts.lora_alpha,
                          lora_dropout=opts.lora_dropout, bias="none",
                          target_modules=list(opts.lora_targets) or None,
                          task_type="CAUSAL_LM")
        if lora.target_modules is None:
            from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
            targets = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(
                base.config.model_type)
            if targets is None:
                raise ConfigError("model.hf.lora_targets", f"peft has no default adapter "
                                  f"targets for {base.config.model_type!r}; name the modules")
            lora.target_modules = set(targets)
        inject_adapter_in_model(lora, base)
    for name, p in base.named_parameters():
        p.requires_grad_(opts.finetune == "lora" and "lora_" in name)


def load_tokenizer(opts):
    """The checkpoint's own tokenizer (for `memtrain prepare` / `memtrain tasks`)."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(**_source(opts))
