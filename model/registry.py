"""The mechanism registry: `ModelConfig.mechanism` -> the `Mechanism` that runs it.

A memory mechanism is one folder of model/mechanisms/ (xl/, lamemo/, rmt/, armt/, ...)
whose mechanism.py holds a subclass of `Mechanism`, registered by name. It states
everything the rest of the house asks of it, so that nothing outside the mechanism folders
branches on a mechanism's name:

    options      its config section (`model.<section>`, a dataclass) and its validation
    state        its `MemoryState` subclass (model/memory.py) and its initial state
    traits       memory tokens, whether same_length is defined, warm-up segments, the
                 analyses that apply to it, its auxiliary loss
    native       the class that runs it on the relative-position stack (model/backbone.py),
                 which also states a segment's shapes for the planner (model/shapes.py)
    pretrained   its parameters, initial state and forward around a pretrained decoder
                 (model/pretrained/wrapper.py delegates to these), and its segment's rows
                 for the planner (model/pretrained/shapes.py)

This file sits below the mechanisms and the config (it imports only model/typed.py): the
config reads the registry, and the registry imports a built-in mechanism's module by name
only when it is first asked for it. docs/mechanisms.md walks through adding one. A
mechanism in a module of one's own (not in this package) is named in the config by its
import path, "package.module:ClassName": `get` imports the module, so the mechanism is
known in every process that reads the config (the ranks the launcher starts included), not
only in the one that defined it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .typed import ConfigError

_REGISTRY: dict[str, Mechanism] = {}
# The built-in mechanisms, in the order their config sections are written, and the module
# of each that registers it (its folder's mechanism.py under model/mechanisms/): a new
# mechanism of this package is one folder and one entry here.
_MODULES = {"xl": "xl.mechanism", "lamemo": "lamemo.mechanism", "rmt": "rmt.mechanism",
            "armt": "armt.mechanism", "titans": "titans.mechanism"}
BUILTIN = tuple(_MODULES)


class Mechanism:
    """Base class: the defaults are those of a mechanism with no memory tokens, no options,
    that runs on the native stack only."""

    name: ClassVar[str] = ""
    # The config section `model.<section>` and its dataclass; None: no options.
    section: ClassVar[str | None] = None
    options: ClassVar[type | None] = None
    # Its `MemoryState` subclass (model/memory.py), registered by its `kind` with the
    # mechanism, so that a checkpoint's memory loads back (`MemoryState.from_state_dict`).
    state: ClassVar[type | None] = None
    # Whether Transformer-XL's evaluation setting same_length (every query sees exactly
    # mem_len keys) is defined: not where memory rows see their blocks whole.
    same_length: ClassVar[bool] = True
    # The memory is carried as token rows that the segment's outputs write: they learn to
    # write only if a later segment's loss reaches them (BPTT windows), and they need pre-LN
    # (post-LN write rows echo their input; docs/rmt.md).
    memory_tokens: ClassVar[bool] = False
    # Blocks of num_mem_tokens rows a segment adds to a pretrained model's positions.
    memory_blocks: ClassVar[int] = 0
    # What `memtrain analyze` (evaluation/memory_plots.py) measures for it: "distance"
    # (attention mass against distance), "alpha" (LaMemo's α), "blocks" (attention between
    # named blocks of rows, RMT Fig. 6).
    analyses: ClassVar[tuple[str, ...]] = ("distance",)
    # Part of `memtrain smoke`'s default set (a mechanism that stays at chance on its
    # stream would not show what the smoke run is for).
    in_smoke: ClassVar[bool] = True
    # Prefixes of the native core's parameters it initialises itself (model/lm.py leaves
    # them out of the XL code init).
    own_init: ClassVar[tuple[str, ...]] = ()
    # Fields of its section that make the same weights another model (e.g. RMT's attention
    # pattern): a model file starts a run only where they agree (model/io.py).
    identity_fields: ClassVar[tuple[str, ...]] = ()
    # `memtrain import --format` of its authors' checkpoints (train/interop.py), if any.
    authors_format: ClassVar[str | None] = None
    # Runs around a pretrained decoder (`backbone: hf`): implements the pretrained_ hooks.
    pretrained: ClassVar[bool] = False

    # -- options ---------------------------------------------------------------------------
    def validate(self, cfg) -> None:
        """Checks of its options against the whole config; ConfigError names the field."""

    def upgrade(self, cfg) -> None:
        """Bring a config written before a field of its section existed up to date, in
        place, once, when the config is built (before `validate`): the field takes what the
        older config meant, with a FutureWarning where the older config said it elsewhere.
        Nothing by default."""

    def check_lengths(self, cfg, mem_len: int, clamp_len: int, same_length: bool,
                      section: str) -> None:
        """Its own rules on the memory lengths, after the common ones (model/config.py
        `check_lengths`, which also refuses same_length where the trait says it is not
        defined), at construction and for every evaluation protocol (`section` says where
        the values came from)."""

    def opts(self, cfg):
        """Its options section of `cfg`."""
        return getattr(cfg, self.section)

    # -- traits ----------------------------------------------------------------------------
    def num_mem_tokens(self, cfg) -> int:
        """Memory tokens a segment carries (0: none)."""
        return 0

    def warmup_segments(self, cfg, mem_len: int, tgt_len: int) -> int:
        """Segments before its memory is full: ceil(M / L) for an XL cache, and at least one
        where memory tokens must have been written once (analysis, RECL)."""
        warm = -(-mem_len // tgt_len) if mem_len else 0
        return max(warm, 1) if self.num_mem_tokens(cfg) else warm

    # -- native stack ----------------------------------------------------------------------
    def core_class(self, cfg) -> type:
        """The `RelativeBackbone` subclass that runs it (model/backbone.py); its classmethod
        `segment_shapes` states a segment's shapes (model/shapes.py)."""
        raise NotImplementedError(f"mechanism {self.name!r} has no native core")

    def training_notes(self, cfg, bptt_depth: int) -> list[str]:
        """Lines `memtrain train` prints before training `cfg` with gradients through
        `bptt_depth` earlier segments: settings under which a part of the mechanism gets no
        gradient and cannot learn. None by default."""
        return []

    def aux_loss(self, cfg, softmax, state) -> Any:
        """The weighted auxiliary loss of a segment from the model's softmax and the new
        state, or None (added to the LM loss by the training step, logged apart)."""
        return None

    # -- pretrained backbone (model/pretrained/wrapper.py) ---------------------------------
    def pretrained_parameters(self, cfg, base, memory_scale: float | None) -> dict:
        """Its modules around a pretrained `base`, set as attributes of the wrapper (their
        names are the state dict's)."""
        raise ConfigError("model.mechanism", f"{self.name!r} runs on the native stack only "
                          "(backbone 'native')")

    def pretrained_initial_state(self, lm, batch_size: int, device=None):
        raise NotImplementedError(f"mechanism {self.name!r} sets pretrained = True but states "
                                  "no pretrained_initial_state")

    def pretrained_decode(self, lm, emb, state):
        """token embeddings [B, L, d] -> (hidden [B, L, d] after the final norm, new
        state), running `lm.base.base_model`."""
        raise NotImplementedError(f"mechanism {self.name!r} sets pretrained = True but states "
                                  "no pretrained_decode")

    def pretrained_open_segment(self, lm, state):
        """The open segment of a generation (model/open_segment.py): by default re-read
        whole at every new token."""
        from .open_segment import RerunSegment
        return RerunSegment(lm, lm.next_token_log_probs, state)

    def pretrained_rows(self, cfg, rows: int, trained_params: int):
        """A segment's rows around a pretrained decoder for the planner
        (model/pretrained/shapes.py `MemoryRows`)."""
        raise NotImplementedError(f"{self.name!r} states no pretrained segment shapes")

    def check_positions(self, cfg, kind: str, model_type: str) -> None:
        """Refuse a position placement the base model's position kind cannot give."""

    def authors_split(self, state: dict) -> AuthorsCheckpoint:
        """Its authors' state dict (`authors_format`) taken apart (train/interop.py)."""
        raise ValueError(f"no authors' format for mechanism {self.name!r}")

    def authors_load(self, model, ckpt: AuthorsCheckpoint) -> None:
        """The memory (and whatever else of its own `ckpt` holds) into a model built from
        `authors_section`; the base weights are in the base checkpoint already."""
        model.memory_init.value.copy_(ckpt.memory)

    def authors_section(self, m: int, segment_size: int, **facts) -> dict:
        """The `model:` section of a model imported from the authors' format
        (`authors_format`; train/interop.py), before the backbone's fields."""
        raise ValueError(f"no authors' format for mechanism {self.name!r}")

    def authors_state(self, model) -> dict:
        """The authors' wrapper's state dict of a pretrained model (`memtrain export
        --format authors`)."""
        raise ValueError(f"no authors' format for mechanism {self.name!r}")


@dataclass
class AuthorsCheckpoint:
    """An authors' checkpoint taken apart: the base model's weights, the memory [m, d], the
    mechanism's own other tensors (in memtrain's names), the facts its `authors_section`
    takes (e.g. ARMT's d_key), and whether the authors' code may have appended the memory's
    rows to the base's learned position table (the ARMT authors' wrap_pos: the importer
    looks at the table's size)."""
    base_state: dict
    memory: Any
    own: dict = field(default_factory=dict)
    facts: dict = field(default_factory=dict)
    may_widen_positions: bool = False


def register(cls: type[Mechanism]) -> type[Mechanism]:
    """Class decorator: make `cls` the mechanism `cls.name`."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if (cls.section is None) != (cls.options is None):
        raise ValueError(f"{cls.__name__}: section and options go together")
    if cls.state is not None:
        from .memory import _register as register_state
        register_state(cls.state)
    _REGISTRY[cls.name] = cls()
    return cls


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def _builtins() -> None:
    # `get` runs on every forward (`cfg.mech`): import only while a built-in is missing.
    for name in BUILTIN:   # each registers itself on import
        if name not in _REGISTRY:
            importlib.import_module(f"{__package__}.mechanisms.{_MODULES[name]}")


def get(name: str) -> Mechanism:
    """The mechanism `name`; "package.module:ClassName" imports the module first."""
    _builtins()
    if name not in _REGISTRY and ":" in name:
        module, _, attr = name.partition(":")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as err:
            raise ConfigError("model.mechanism", f"cannot import {name!r}: {err}") from None
        if not (isinstance(cls, type) and issubclass(cls, Mechanism)):
            raise ConfigError("model.mechanism", f"{name!r} is not a Mechanism subclass")
        if cls.name not in _REGISTRY:
            register(cls)
        _REGISTRY[name] = _REGISTRY[cls.name]
    if name not in _REGISTRY:
        raise ConfigError("model.mechanism", f"unknown mechanism {name!r}; choose one of "
                          f"{', '.join(names())} or name one as 'package.module:ClassName'")
    return _REGISTRY[name]


def _ordered() -> list[Mechanism]:
    """Every registered mechanism once: the built-in ones in `BUILTIN` order (whatever
    imported them first), then the others in registration order."""
    _builtins()
    seen: dict[int, Mechanism] = {}
    for mech in sorted(_REGISTRY.values(), key=lambda m: (
            BUILTIN.index(m.name) if m.name in BUILTIN else len(BUILTIN))):
        seen.setdefault(id(mech), mech)
    return list(seen.values())


def names() -> list[str]:
    """The registered mechanisms' names (`_ordered`)."""
    return [m.name for m in _ordered()]


def by_authors_format(fmt: str) -> Mechanism:
    """The mechanism whose authors' checkpoints `fmt` names (`memtrain import --format`)."""
    for mech in _ordered():
        if mech.authors_format == fmt:
            return mech
    raise ValueError(f"no mechanism imports the format {fmt!r}")


def sections(mechanism: str | None = None) -> dict[str, type]:
    """Every registered options section, by name -> its dataclass (`mechanism` first
    loaded, if it names a module)."""
    if isinstance(mechanism, str) and ":" in mechanism:
        get(mechanism)
    return {m.section: m.options for m in _ordered() if m.section is not None}
