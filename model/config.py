"""Model configuration: one dataclass tree, validated at construction.

Field names follow the papers and the authors' code (`mem_len`, `tgt_len`, `clamp_len`,
`same_length`, `num_mem_tokens`, `div_val`, ...). Every check raises `ConfigError` naming the
field, so a bad value fails before any tensor is allocated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

# ConfigError lives with the typed builder (one error for every config tree); it is imported
# here so `from model.config import ConfigError` and `model.ConfigError` stay the same class.
from .typed import ConfigError, build_dataclass

MECHANISMS = ("xl", "lamemo", "rmt", "armt")
ATTN_IMPLS = ("fused", "plain")


@dataclass
class LaMemoOptions:
    """LaMemo (Ji et al. 2022) switches; the defaults are the paper's full model."""

    # ε in Eq. 11; the paper searched {1e-6, 1e-5, 1e-4}, the released code uses 1e-6.
    eps: float = 1e-6
    # Ablation "w/o mem interp" (Table 3): α = 0, so C↔ = C←.
    interpolate: bool = True
    # Ablation "w/o look-ahead" (Table 3): only C→, which is exactly Transformer-XL.
    look_ahead: bool = True
    # "disentangled" (§3.3, Eq. 12: R_|i-j| with v+ / v-) or "xl" (R_{i-j} with negative
    # distances, the ablation that fails to train in Table 3).
    pos_enc: str = "disentangled"


@dataclass
class RMTOptions:
    """Recurrent Memory Transformer (Bulatov et al. 2022) options."""

    # m: memory tokens placed as a read block before and a write block after the segment.
    num_mem_tokens: int = 10
    # Let memory rows attend to the XL cache (RMT §3; the table is in tests/test_rmt.py); off
    # in the LM code.
    read_mem_from_cache: bool = False
    # Auxiliary loss of §3.4 (Tr-XL + RMT): each write output predicts `mem_loss_token`.
    mem_loss_weight: float = 0.0
    mem_loss_token: int = 0
    # Pre-LN only (post-LN outputs are already normalised): a LayerNorm on the write outputs
    # before they become the next memory, or the memory's norm grows with every segment of
    # a stream. "unit": gain 1 (the streams, quickstart and smoke were measured with it);
    # "embedding": gain init_std * sqrt(d_model), the scale of the initial memory and the
    # embeddings (the copy config); "none": no LayerNorm (the reverse and AR configs).
    memory_norm: str = "unit"
    # The attention pattern over [read | tokens | write]. "paper": RMT §3's rule (memory rows
    # see their whole block, tokens are causal; the native stack and the LM code); "causal":
    # the base model's own causal mask over the whole row at default positions 0..2m+L-1, as
    # the RMT authors' Hugging Face wrapper (MemoryCell) runs it; pretrained backbones only.
    # "paper" is the default for every backbone: as good on the mean and steadier on a
    # pretrained model (docs/coming-from-authors.md), and what earlier runs computed.
    pattern: str = "paper"


@dataclass
class ARMTOptions:
    """Associative Recurrent Memory Transformer (Rodkin et al. 2024) options; model/armt.py
    has the equations. Its memory tokens are RMT's: `model.rmt.num_mem_tokens` of them,
    placed after the segment's tokens, whose outputs write every layer's association
    matrix. The defaults are the authors' code."""

    # Width of q and k before the feature map (the authors' d_mem; 64 in their scripts).
    d_key: int = 64
    # phi: "dpfp" (deterministic parameter-free projection, the authors'), "elu" (elu + 1)
    # or "identity" (the alternative left in their code; its normaliser can be <= 0).
    feature_map: str = "dpfp"
    # DPFP's nu: phi has 2 * nu * d_key entries (3 in the authors' code).
    nu: int = 3
    # beta = sigmoid(w_b . m + b), the importance of each memory token's write; false: 1.
    gate: bool = True
    # gamma, the normaliser's correction for a key already stored (the authors'
    # --no_correction turns it off); false: every write adds phi(k) to z.
    correction: bool = True
    # gamma as the authors' code computes it (eps also in its numerator, 1 on a row's first
    # write); the default drops that eps so a zero state is a fresh one with no flag
    # (model/associative.py). `memtrain import --format armt-authors` sets it.
    authors_gamma: bool = False
    # false (the authors'): every segment's memory tokens start from the same learned
    # vectors and only the association matrices cross the boundary; true: the write
    # outputs are also carried as the next segment's memory tokens (RMT's recurrence on
    # top of the associative memory), through `model.rmt.memory_norm`.
    carry_tokens: bool = False
    # Position ids of the memory tokens around a pretrained model (backbone hf; the native
    # stack's positions are relative). "fixed": T .. T+m-1, T = max(L, tgt_len), the same
    # rows whatever the segment's length; "follow": L .. L+m-1, right after the segment
    # (the authors' code without wrap_pos: the base model's default positions); "table_end":
    # the last m rows of a learned position table (the authors' wrap_pos, which appends m
    # rows to GPT-2's table for the memory). model/pretrained/positions.py.
    memory_positions: str = "fixed"


MEMORY_NORMS = ("unit", "embedding", "none")
RMT_PATTERNS = ("paper", "causal")
ARMT_MEMORY_POSITIONS = ("fixed", "follow", "table_end")
FEATURE_MAPS = ("dpfp", "elu", "identity")
FINETUNE_MODES = ("full", "frozen", "lora")


@dataclass
class PretrainedOptions:
    """A pretrained Hugging Face causal LM as the backbone (`backbone: hf`; model/pretrained/).

    The shape fields of `ModelConfig` (vocab_size, d_model, n_layer, n_head, d_inner) are
    read from the checkpoint's own config, in a step of its own after the config is built
    (model/backbones/ `resolve_shape`; building reads nothing); the memory is RMT's
    (`model.rmt.num_mem_tokens`, 0 for the plain base model)."""

    # A local directory (loads with no network) or a hub name (needs the network unless it
    # is in the local cache; HF_HUB_OFFLINE=1 is respected).
    path: str = ""
    # Hub revision (branch, tag or commit); recorded with every export.
    revision: str = ""
    # A GGUF file inside `path` (transformers dequantises it to torch weights).
    gguf_file: str = ""
    # "full": every weight trains; "frozen": only the memory parameters train; "lora":
    # low-rank adapters (peft) plus the memory parameters.
    finetune: str = "full"
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    # Module names that get adapters; empty: peft's default for the architecture.
    lora_targets: list[str] = field(default_factory=list)
    # The base model's attention kernel: "sdpa" or "eager" (the reference softmax).
    attn_implementation: str = "sdpa"
    # The checkpoint's architecture (its config's model_type), written with the shape fields
    # by the step that reads them (model/backbones/ `resolve_shape`); empty: not read yet.
    model_type: str = ""


@dataclass
class ModelConfig:
    """Shape and mechanism of a memory-augmented decoder-only language model."""

    mechanism: str = "xl"  # "xl" | "lamemo" | "rmt" | "armt"
    # "native": the relative-position stack of model/backbone.py; "hf": a pretrained
    # Hugging Face causal LM wrapped with RMT memory tokens (`hf` options below).
    backbone: str = "native"
    vocab_size: int = 256
    n_layer: int = 2
    d_model: int = 64
    n_head: int = 4
    d_head: int = 0  # 0 means d_model // n_head
    d_inner: int = 256
    dropout: float = 0.1
    dropatt: float = 0.0
    # Segment length L used in training; evaluation may feed other lengths.
    tgt_len: int = 32
    # Per-layer cache length M (XL, LaMemo) or the XL cache beside RMT memory tokens.
    mem_len: int = 32
    # Distances beyond clamp_len reuse R_clamp_len (XL code); -1 means no clamping.
    clamp_len: int = -1
    # Every query sees exactly mem_len keys (XL evaluation setting).
    same_length: bool = False
    # Per-layer u/v biases (TF SoTA scripts) instead of shared ones (PyTorch code, LaMemo).
    untie_r: bool = False
    pre_lnorm: bool = False
    # Adaptive input/softmax (Baevski & Auli 2018; Grave et al. 2016). Empty cutoffs means a
    # plain softmax over the whole vocabulary (enwik8, text8).
    cutoffs: list[int] = field(default_factory=list)
    div_val: int = 1
    tie_weight: bool = True
    # Which cluster projections are tied between input and output (XL WT103: F,T,T,T).
    tie_projs: list[bool] = field(default_factory=list)
    init_std: float = 0.02
    proj_init_std: float = 0.01
    # "fused": the fastest exact kernel for the device and the call (attention_kernels.py
    # `choose_kernel`: SDPA with the positional term as a bias on CUDA and in CPU
    # evaluation, the one-pass relative softmax in CPU training and for LaMemo's branches);
    # "plain": the reference matmul/softmax path.
    attn_impl: str = "fused"
    # Activation checkpointing around every layer (torch.utils.checkpoint, non-reentrant).
    checkpoint_layers: bool = False
    # Training compiles the decoder stack with torch.compile (model/compiled.py); evaluation,
    # generation and the saved weights are the same as without it.
    compile: bool = False
    lamemo: LaMemoOptions = field(default_factory=LaMemoOptions)
    rmt: RMTOptions = field(default_factory=RMTOptions)
    armt: ARMTOptions = field(default_factory=ARMTOptions)
    hf: PretrainedOptions = field(default_factory=PretrainedOptions)

    def __post_init__(self) -> None:
        if isinstance(self.lamemo, dict):
            self.lamemo = _build_options(LaMemoOptions, self.lamemo, "model.lamemo")
        if isinstance(self.rmt, dict):
            self.rmt = _build_options(RMTOptions, self.rmt, "model.rmt")
        if isinstance(self.armt, dict):
            self.armt = _build_options(ARMTOptions, self.armt, "model.armt")
        if isinstance(self.hf, dict):
            self.hf = _build_options(PretrainedOptions, self.hf, "model.hf")
        if self.d_head == 0 and self.shape_read and self.n_head > 0 and \
                self.d_model % self.n_head == 0:
            self.d_head = self.d_model // self.n_head
        self.validate()

    @property
    def shape_read(self) -> bool:
        """Whether the shape fields hold the model's shape: always for the native stack; for
        a backbone that reads its shape from a checkpoint, once that step ran (until then
        they hold defaults that describe no checkpoint, and are not validated)."""
        traits = BACKBONE_TRAITS.get(self.backbone)
        return traits is None or not traits.shape_from_checkpoint or bool(self.hf.model_type)

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        if self.backbone not in BACKBONE_TRAITS:
            raise ConfigError("model.backbone", f"unknown backbone {self.backbone!r}; choose "
                              f"one of {', '.join(BACKBONE_TRAITS)}")
        if BACKBONE_TRAITS[self.backbone].check is not None:
            BACKBONE_TRAITS[self.backbone].check(self)
        if self.mechanism not in MECHANISMS:
            raise ConfigError("model.mechanism", f"unknown mechanism {self.mechanism!r}; "
                              f"choose one of {', '.join(MECHANISMS)}")
        if self.shape_read:
            self._validate_shape()
        self.check_lengths(self.mem_len, self.clamp_len, self.same_length)
        if self.mechanism == "lamemo":
            self._validate_lamemo()
        if self.mechanism in ("rmt", "armt"):
            self._validate_rmt()
        if self.mechanism == "armt":
            self._validate_armt()

    def _validate_shape(self) -> None:
        for name in ("vocab_size", "n_layer", "d_model", "n_head", "d_inner", "tgt_len"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model.{name}", f"must be > 0, got {getattr(self, name)}")
        if self.d_head <= 0:
            if self.d_model % self.n_head:
                raise ConfigError("model.n_head", f"n_head={self.n_head} does not divide "
                                  f"d_model={self.d_model}; set d_head explicitly or change "
                                  "n_head")
            raise ConfigError("model.d_head", f"must be > 0, got {self.d_head}")
        if self.d_model % 2:
            raise ConfigError("model.d_model", "must be even (sin/cos halves of R)")
        for name in ("dropout", "dropatt"):
            p = getattr(self, name)
            if not 0.0 <= p < 1.0:
                raise ConfigError(f"model.{name}", f"must be in [0, 1), got {p}")
        if self.attn_impl not in ATTN_IMPLS:
            raise ConfigError("model.attn_impl", f"unknown {self.attn_impl!r}; choose "
                              f"one of {', '.join(ATTN_IMPLS)}")
        self._validate_adaptive()

    def check_lengths(self, mem_len: int, clamp_len: int, same_length: bool,
                      section: str = "model") -> None:
        """The one check of memory lengths, at construction and for every evaluation
        protocol (`section` names where the values came from, e.g. "eval")."""
        if mem_len < 0:
            raise ConfigError(f"{section}.mem_len", f"must be >= 0, got {mem_len}")
        if clamp_len < -1 or clamp_len == 0:
            raise ConfigError(f"{section}.clamp_len", f"must be -1 (off) or > 0, got "
                              f"{clamp_len}")
        if mem_len and not BACKBONE_TRAITS[self.backbone].xl_cache:
            raise ConfigError(f"{section}.mem_len", f"must be 0, got {mem_len}: a pretrained "
                              "backbone keeps no XL cache")
        if same_length and self.mechanism in ("rmt", "armt"):
            raise ConfigError(f"{section}.same_length", f"is not defined for "
                              f"{self.mechanism.upper()} (memory rows see their blocks in "
                              "full)")
        if same_length and mem_len == 0:
            raise ConfigError(f"{section}.same_length", "needs mem_len > 0 (each query sees "
                              "exactly mem_len keys)")
        if self.mechanism == "lamemo" and mem_len == 0:
            raise ConfigError(f"{section}.mem_len", "LaMemo refreshes a memory; mem_len must "
                              "be > 0 (use mechanism 'xl' with mem_len 0 for the no-memory "
                              "baseline)")

    def _validate_adaptive(self) -> None:
        cutoffs = list(self.cutoffs)
        if cutoffs:
            if cutoffs != sorted(set(cutoffs)) or cutoffs[0] <= 0:
                raise ConfigError("model.cutoffs", f"must be strictly increasing positive "
                                  f"ids, got {cutoffs}")
            if cutoffs[-1] >= self.vocab_size:
                raise ConfigError("model.cutoffs", f"last cutoff {cutoffs[-1]} must be < "
                                  f"vocab_size={self.vocab_size}")
        if self.div_val < 1:
            raise ConfigError("model.div_val", f"must be >= 1, got {self.div_val}")
        if self.div_val > 1 and not cutoffs:
            raise ConfigError("model.div_val", "div_val > 1 needs cutoffs (adaptive "
                              "embedding clusters)")
        if self.tie_projs and len(self.tie_projs) != len(cutoffs) + 1:
            raise ConfigError("model.tie_projs", f"needs one entry per cluster "
                              f"({len(cutoffs) + 1}), got {len(self.tie_projs)}")

    def _validate_lamemo(self) -> None:
        o = self.lamemo
        if o.eps <= 0:
            raise ConfigError("model.lamemo.eps", f"must be > 0, got {o.eps}")
        if o.pos_enc not in ("disentangled", "xl"):
            raise ConfigError("model.lamemo.pos_enc", f"unknown {o.pos_enc!r}; choose "
                              "'disentangled' or 'xl'")

    def _validate_rmt(self) -> None:
        o = self.rmt
        if o.memory_norm not in MEMORY_NORMS:
            raise ConfigError("model.rmt.memory_norm", f"unknown {o.memory_norm!r}; choose "
                              f"{', '.join(MEMORY_NORMS)}")
        if o.num_mem_tokens < 0:
            raise ConfigError("model.rmt.num_mem_tokens", f"must be >= 0, got "
                              f"{o.num_mem_tokens}")
        if o.num_mem_tokens == 0 and not BACKBONE_TRAITS[self.backbone].base_without_memory:
            # A pretrained backbone with 0 memory tokens is its plain base model (the
            # no-memory baseline); the native stack has mechanism 'xl' for that.
            raise ConfigError("model.rmt.num_mem_tokens", "must be > 0 (use mechanism 'xl' "
                              "with mem_len 0 for no memory)")
        if o.pattern not in RMT_PATTERNS:
            raise ConfigError("model.rmt.pattern", f"unknown {o.pattern!r}; choose one of "
                              f"{', '.join(RMT_PATTERNS)}")
        if o.pattern == "causal" and (not BACKBONE_TRAITS[self.backbone].position_ids
                                      or self.mechanism != "rmt"):
            raise ConfigError("model.rmt.pattern", "'causal' is the RMT authors' Hugging Face "
                              "wrapper's pattern: it needs mechanism 'rmt' with backbone 'hf' "
                              "(the native RMT follows RMT §3, 'paper'; ARMT is causal by "
                              "construction)")
        if o.mem_loss_weight < 0:
            raise ConfigError("model.rmt.mem_loss_weight", "must be >= 0")
        if not 0 <= o.mem_loss_token < self.vocab_size:
            raise ConfigError("model.rmt.mem_loss_token", f"must be a token id in "
                              f"[0, {self.vocab_size}), got {o.mem_loss_token}")

    def _validate_armt(self) -> None:
        o = self.armt
        if self.rmt.num_mem_tokens == 0:
            raise ConfigError("model.rmt.num_mem_tokens", "ARMT writes its associative memory "
                              "from the memory tokens: must be > 0")
        if o.d_key <= 0:
            raise ConfigError("model.armt.d_key", f"must be > 0, got {o.d_key}")
        if o.feature_map not in FEATURE_MAPS:
            raise ConfigError("model.armt.feature_map", f"unknown {o.feature_map!r}; choose "
                              f"one of {', '.join(FEATURE_MAPS)}")
        if o.feature_map == "dpfp" and o.nu < 1:
            raise ConfigError("model.armt.nu", f"must be >= 1, got {o.nu}")
        if self.rmt.mem_loss_weight:
            raise ConfigError("model.rmt.mem_loss_weight", "the auxiliary memory loss is "
                              "RMT's (§3.4); ARMT has none")
        if o.memory_positions not in ARMT_MEMORY_POSITIONS:
            raise ConfigError("model.armt.memory_positions", f"unknown {o.memory_positions!r}; "
                              f"choose one of {', '.join(ARMT_MEMORY_POSITIONS)}")
        if o.memory_positions != "fixed" and not BACKBONE_TRAITS[self.backbone].position_ids:
            raise ConfigError("model.armt.memory_positions", "places memory tokens in a "
                              "pretrained model's positions (backbone 'hf'); the native "
                              "stack's positions are relative")

    def _validate_pretrained(self) -> None:
        o = self.hf
        if self.mechanism not in ("rmt", "armt"):
            raise ConfigError("model.mechanism", f"a pretrained backbone carries memory "
                              f"tokens; set mechanism 'rmt' or 'armt' (got "
                              f"{self.mechanism!r})")
        if self.rmt.mem_loss_weight:
            raise ConfigError("model.rmt.mem_loss_weight", "the auxiliary memory loss is "
                              "defined for the native stack only")
        if self.compile:
            raise ConfigError("model.compile", "compiles the native stack only; set it false "
                              "with a pretrained backbone")
        if o.finetune not in FINETUNE_MODES:
            raise ConfigError("model.hf.finetune", f"unknown {o.finetune!r}; choose one of "
                              f"{', '.join(FINETUNE_MODES)}")
        if o.finetune == "frozen" and self.rmt.num_mem_tokens == 0:
            raise ConfigError("model.hf.finetune", "'frozen' with no memory tokens leaves "
                              "nothing to train")
        if o.lora_r <= 0 or o.lora_alpha <= 0:
            raise ConfigError("model.hf.lora_r", "lora_r and lora_alpha must be > 0")
        if not 0.0 <= o.lora_dropout < 1.0:
            raise ConfigError("model.hf.lora_dropout", f"must be in [0, 1), got "
                              f"{o.lora_dropout}")
        if o.attn_implementation not in ("sdpa", "eager"):
            raise ConfigError("model.hf.attn_implementation", f"unknown "
                              f"{o.attn_implementation!r}; choose 'sdpa' or 'eager'")

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Typed like the run config (`model.typed.build_dataclass`): an unknown or mistyped
        field, nested ones included, fails naming its dotted path under `model`."""
        return build_dataclass(cls, data, "model")


@dataclass(frozen=True)
class BackboneTraits:
    """What the model config must know of a backbone to validate itself. The backbone's
    behaviour (building, export, load, vocabulary, positions, plan shapes, ...) is its class
    in model/backbones/, whose registry has the same names; this part sits here, below it,
    because every module of model/ reads the config."""

    xl_cache: bool              # keeps Transformer-XL's cache (mem_len > 0)
    base_without_memory: bool   # 0 memory tokens is a model of its own (its base model)
    position_ids: bool          # places rows at position ids (memory_positions, "causal")
    shape_from_checkpoint: bool  # the shape fields are read from a checkpoint (shape_read)
    check: Any = None           # (ModelConfig) -> None: its own options' validation


BACKBONE_TRAITS = {
    # The native relative-position stack (model/backbone.py): no memory is mechanism 'xl'
    # with mem_len 0.
    "native": BackboneTraits(xl_cache=True, base_without_memory=False, position_ids=False,
                             shape_from_checkpoint=False),
    # A pretrained Hugging Face causal LM (model/pretrained/).
    "hf": BackboneTraits(xl_cache=False, base_without_memory=True, position_ids=True,
                         shape_from_checkpoint=True, check=ModelConfig._validate_pretrained),
}
BACKBONES = tuple(BACKBONE_TRAITS)


def _build_options(cls, values: dict[str, Any], prefix: str):
    # Options given as dicts to the constructor (`ModelConfig(rmt={...})`) are typed by the
    # same builder as `from_dict`, so both paths give the same errors.
    return build_dataclass(cls, values, prefix)
