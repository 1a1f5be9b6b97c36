"""model/backbones/: the backbones, one interface (base.py `Backbone`), looked up by
`model.backbone` in one registry.

    base.py        what is asked of a backbone: build, plan shapes, export and load, the
                   vocabulary it reads, the segment lengths it can place, what training and
                   submission need of it
    native.py      the relative-position stack of model/backbone.py (`native`)
    pretrained.py  a pretrained Hugging Face causal LM with memory tokens (`hf`)

A ModelConfig is built without reading anything; a backbone whose shape is its checkpoint's
reads it in a step of its own, `resolve_shape`, which every entry point that builds a run
config or a model calls (train/config.py `load_config`, `build_model`, the interop and the
evaluation tools). A new backbone is one class and one line of `BACKBONES` (and its
`BackboneTraits` in model/config.py).
"""

from __future__ import annotations

from ..config import ModelConfig
from .base import Backbone
from .native import NativeBackbone
from .pretrained import PretrainedBackbone

BACKBONES: dict[str, Backbone] = {b.name: b for b in (NativeBackbone(), PretrainedBackbone())}


def backbone_of(cfg: ModelConfig) -> Backbone:
    """The backbone `cfg.backbone` names (ModelConfig refuses any other name)."""
    return BACKBONES[cfg.backbone]


def resolve_shape(cfg: ModelConfig) -> ModelConfig:
    """Read the shape fields of `cfg` where its backbone keeps them (a pretrained
    checkpoint's config), in place, and return `cfg`; the native stack's are its own."""
    return backbone_of(cfg).resolve_shape(cfg)


def build_model(cfg: ModelConfig | dict, **kwargs):
    """Build a model from a ModelConfig or a plain dict (validated either way), its shape read
    first: the native stack, or a pretrained backbone with memory tokens (`backbone: hf`;
    `kwargs` are `PretrainedMemoryLM`'s, e.g. an already loaded base model)."""
    if isinstance(cfg, dict):
        cfg = ModelConfig.from_dict(cfg)
    return backbone_of(cfg).build(resolve_shape(cfg), **kwargs)


def check_segment_positions(cfg: ModelConfig, seg_len: int, option: str) -> None:
    """Refuse (ConfigError naming `option`: "seg_len", "eval.tgt_len", "--seg-len") a
    segment length the backbone cannot place, e.g. one past a pretrained model's learned
    position table. Every tool that reads a model at another segment length than
    `cfg.tgt_len` asks this first."""
    backbone_of(cfg).check_segment_positions(cfg, seg_len, option)


def shape_class(cfg: ModelConfig):
    """What states a segment's shapes (`segment_shapes`, model/shapes.py) for `cfg`: the
    mechanism's class for the native stack, model/pretrained/shapes.py's for a pretrained
    backbone, which also counts its parameters without weights (`parameter_counts`)."""
    return backbone_of(cfg).shape_class(cfg)


__all__ = ["BACKBONES", "Backbone", "NativeBackbone", "PretrainedBackbone", "backbone_of",
           "build_model", "check_segment_positions", "resolve_shape", "shape_class"]
