"""What the memory wrapper needs to know of a pretrained causal LM, read from what it is
rather than from a list of names: first from its config (here, no model built, no heavy
import: ModelConfig's shape step reads it), then checked on the loaded model's own forward
(probe.py), which settles what a config cannot say.

- positions: how positions enter the forward.
    "absolute"  a learned table indexed by position id (GPT-2, OPT, GPT-Neo): a segment
                must fit in its rows (`table`);
    "rotary"    RoPE on queries and keys (Llama and most others): nothing to fit;
    "sequence"  the position ids have no effect: ALiBi biases built from the row order and
                the padding mask (Bloom, Falcon with `alibi`), or no position encoding.
                Memory positions are placed with position ids and a 4-D mask (positions.py),
                which such a model does not read: refused, naming the property.
  From the config: ALiBi flags, then any rotary field, then a position-table size, else
  "unknown"; the probe moves a model to what its forward does (shifted ids change
  nothing: relative; spaced ids change nothing either: "sequence").
- logits: what `*ForCausalLM.forward` does to the head's output (transformers 5.24,
  models/<type>/modeling_<type>.py): `logits_scaling` divides (Granite and its MoE and
  sliding-window kin; MiniCPM3 divides the hidden states, the same for a bias-free head) or
  multiplies (HyperCLOVA X: the probe tries both), `logit_scale` multiplies (Cohere,
  Cohere2), `final_logit_softcapping` caps as cap * tanh(logits / cap) (Gemma 2 and 3,
  VaultGemma, Nanochat).
- sliding_window: the width of the sliding-window layers whose window transformers builds
  into the attention mask (Mistral, Gemma 2/3, Qwen2 with use_sliding_window, EXAONE 4,
  Starcoder2, Phi-3: `config.sliding_window` with `layer_types` naming
  "sliding_attention", or no `layer_types` at all). The wrapper hands the decoder its own
  masks (positions.py), inside which no window slides, so a segment whose rows exceed the
  window is refused; within it a sliding window and a causal mask are the same. (GPT-Neo's
  local layers slide inside the attention module itself, whatever the mask: kept.)
- moe: a mixture-of-experts router (Mixtral, Qwen2/3-MoE, OLMoE, ...): how many experts,
  top-k, and whether the forward adds the load-balancing loss (its config's
  `output_router_logits`) with which weight (`router_aux_loss_coef`); router.py computes it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..typed import ConfigError

POSITION_KINDS = ("absolute", "rotary", "sequence", "unknown")
ROTARY_FIELDS = ("rope_parameters", "rotary_dim", "rotary_pct", "partial_rotary_factor",
                 "rope_theta", "rotary_emb_base")
# The config fields of the feed-forward width, in the order families name it; unset means
# the GPT-2 convention, 4 x d_model.
INNER_FIELDS = ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size")
# Post-processing of the head's output per config field: the operations its value may
# stand for, the first the default where the model cannot be run (module docstring).
LOGITS_FIELDS = {"logits_scaling": ("divide", "multiply"), "logit_scale": ("multiply",),
                 "final_logit_softcapping": ("softcap",)}
_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_TOP_K = ("num_experts_per_tok", "moe_topk", "moe_k", "top_k")
_AUX_COEF = ("router_aux_loss_coef", "aux_loss_coef")


@dataclass(frozen=True)
class MoE:
    experts: int
    top_k: int
    coef: float          # the load-balancing loss's weight in the forward's loss
    aux: bool            # the forward adds it (config `output_router_logits`)


@dataclass(frozen=True)
class Traits:
    model_type: str
    positions: str                          # POSITION_KINDS
    table: int                              # rows of a learned position table (0: none)
    logits: tuple[tuple[str, float], ...]   # (operation, value), applied in order
    sliding_window: int                     # 0: no mask-built window
    moe: MoE | None
    # Read off the loaded model (probe.py); the defaults where it cannot run.
    attention: str = "interface"            # "interface": SDPA_CAUSAL; "mask": a 4-D mask
    checked: bool = False                   # the probe compared it with the forward


def _first(config, names) -> object:
    for name in names:
        value = getattr(config, name, None)
        if value is not None and value is not False:
            return value
    return None


def _alibi(config) -> bool:
    attn = getattr(config, "attn_config", None)   # MPT keeps it in a sub-config
    inner = attn.get("alibi") if isinstance(attn, dict) else getattr(attn, "alibi", False)
    return bool(getattr(config, "alibi", False) or inner)


def position_kind(config) -> str:
    """The config's guess (module docstring); the probe has the last word."""
    if _alibi(config):
        return "sequence"
    if _first(config, ROTARY_FIELDS) is not None:
        return "rotary"
    if getattr(config, "max_position_embeddings", None):
        return "absolute"
    return "unknown"       # nothing to go by: the loaded model's probe decides


def d_inner(config) -> int:
    return int(_first(config, INNER_FIELDS) or 4 * config.hidden_size)


def sliding_window(config) -> int:
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return 0
    if getattr(config, "use_sliding_window", True) is False:
        return 0
    layer_types = getattr(config, "layer_types", None)
    return window if layer_types is None or "sliding_attention" in layer_types else 0


def moe(config) -> MoE | None:
    experts, top_k = _first(config, _EXPERTS), _first(config, _TOP_K)
    if not isinstance(experts, int) or not isinstance(top_k, int) or experts <= 1:
        return None
    return MoE(experts, top_k, float(_first(config, _AUX_COEF) or 0.0),
               bool(getattr(config, "output_router_logits", False)))


def logits_fields(config) -> list[str]:
    """The LOGITS_FIELDS the config sets to a number other than 0."""
    def number(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value != 0
    return [name for name in LOGITS_FIELDS if number(getattr(config, name, None))]


def logits_steps(config, choice: dict | None = None) -> tuple[tuple[str, float], ...]:
    """The post-processing the config's fields name, in LOGITS_FIELDS order; `choice`
    picks another operation for a field (what the probe found the forward does)."""
    return tuple(((choice or {}).get(name, LOGITS_FIELDS[name][0]),
                  float(getattr(config, name))) for name in logits_fields(config))


def config_traits(config) -> Traits:
    """What the config says (module docstring), or a ConfigError on model.hf.path for an
    architecture memory tokens cannot be placed in whatever its weights."""
    kind = position_kind(config)
    if getattr(config, "is_encoder_decoder", False):
        raise ConfigError("model.hf.path", f"{config.model_type!r} is an encoder-decoder "
                          "model: memory tokens are placed in a decoder-only model's one "
                          "sequence of rows")
    table = int(getattr(config, "max_position_embeddings", 0) or 0) if kind == "absolute" else 0
    return Traits(config.model_type, kind, table, logits_steps(config),
                  sliding_window(config), moe(config))


def refuse_sequence_positions(model_type: str, why: str) -> ConfigError:
    """The refusal of a model whose forward reads no position ids ("sequence")."""
    return ConfigError("model.hf.path", f"{model_type!r}: {why}; memory tokens are placed "
                       "with position ids and a 4-D attention mask (RMT's fixed write "
                       "block, ARMT's memory positions, Titans' shared positions), which its "
                       "positions (ALiBi biases from the row order and the padding mask, "
                       "or none) do not read")


def check_rows(traits: Traits, rows: int, option: str, what: str) -> None:
    """Refuse a segment of `rows` decoder rows wider than a mask-built sliding window
    (module docstring)."""
    if traits.sliding_window and rows > traits.sliding_window:
        raise ConfigError(option, f"{what} = {rows} rows through the decoder, beyond the "
                          f"{traits.sliding_window}-row sliding window of "
                          f"{traits.model_type!r}'s sliding-window layers: memtrain gives "
                          "the decoder its own masks, which do not slide, so the result "
                          "would differ from the model's; use shorter segments")


# The attribute of the base module the traits are kept in (probe.py sets it after checking
# them; copies of the module keep it).
ATTR = "memtrain_traits"


def traits_of(base) -> Traits:
    """The probed traits of `base` (probe.py), or what its config and class say."""
    traits = getattr(base, ATTR, None)
    if traits is None:
        traits = static_traits(base)
        setattr(base, ATTR, traits)
    return traits


def static_traits(base) -> Traits:
    """What `base`'s config and class say, before (or without) the probe."""
    # transformers' flag for a model whose attention goes through its attention functions
    # (which positions.py's SDPA_CAUSAL relies on); others get a mask they read themselves.
    through = getattr(type(base), "_supports_attention_backend", False)
    return dataclasses.replace(config_traits(base.config),
                               attention="interface" if through else "mask")
