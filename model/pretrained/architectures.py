"""Where the parts of one decoder layer are, per transformers `model_type`, for the GPU-memory
planner (shapes.py): the one thing about an architecture that cannot be read from the
model, since the planner states what autograd keeps module by module.

Everything the wrapper itself needs (how positions enter, what the forward does to the
logits, sliding windows, a mixture-of-experts router) is read from the config and checked
on the loaded model (traits.py, probe.py): any decoder-only causal LM that passes is
trained, listed here or not. Imports nothing heavy: the planner's shape step reads it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Experts:
    """Where a sparse mixture-of-experts feed-forward block's parts are (transformers 5.24's
    fused experts: one [E, 2I, d] `gate_up_proj` and one [E, d, I] `down_proj` parameter per
    layer, routed top-k per token; Shazeer et al. 2017, §2.1), as module names inside the
    decoder layer, and how its router weighs the chosen experts."""

    router: str                    # a linear [E, d] router (its `weight`)
    experts: str                   # the fused experts module
    size_field: str                # the config field of an expert's intermediate size I
    # The top-k probabilities renormalised to sum to 1 (an in-place division that keeps
    # the quotient and the sum): always (True), or as this config field says.
    renormalise: bool | str
    fp32_weights: bool             # the routing weights stay float32 (else the model dtype)
    shared: tuple[str, ...] = ()   # a shared dense SwiGLU expert: gate, up, down projections
    shared_gate: str = ""          # its sigmoid gate, a [1, d] linear
    shared_field: str = ""         # the config field of its intermediate size


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
    moe: Experts | None = None     # the feed-forward block is a mixture of experts


LLAMA = Layout("rms", "input_layernorm", ("self_attn.q_proj", "self_attn.k_proj",
                                          "self_attn.v_proj"), "self_attn.o_proj",
               "post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp.down_proj",
               gated=True, layers="layers", act_field="hidden_act", final_norm="norm",
               embeddings=("embed_tokens",), dropouts=("", ""))
GPT2 = Layout("layer", "ln_1", ("attn.c_attn",), "attn.c_proj", "ln_2", ("mlp.c_fc",),
              "mlp.c_proj", gated=False, layers="h", act_field="activation_function",
              final_norm="ln_f", embeddings=("wte", "wpe"), dropouts=("resid_pdrop", "embd_pdrop"))

# Mixtral (Jiang et al. 2024, §2.1): the Llama layer with E SwiGLU experts, top-k routing
# weights renormalised in float32. Qwen2-MoE: the same with the renormalisation a config
# switch, weights cast back to the model dtype, and a shared SwiGLU expert beside the routed
# ones, scaled by sigmoid(shared_expert_gate(x)).
_MOE_FFN = dict(ffn_in=(), ffn_out="")
MIXTRAL = dataclasses.replace(LLAMA, **_MOE_FFN, moe=Experts(
    "mlp.gate", "mlp.experts", "intermediate_size", renormalise=True, fp32_weights=True))
QWEN2_MOE = dataclasses.replace(LLAMA, **_MOE_FFN, moe=Experts(
    "mlp.gate", "mlp.experts", "moe_intermediate_size", renormalise="norm_topk_prob",
    fp32_weights=False, shared=("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj",
                                "mlp.shared_expert.down_proj"),
    shared_gate="mlp.shared_expert_gate", shared_field="shared_expert_intermediate_size"))


# The model types whose decoder layer the planner knows; every other architecture trains
# (traits.py, probe.py) but `memtrain plan` refuses it by name. The mixtures of experts
# are kept apart: model FLOPs count every weight of a model type in LAYOUTS as a row's
# (model/backbones/pretrained.py), an expert's only at the top-k of E share a row passes
# through (model/pretrained/flops.py).
LAYOUTS = {"gpt2": GPT2, "llama": LLAMA, "mistral": LLAMA, "qwen2": LLAMA}
MOE_LAYOUTS = {"mixtral": MIXTRAL, "qwen2_moe": QWEN2_MOE}


def planned() -> list[str]:
    """The dense architectures whose segment shapes the planner states."""
    return sorted(LAYOUTS)


def layout_of(model_type: str) -> Layout | None:
    """The planner's layout of a model type, dense or mixture of experts (None: none)."""
    return LAYOUTS.get(model_type) or MOE_LAYOUTS.get(model_type)
