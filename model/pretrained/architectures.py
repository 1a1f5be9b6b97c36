"""Where the parts of one decoder layer are, per transformers `model_type`, for the GPU-memory
planner (shapes.py): the one thing about an architecture that cannot be read from the
model, since the planner states what autograd keeps module by module.

Everything the wrapper itself needs (how positions enter, what the forward does to the
logits, sliding windows, a mixture-of-experts router) is read from the config and checked
on the loaded model (traits.py, probe.py): any decoder-only causal LM that passes is
trained, listed here or not. Imports nothing heavy: the planner's shape step reads it.
"""

from __future__ import annotations

from dataclasses import dataclass


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


# The model types whose decoder layer the planner knows; every other architecture trains
# (traits.py, probe.py) but `memtrain plan` refuses it by name.
LAYOUTS = {"gpt2": GPT2, "llama": LLAMA, "mistral": LLAMA, "qwen2": LLAMA}


def planned() -> list[str]:
    """The architectures whose segment shapes the planner states."""
    return sorted(LAYOUTS)
