"""Load a pretrained causal LM's weights (and tokenizer), and decide which of them train.
"""

from __future__ import annotations

import logging
import pickle

import torch
from safetensors import SafetensorError

from memtrain.extras import missing_extra

from ..typed import ConfigError
from .activation_recompute import recompute_activations
from .activations import fuse_gelu
from .checkpoint_config import _source, checked_dir

log = logging.getLogger(__name__)
_said_eager: set[str] = set()


def load_base(cfg, dtype: torch.dtype = torch.float32):
    """The pretrained AutoModelForCausalLM of `cfg.hf`, in `dtype`, with no KV cache; a
    `gelu_new` activation runs fused unless `model.hf.fused_gelu` is false
    (activations.py), and the MLP's activation is recomputed in backward unless
    `model.hf.recompute_activation` is false (activation_recompute.py)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # one bar per load floods every rank's log
    source = _source(cfg.hf)   # its ConfigError names its own field
    if source.get("local_files_only"):
        checked_dir(cfg.hf)
    # An architecture with no SDPA path in transformers (GPT-Neo, Gemma 2) runs the eager
    # attention, said once per architecture in the log.
    impl = cfg.hf.attn_implementation
    if impl == "sdpa" and not _has_sdpa(source):
        impl = "eager"
    try:
        model = AutoModelForCausalLM.from_pretrained(**source, dtype=dtype,
                                                     attn_implementation=impl)
    except (OSError, ValueError, KeyError, IndexError, EOFError, SafetensorError,
            pickle.UnpicklingError) as err:
        # The others than OSError and ValueError: weights files that do not read (a
        # pytorch_model.bin that is not a torch file, a safetensors file cut short).
        raise ConfigError("model.hf.path", f"cannot load {cfg.hf.path!r}: "
                          f"{(str(err).splitlines() or [type(err).__name__])[0]}") from err
    model.config.use_cache = False
    training_activations(model, cfg.hf)
    return model


def training_activations(base, opts) -> None:
    """The activations of `base` as training runs them, in place: a `gelu_new` fused
    (activations.py), the MLP's activation output recomputed in backward
    (activation_recompute.py), each unless its option says no."""
    fuse_gelu(base, opts)
    recompute_activations(base, opts)


def _has_sdpa(source: dict) -> bool:
    """Whether the checkpoint's model class has an SDPA path (its `_supports_sdpa`, without
    which from_pretrained refuses "sdpa"); logs the fallback to eager once."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    try:
        config = AutoConfig.from_pretrained(**source)
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except (OSError, ValueError, KeyError):
        return True         # from_pretrained says what is wrong
    if getattr(cls, "_supports_sdpa", True):
        return True
    if config.model_type not in _said_eager:
        _said_eager.add(config.model_type)
        log.warning("%s has no SDPA attention in transformers: it runs the eager attention "
                    "(model.hf.attn_implementation 'sdpa' falls back)", cls.__name__)
    return False


def _lora_targets(base, names: list[str]) -> tuple[list[str], list[str]]:
    """(target modules, target parameters) of `model.hf.lora_targets`: a name that ends a
    parameter's name (e.g. Mixtral's fused experts, `experts.gate_up_proj`, one [E, 2I, d]
    tensor, no nn.Linear per expert) is adapted as a parameter (peft's
    `target_parameters`); the others name modules."""
    params = [n for n, _ in base.named_parameters()]
    is_param = lambda t: any(n == t or n.endswith("." + t) for n in params)  # noqa: E731
    return [t for t in names if not is_param(t)], [t for t in names if is_param(t)]


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
        modules, parameters = _lora_targets(base, list(opts.lora_targets))
        lora = LoraConfig(r=opts.lora_r, lora_alpha=opts.lora_alpha,
                          lora_dropout=opts.lora_dropout, bias="none",
                          target_modules=modules or ([] if parameters else None),
                          target_parameters=parameters or None, task_type="CAUSAL_LM")
        if lora.target_modules is None:
            from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
            targets = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(
                base.config.model_type)
            if targets is None:
                raise ConfigError("model.hf.lora_targets", f"peft has no default adapter "
                                  f"targets for {base.config.model_type!r}; name the modules")
            lora.target_modules = set(targets)
        try:
            inject_adapter_in_model(lora, base)
        except ValueError as err:
            raise ConfigError("model.hf.lora_targets", f"{str(err).splitlines()[0]} (a "
                              "mixture-of-experts model's fused expert weights are adapted "
                              "by naming the parameters, e.g. 'experts.gate_up_proj', "
                              "'experts.down_proj')") from None
    for name, p in base.named_parameters():
        p.requires_grad_(opts.finetune == "lora" and "lora_" in name)


def load_tokenizer(opts):
    """The checkpoint's own tokenizer (for `memtrain prepare` / `memtrain tasks`)."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(**_source(opts))
