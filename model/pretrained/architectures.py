"""The one table of the pretrained architectures memory tokens are placed in: for each
transformers `model_type`, everything the code needs to know of it.

- positions: how it encodes positions ("absolute": a learned table indexed by position id;
  "rotary": RoPE on queries and keys). Both accept explicit position ids, which is how the
  memory is placed (positions.py).
- inner: the config field of its feed-forward width (checkpoint_config.py reads the shape;
  an unset field means the GPT-2 convention, 4 x d_model).
- layout: where the parts of one decoder layer are, for the GPU-memory planner (shapes.py);
  None where the planner does not state its segment shapes yet.
- logits: what its `*ForCausalLM.forward` does to the head's output, which the wrapper must
  do too (logits.py; transformers 5.24, models/<model_type>/modeling_<model_type>.py: only
  Granite does anything, it divides by `config.logits_scaling`).

An architecture not in the table is refused by name (`architecture`), listing the ones it has.
Imports nothing heavy: ModelConfig's shape step reads it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..typed import ConfigError


@dataclass(frozen=True)
class Layout:
    """Where the parts of one decoder layer are, as module names inside the layer."""

    norm: str                      # "rms" (fp32 upcast) or "layer" (LayerNorm)
    attn_norm: str
    qkv: tuple[str, ...]           # projections reading the normalised layer input
    out: str
    ffn_norm: str
    ffn_in: tuple[str, ...]        # gate and up (gated) or the first matmul
    ffn_out: str
    gated: bool                    # act(gate(x)) * up(x) (SwiGLU), or act(fc(x))
    layers: str                    # the base model's list of decoder layers
    act_field: str                 # the config field naming the activation
    final_norm: str                # module names inside the base model
    embeddings: tuple[str, ...]
    dropouts: tuple[str, str]      # config fields: residual dropout, embedding dropout


LLAMA = Layout("rms", "input_layernorm", ("self_attn.q_proj", "self_attn.k_proj",
                                          "self_attn.v_proj"), "self_attn.o_proj",
               "post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp.down_proj",
               gated=True, layers="layers", act_field="hidden_act", final_norm="norm",
               embeddings=("embed_tokens",), dropouts=("", ""))
GPT2 = Layout("layer", "ln_1", ("attn.c_attn",), "attn.c_proj", "ln_2", ("mlp.c_fc",),
              "mlp.c_proj", gated=False, layers="h", act_field="activation_function",
              final_norm="ln_f", embeddings=("wte", "wpe"), dropouts=("resid_pdrop", "embd_pdrop"))


@dataclass(frozen=True)
class Architecture:
    positions: str                         # "absolute" or "rotary"
    inner: str                             # config field of d_inner
    layout: Layout | None = None           # planned (shapes.py) or not
    logits: Callable | None = None         # (logits, config) -> the forward's logits


_ROTARY = Architecture("rotary", "intermediate_size")
ARCHITECTURES = {
    "gpt2": Architecture("absolute", "n_inner", GPT2),
    "gpt_neo": Architecture("absolute", "intermediate_size"),
    "gpt_bigcode": Architecture("absolute", "n_inner"),
    "llama": Architecture("rotary", "intermediate_size", LLAMA),
    "mistral": Architecture("rotary", "intermediate_size", LLAMA),
    "qwen2": Architecture("rotary", "intermediate_size", LLAMA),
    "qwen3": _ROTARY, "smollm3": _ROTARY, "gpt_neox": _ROTARY, "olmo": _ROTARY,
    "olmo2": _ROTARY, "phi3": _ROTARY,
    "granite": Architecture("rotary", "intermediate_size",
                            logits=lambda logits, config: logits / config.logits_scaling),
}


def architecture(hf_config) -> Architecture:
    """The table's entry for a transformers config, or a ConfigError on model.hf.path naming
    the supported architectures; also refused: a config that post-processes its logits in a
    way the entry does not state."""
    arch = ARCHITECTURES.get(hf_config.model_type)
    if arch is None:
        raise ConfigError("model.hf.path", f"architecture {hf_config.model_type!r} is not "
                          f"supported for memory tokens (its position policy is unstated); "
                          f"supported: {', '.join(sorted(ARCHITECTURES))}")
    for name in ("final_logit_softcapping", "logit_scale"):
        if getattr(hf_config, name, None):
            raise ConfigError("model.hf.path", f"{hf_config.model_type!r} post-processes its "
                              f"logits ({name}), which the wrapper does not reproduce")
    return arch


def planned() -> list[str]:
    """The architectures whose segment shapes the planner states."""
    return sorted(name for name, arch in ARCHITECTURES.items() if arch.layout is not None)
