"""Single-file fp32 weights: save and load a model with its config, no trainer needed.

The file is safetensors; the model config travels in its metadata, so
`load_model("model.safetensors")` rebuilds the exact model. Which weights the file holds
is the backbone's answer (model/backbones/): the native stack's are every weight, a
pretrained backbone's only what the run trained, its base being loaded again from the
checkpoint its config names.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from data_pipeline.atomic import AtomicFile

from .backbones import backbone_of, build_model
from .config import ConfigError, ModelConfig
from .segment_lm import SegmentLM
from .weights_file import (  # noqa: F401
    WeightsError,
    is_torch_file,
    read_safetensors,
    read_weights,
    safetensors_metadata,
)

CONFIG_KEY = "memtrain_model_config"


def save_model(model: SegmentLM, path: str | Path, extra: dict | None = None) -> Path:
    path = Path(path)
    backbone = backbone_of(model.cfg)
    meta = {CONFIG_KEY: json.dumps(model.cfg.to_dict()), **backbone.export_metadata(model.cfg)}
    meta.update({k: str(v) for k, v in (extra or {}).items()})
    # safetensors writes by file name: into AtomicFile's temporary file, which is then
    # fsynced and renamed onto `path` (a killed export leaves the old file or none).
    with AtomicFile(path) as f:
        backbone.write_weights(model, f.name, meta)
    return path


def read_config(path: str | Path) -> ModelConfig:
    """The model config a model file carries (its tensors are not read); a WeightsError
    for any file that is not a memtrain model file, naming what it is not."""
    meta = model_file_metadata(path)
    try:
        return ModelConfig.from_dict(json.loads(meta[CONFIG_KEY]))
    except ConfigError as err:
        raise WeightsError(f"{path} was written with a model config this code does not "
                           f"accept: {err}") from None
    except (ValueError, TypeError) as err:
        raise WeightsError(f"{path} has a {CONFIG_KEY!r} that is not a model config "
                           f"({err})") from None


def model_file_metadata(path: str | Path) -> dict[str, str]:
    """The safetensors metadata of a memtrain model file (what `memtrain export` and
    `memtrain import` write), refusing other files in one sentence: a torch checkpoint (a
    state dict of the authors' wrapper comes in through `memtrain import`), a file that is
    no safetensors, a safetensors file without the model config."""
    if is_torch_file(path):
        raise WeightsError(f"{path} is a PyTorch checkpoint, not a memtrain model file (the "
                           "model.safetensors `memtrain export` or `memtrain import` "
                           "writes; a state dict of the authors' wrapper comes in through "
                           "`memtrain import`)")
    meta = safetensors_metadata(path)
    if CONFIG_KEY not in meta:
        raise WeightsError(f"{path} is a safetensors file but not a memtrain model file (no "
                           f"{CONFIG_KEY!r} metadata; `memtrain export` and `memtrain "
                           "import` write one)")
    return meta


def load_initial(model: SegmentLM, path: str | Path) -> list[str]:
    """Start `model` from the weights of a model file (`init_from`): every tensor the file
    holds must be a parameter of `model` of the same shape, and the file's mechanism and
    attention pattern must be the model's (the same weights under another pattern are
    another model); the parameters the file does not hold (e.g. LoRA adapters a fine-tune
    adds to an imported memory) keep their initialisation. Returns the names loaded; a
    ValueError naming the file (a WeightsError for one that is no memtrain model file)
    otherwise."""
    saved = read_config(path)
    mech = model.cfg.mech
    for field, ours, theirs in (("model.mechanism", model.cfg.mechanism, saved.mechanism),
                                *((f"model.{mech.section}.{name}",
                                   getattr(mech.opts(model.cfg), name),
                                   getattr(mech.opts(saved), name))
                                  for name in mech.identity_fields)):
        if ours != theirs:
            raise ValueError(f"{path}: the file's {field} is {theirs!r}, the run's "
                             f"{ours!r}; set {field}={theirs}")
    state = read_safetensors(path)
    params = dict(model.named_parameters())
    unknown = sorted(set(state) - set(params))
    shapes = [f"{n}: file {tuple(t.shape)}, model {tuple(params[n].shape)}"
              for n, t in state.items() if n in params and t.shape != params[n].shape]
    empty = [n for n in state if n in params and params[n].numel() == 0]
    if unknown or shapes or empty:
        raise ValueError(f"{path} does not fit this model: not its parameters "
                         f"{unknown[:8]}, shapes {shapes[:8]}, partitioned by ZeRO-3 "
                         f"{empty[:8]} (start from a file that holds only memory and "
                         "adapters, or below ZeRO-3)")
    with torch.no_grad():
        for name, tensor in state.items():
            params[name].copy_(tensor)
    return sorted(state)


def load_model(path: str | Path, device: str | torch.device = "cpu") -> SegmentLM:
    """Rebuild the model from the file's config and load its weights (strictly). A
    pretrained backbone loads its base from `model.hf` first, then the trained weights."""
    model = build_model(read_config(path))
    backbone_of(model.cfg).load_weights(model, str(path), device)
    return model.to(device)
