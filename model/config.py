"""Model configuration: one dataclass tree, validated at construction.

Field names follow the papers and the authors' code (`mem_len`, `tgt_len`, `clamp_len`,
`same_length`, `num_mem_tokens`, `div_val`, ...). Every check raises `ConfigError` naming the
field, so a bad value fails before any tensor is allocated.

The mechanism's options are a section of their own (`model.lamemo`, `model.rmt`,
`model.armt`, `model.titans`), defined in the mechanism's folder
(model/mechanisms/<name>/options.py) and validated by its registry entry (mechanism.py). The
built-in ones are declared fields of `ModelConfig` (`cfg.rmt.num_mem_tokens`;
`ModelConfig(mechanism="rmt", rmt={...})`); a mechanism registered from outside this package
(model/registry.py) has its section in `sections`, read as an attribute the same way, so this file
does not change when one is added. `to_dict` writes every section beside the other fields.
"""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING, dataclass, field
from typing import Any

# ConfigError lives with the typed builder (one error for every config tree); it is imported
# here so `from model.config import ConfigError` and `model.ConfigError` stay the same class.
from . import registry
from .mechanisms.armt.options import ARMTOptions
from .mechanisms.lamemo.options import LaMemoOptions
from .mechanisms.rmt.options import RMTOptions
from .mechanisms.titans.options import TitansOptions
from .typed import ConfigError, build_dataclass, check_choice

ATTN_IMPLS = ("fused", "plain")
# The LM loss's kernels (model/fused_loss.py): "auto", the chunked PyTorch path
# (model/loss.py), Liger Kernel's or Cut Cross-Entropy's fused linear cross-entropy (CUDA).
LOSS_BACKENDS = ("auto", "chunked", "liger", "cce")
# torch.compile backends training may use (model/compiled.py).
COMPILE_BACKENDS = ("inductor", "aot_eager")
FINETUNE_MODES = ("full", "frozen", "lora")
# The mechanisms' sections that are fields of `ModelConfig` (the others: `sections`).
DECLARED_SECTIONS = {"lamemo": LaMemoOptions, "rmt": RMTOptions, "armt": ARMTOptions,
                     "titans": TitansOptions}


@dataclass
class PretrainedOptions:
    """A pretrained Hugging Face causal LM as the backbone (`backbone: hf`; model/pretrained/).

    The shape fields of `ModelConfig` (vocab_size, d_model, n_layer, n_head, d_inner) are
    read from the checkpoint's own config, in a step of its own after the config is built
    (model/backbones/ `resolve_shape`; building reads nothing); the memory is the
    mechanism's (RMT's `model.rmt.num_mem_tokens` 0 is the plain base model)."""

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
    # RMT's "paper" pattern under SDPA: "split", three maskless attention calls a flash
    # kernel runs skipping the tokens' causal upper triangle (model/pretrained/
    # paper_attention.py); "mask", one call with the pattern's boolean mask, every tile.
    paper_attention: str = "split"
    # A checkpoint whose activation is `gelu_new` (GPT-2's family: transformers' Python
    # tanh GELU, one aten op at a time) runs it as `gelu_pytorch_tanh`, the same
    # approximation in one fused kernel (model/pretrained/activations.py); false keeps the
    # original module.
    fused_gelu: bool = True
    # The MLP's activation output is recomputed from its input in backward instead of kept
    # (model/pretrained/activation_recompute.py): one [B, Q, I] tensor less per layer, the
    # same gradients bitwise; off under `model.compile`, whose compiler chooses itself.
    recompute_activation: bool = True
    # The loss's head GEMM over a vocabulary padded with zero rows to a multiple of this
    # (e.g. 128: GPT-2's 50,257 -> 50,304, aligned tiles on a GPU); the padding's logits are
    # cut off before the softmax, so the loss is the unpadded one (model/loss.py). 0: off.
    # Only where the head's weight is a plain, materialised matrix (not a ZeRO-3 shard).
    vocab_multiple: int = 0
    # The checkpoint's architecture (its config's model_type), written with the shape fields
    # by the step that reads them (model/backbones/ `resolve_shape`); empty: not read yet.
    model_type: str = ""


@dataclass(init=False)
class ModelConfig:
    """Shape and mechanism of a memory-augmented decoder-only language model."""

    # A registered mechanism (model/mechanisms/: "xl", "lamemo", "rmt", "armt"), or one in
    # a module of one's own as "package.module:ClassName".
    mechanism: str = "xl"
    # "native": the relative-position stack of model/backbone.py; "hf": a pretrained
    # Hugging Face causal LM around which the mechanism runs (`hf` options below).
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
    # Training compiles the decoder stack with torch.compile (model/compiled.py); around a
    # pretrained model, each decoder layer's forward on its own (model/pretrained/
    # regional.py). Evaluation, generation and the saved weights are the same as without it.
    compile: bool = False
    # Its backend: "inductor" (fused generated kernels: the one to train with); "aot_eager"
    # (the same graphs, graph breaks and forward/backward split on eager kernels, nothing
    # built: tells a problem of the graphs from one of Inductor's kernels, as torch's
    # compile troubleshooting does, and starts in seconds where a cold Inductor build takes
    # minutes).
    compile_backend: str = "inductor"
    # The LM loss's head + cross-entropy: "chunked" (model/loss.py, PyTorch, any device),
    # "liger" or "cce" (a fused CUDA library, refused where it cannot run), "auto" (a fused
    # library on CUDA where it is installed and the head is one plain linear layer, else
    # chunked). The same per-row NLL either way (model/fused_loss.py).
    loss_backend: str = "auto"
    # The built-in mechanisms' options sections (model/mechanisms/<name>/options.py), each
    # read, checked and written as `model.<name>` whichever mechanism runs.
    lamemo: LaMemoOptions = field(default_factory=LaMemoOptions)
    rmt: RMTOptions = field(default_factory=RMTOptions)
    armt: ARMTOptions = field(default_factory=ARMTOptions)
    titans: TitansOptions = field(default_factory=TitansOptions)
    hf: PretrainedOptions = field(default_factory=PretrainedOptions)
    # The sections no field can declare: those of mechanisms registered from outside this
    # package (`package.module:ClassName`, model/registry.py), by section name, read as
    # attributes (`cfg.toy`); `to_dict` writes them as `model.<section>` after the built-in
    # ones.
    sections: dict[str, Any] = field(default_factory=dict, repr=False)

    def __init__(self, sections: dict[str, Any] | None = None, **values: Any):
        known = {name: cls for name, cls in registry.sections(values.get("mechanism")).items()
                 if name not in DECLARED_SECTIONS}
        given = {**(sections or {}), **{k: values.pop(k) for k in list(values) if k in known}}
        for f in dataclasses.fields(self):
            if f.name == "sections":
                continue
            value = values.pop(f.name, MISSING)
            if value is MISSING:
                value = f.default if f.default is not MISSING else f.default_factory()
            elif f.name in DECLARED_SECTIONS and not isinstance(value, DECLARED_SECTIONS[f.name]):
                value = _build_options(DECLARED_SECTIONS[f.name], value, f"model.{f.name}")
            setattr(self, f.name, value)
        if values:
            raise TypeError(f"ModelConfig got unexpected keyword arguments {sorted(values)}")
        self.sections = {}
        for name, cls in known.items():
            value = given.get(name)
            self.sections[name] = (cls() if value is None else value
                                   if isinstance(value, cls) else
                                   _build_options(cls, value, f"model.{name}"))
        self.__post_init__()

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: a section without a field (`sections`).
        sections = self.__dict__.get("sections")
        if sections is not None and name in sections:
            return sections[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        sections = self.__dict__.get("sections")
        if sections is not None and name in sections:
            sections[name] = value
        else:
            object.__setattr__(self, name, value)

    def mechanism_sections(self) -> dict[str, Any]:
        """Every mechanism's options section by name: the declared ones, then `sections`."""
        return {**{name: getattr(self, name) for name in DECLARED_SECTIONS}, **self.sections}

    @classmethod
    def config_fields(cls, values: dict[str, Any]) -> dict[str, Any]:
        """The fields `from_dict` accepts and their types (model/typed.py): the dataclass
        fields and every registered mechanism's section."""
        import typing

        hints = typing.get_type_hints(cls)
        hints.pop("sections")
        mechanism = values.get("mechanism") if isinstance(values.get("mechanism"), str) else None
        return {**hints, **{name: cls for name, cls in registry.sections(mechanism).items()
                            if name not in DECLARED_SECTIONS}}

    @property
    def mech(self):
        """The registered `Mechanism` (model/registry.py) that runs this config:
        what every consumer asks instead of the mechanism's name."""
        return registry.get(self.mechanism)

    def __post_init__(self) -> None:
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

    @property
    def backbone_traits(self) -> BackboneTraits:
        """What this config's backbone is, as far as validation needs to know (below)."""
        return BACKBONE_TRAITS[self.backbone]

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        if self.backbone not in BACKBONE_TRAITS:
            raise ConfigError("model.backbone", f"unknown backbone {self.backbone!r}; choose "
                              f"one of {', '.join(BACKBONE_TRAITS)}")
        mech = self.mech   # an unknown mechanism is a ConfigError naming model.mechanism
        mech.upgrade(self)
        if BACKBONE_TRAITS[self.backbone].check is not None:
            BACKBONE_TRAITS[self.backbone].check(self)
        if self.shape_read:
            self._validate_shape()
        self._validate_loss_backend()
        self.check_lengths(self.mem_len, self.clamp_len, self.same_length)
        mech.validate(self)

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
        check_choice("model.attn_impl", self.attn_impl, ATTN_IMPLS)
        check_choice("model.compile_backend", self.compile_backend, COMPILE_BACKENDS)
        self._validate_adaptive()

    def _validate_loss_backend(self) -> None:
        check_choice("model.loss_backend", self.loss_backend, LOSS_BACKENDS)
        if self.loss_backend in ("auto", "chunked"):
            return
        if self.backbone_traits.own_softmax:
            if self.cutoffs:
                raise ConfigError("model.loss_backend", f"{self.loss_backend!r} takes one "
                                  "linear head; the adaptive softmax (model.cutoffs) has "
                                  "clusters: use auto or chunked")
            if self.loss_backend == "cce":
                raise ConfigError("model.loss_backend", "'cce' takes no head bias and the "
                                  "native softmax has one: use liger, auto or chunked")
        elif self.hf.vocab_multiple:
            raise ConfigError("model.loss_backend", f"{self.loss_backend!r} reads the "
                              "unpadded head; model.hf.vocab_multiple pads the chunked "
                              "path's GEMM: set it to 0, or the backend to auto or chunked")

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
        mech = self.mech
        if same_length and not mech.same_length:
            raise ConfigError(f"{section}.same_length", f"is not defined for "
                              f"{self.mechanism.upper()} (memory rows see their blocks in "
                              "full)")
        if same_length and mem_len == 0:
            raise ConfigError(f"{section}.same_length", "needs mem_len > 0 (each query sees "
                              "exactly mem_len keys)")
        mech.check_lengths(self, mem_len, clamp_len, same_length, section)

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

    def _validate_pretrained(self) -> None:
        o, mech = self.hf, self.mech
        if not mech.pretrained:
            raise ConfigError("model.mechanism", f"{self.mechanism!r} runs on the native "
                              "stack only; a pretrained backbone runs a mechanism that "
                              "states how (model/mechanisms/, e.g. 'rmt' or 'armt')")
        if o.finetune not in FINETUNE_MODES:
            raise ConfigError("model.hf.finetune", f"unknown {o.finetune!r}; choose one of "
                              f"{', '.join(FINETUNE_MODES)}")
        if o.finetune == "frozen" and mech.memory_tokens and mech.num_mem_tokens(self) == 0:
            raise ConfigError("model.hf.finetune", "'frozen' with no memory tokens leaves "
                              "nothing to train")
        if o.lora_r <= 0 or o.lora_alpha <= 0:
            raise ConfigError("model.hf.lora_r", "lora_r and lora_alpha must be > 0")
        if not 0.0 <= o.lora_dropout < 1.0:
            raise ConfigError("model.hf.lora_dropout", f"must be in [0, 1), got "
                              f"{o.lora_dropout}")
        if o.vocab_multiple < 0:
            raise ConfigError("model.hf.vocab_multiple", f"must be >= 0 (0: off), got "
                              f"{o.vocab_multiple}")
        if o.paper_attention not in ("split", "mask"):
            raise ConfigError("model.hf.paper_attention", f"unknown {o.paper_attention!r}; "
                              "choose 'split' or 'mask'")
        if o.attn_implementation not in ("sdpa", "eager"):
            raise ConfigError("model.hf.attn_implementation", f"unknown "
                              f"{o.attn_implementation!r}; choose 'sdpa' or 'eager'")

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        """Plain values, each mechanism's section as `<section>: {...}` before `hf` (the
        schema of the run configs, saved configs and MLflow params)."""
        out = dataclasses.asdict(self)
        sections, hf = out.pop("sections"), out.pop("hf")
        return {**out, **sections, "hf": hf}   # the declared sections, then the others

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
    own_softmax: bool           # its own (adaptive) softmax, which RMT's §3.4 aux loss reads
    native_core: bool           # runs the mechanism's own core (`core_class`), not hooks
    #                             around another model's layers
    check: Any = None           # (ModelConfig) -> None: its own options' validation


BACKBONE_TRAITS = {
    # The native relative-position stack (model/backbone.py): no memory is mechanism 'xl'
    # with mem_len 0.
    "native": BackboneTraits(xl_cache=True, base_without_memory=False, position_ids=False,
                             shape_from_checkpoint=False, own_softmax=True,
                             native_core=True),
    # A pretrained Hugging Face causal LM (model/pretrained/).
    "hf": BackboneTraits(xl_cache=False, base_without_memory=True, position_ids=True,
                         shape_from_checkpoint=True, own_softmax=False, native_core=False,
                         check=ModelConfig._validate_pretrained),
}
BACKBONES = tuple(BACKBONE_TRAITS)


def _build_options(cls, values: dict[str, Any], prefix: str):
    # Options given as dicts to the constructor (`ModelConfig(rmt={...})`) are typed by the
    # same builder as `from_dict`, so both paths give the same errors.
    return build_dataclass(cls, values, prefix)
