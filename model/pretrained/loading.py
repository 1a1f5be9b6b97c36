"""Load a pretrained causal LM: its shape into ModelConfig, its weights, how it trains.

A local directory (what `save_pretrained` writes, or a GGUF file inside one) loads with no
network; any other `model.hf.path` is a hub name, which transformers resolves through its
cache and, unless HF_HUB_OFFLINE=1, the network.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import torch

from ..config import ConfigError
from .positions import max_position, position_kind

# ModelConfig field -> how it is read from a transformers config.
_SHAPE = {
    "vocab_size": lambda c: c.vocab_size,
    "d_model": lambda c: c.hidden_size,
    "n_layer": lambda c: c.num_hidden_layers,
    "n_head": lambda c: c.num_attention_heads,
    "d_head": lambda c: getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
    "d_inner": lambda c: (getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None)
                          or 4 * c.hidden_size),
}


def _source(opts) -> dict:
    """from_pretrained arguments naming the checkpoint (ConfigError if it cannot exist)."""
    if not opts.path:
        raise ConfigError("model.hf.path", "a pretrained backbone needs the path of a "
                          "checkpoint directory or a hub name")
    local = Path(opts.path).expanduser()
    kwargs: dict = {"pretrained_model_name_or_path": opts.path}
    if local.is_dir():
        kwargs.update(pretrained_model_name_or_path=str(local), local_files_only=True)
    elif opts.path.startswith((".", "/", "~")) or local.exists():
        raise ConfigError("model.hf.path", f"{opts.path} is not a directory (a local "
                          "checkpoint is the directory save_pretrained writes)")
    if opts.revision:
        kwargs["revision"] = opts.revision
    if opts.gguf_file:
        kwargs["gguf_file"] = opts.gguf_file
    return kwargs


@functools.lru_cache(maxsize=8)
def _hf_config(path: str, revision: str, gguf_file: str):
    from transformers import AutoConfig
    opts = type("Opts", (), {"path": path, "revision": revision, "gguf_file": gguf_file})
    try:
        return AutoConfig.from_pretrained(**_source(opts))
    except (OSError, ValueError) as err:
        raise ConfigError("model.hf.path", f"cannot read the config of {path!r}: "
                          f"{str(err).splitlines()[0]}") from err


def hf_config(opts):
    """The transformers config of `model.hf` (read once per process)."""
    return _hf_config(opts.path, opts.revision, opts.gguf_file)


def resolve_shape(cfg) -> None:
    """Fill ModelConfig's shape fields from the checkpoint's config. A field the user set to
    another value than the checkpoint's is refused by name (nothing is overridden silently);
    a segment that would run past a learned position table is refused too."""
    hf = hf_config(cfg.hf)
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    for name, read in _SHAPE.items():
        value = int(read(hf))
        given = getattr(cfg, name)
        if given not in (defaults[name], value):
            raise ConfigError(f"model.{name}", f"is read from the pretrained config "
                              f"({value}); remove it from the config (got {given})")
        setattr(cfg, name, value)
    kind = position_kind(hf)
    limit = getattr(hf, "max_position_embeddings", None)
    need = max_position(cfg.rmt.num_mem_tokens, cfg.tgt_len)
    if kind == "absolute" and limit is not None and need > limit:
        raise ConfigError("model.tgt_len", f"2 x num_mem_tokens + tgt_len = {need} positions, "
                          f"beyond the model's learned table of {limit}")


def load_base(cfg, dtype: torch.dtype = torch.float32):
    """The pretrained AutoModelForCausalLM of `cfg.hf`, in `dtype`, with no KV cache."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # one bar per load floods every rank's log
    try:
        model = AutoModelForCausalLM.from_pretrained(
            **_source(cfg.hf), dtype=dtype, attn_implementation=cfg.hf.attn_implementation)
    except (OSError, ValueError) as err:
        raise ConfigError("model.hf.path", f"cannot load {cfg.hf.path!r}: "
                          f"{str(err).splitlines()[0]}") from err
    model.config.use_cache = False
    return model


def apply_finetune(base, opts) -> None:
    """Which base weights train (`model.hf.finetune`), in place: all of them; none
    ("frozen"); or low-rank adapters that peft injects into the base model's own modules
    ("lora", Hu et al. 2021), the base frozen. The memory parameters are not in `base`:
    they always train."""
    if opts.finetune == "full":
        return
    if opts.finetune == "lora":
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
