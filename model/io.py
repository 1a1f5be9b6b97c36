"""Single-file fp32 weights: save and load a model with its config, no trainer needed.

The file is safetensors; the model config travels in its metadata, so
`load_model("model.safetensors")` rebuilds the exact model.

- The native stack (`backbone: native`): every weight. Tied input/output weights are stored
  once (safetensors' save_model de-duplicates shared tensors).
- A pretrained backbone (`backbone: hf`, model/pretrained/): only what the run trained
  (`trained_parameter_names`: every base weight with `finetune: full`, the memory parameters
  with `frozen`, the memory and the LoRA adapters with `lora`). The rest is the pretrained
  checkpoint itself, which `load_model` loads again from the metadata's base path, revision
  and GGUF file (the config's `model.hf`); so a frozen export of a 7B model is a few
  kilobytes, and the base must still be at that path.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file as _read_tensors
from safetensors.torch import load_model as _load_into
from safetensors.torch import save_file as _save_tensors
from safetensors.torch import save_model as _save_from

from data_pipeline.atomic import AtomicFile

from .config import ModelConfig
from .lm import build_model
from .segment_lm import SegmentLM

CONFIG_KEY = "memtrain_model_config"
# The pretrained base an `hf` export's weights go with (also inside the config; here for
# anyone reading the file's metadata without memtrain).
BASE_KEYS = {"memtrain_base_path": "path", "memtrain_base_revision": "revision",
             "memtrain_base_gguf_file": "gguf_file", "memtrain_finetune": "finetune"}


def exported_names(model: SegmentLM) -> list[str] | None:
    """The parameter names an export of `model` holds: what a pretrained backbone trained;
    None for the native stack (its whole state dict)."""
    if model.cfg.backbone == "hf":
        return model.trained_parameter_names()
    return None


def trained_state(model: SegmentLM) -> dict[str, torch.Tensor]:
    """{name: fp32 copy} of the parameters a pretrained backbone's export holds."""
    params = dict(model.named_parameters())
    return {name: params[name].detach().float().cpu().contiguous().clone()
            for name in exported_names(model)}


def save_model(model: SegmentLM, path: str | Path, extra: dict | None = None) -> Path:
    path = Path(path)
    meta = {CONFIG_KEY: json.dumps(model.cfg.to_dict())}
    if model.cfg.backbone == "hf":
        meta.update({key: str(getattr(model.cfg.hf, field)) for key, field in BASE_KEYS.items()})
    meta.update({k: str(v) for k, v in (extra or {}).items()})
    # safetensors writes by file name: into AtomicFile's temporary file, which is then
    # fsynced and renamed onto `path` (a killed export leaves the old file or none).
    with AtomicFile(path) as f:
        if model.cfg.backbone == "hf":
            _save_tensors(trained_state(model), f.name, metadata=meta)
        else:
            _save_from(model.float(), f.name, metadata=meta)
    return path


def read_config(path: str | Path) -> ModelConfig:
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if CONFIG_KEY not in meta:
        raise ValueError(f"{path} has no {CONFIG_KEY!r} metadata: not a memtrain export")
    return ModelConfig.from_dict(json.loads(meta[CONFIG_KEY]))


def load_trained(model: SegmentLM, state: dict[str, torch.Tensor], source: str) -> None:
    """Copy a pretrained backbone's trained parameters from `state` into `model`, strictly:
    exactly the names `model` trains, each of its shape (the frozen rest is the base)."""
    names = exported_names(model)
    params = dict(model.named_parameters())
    missing = sorted(set(names) - set(state))
    unexpected = sorted(set(state) - set(names))
    shapes = [f"{n}: file {tuple(state[n].shape)}, model {tuple(params[n].shape)}"
              for n in names if n in state and state[n].shape != params[n].shape]
    if missing or unexpected or shapes:
        raise ValueError(
            f"{source} does not hold what this model trains (model.hf.finetune "
            f"{model.cfg.hf.finetune!r}): missing {missing[:8]}, unexpected {unexpected[:8]}, "
            f"shapes {shapes[:8]}")
    with torch.no_grad():
        for name in names:
            params[name].copy_(state[name])


def load_initial(model: SegmentLM, path: str | Path) -> list[str]:
    """Start `model` from the weights of a model file (`init_from`): every tensor the file
    holds must be a parameter of `model` of the same shape, and the file's mechanism and
    attention pattern must be the model's (the same weights under another pattern are
    another model); the parameters the file does not hold (e.g. LoRA adapters a fine-tune
    adds to an imported memory) keep their initialisation. Returns the names loaded."""
    saved = read_config(path)
    mech = model.cfg.mech
    for field, ours, theirs in (("model.mechanism", model.cfg.mechanism, saved.mechanism),
                                *((f"model.{mech.section}.{name}",
                                   getattr(mech.opts(model.cfg), name),
                                   getattr(mech.opts(saved), name))
                                  for name in mech.identity_fields)):
        if ours != theirs:
            raise ValueError(f"init_from {path}: the file's {field} is {theirs!r}, the run's "
                             f"{ours!r}; set {field}={theirs}")
    state = _read_tensors(str(path))
    params = dict(model.named_parameters())
    unknown = sorted(set(state) - set(params))
    shapes = [f"{n}: file {tuple(t.shape)}, model {tuple(params[n].shape)}"
              for n, t in state.items() if n in params and t.shape != params[n].shape]
    empty = [n for n in state if n in params and params[n].numel() == 0]
    if unknown or shapes or empty:
        raise ValueError(f"init_from {path} does not fit this model: not its parameters "
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
    if model.cfg.backbone == "hf":
        load_trained(model, _read_tensors(str(path)), str(path))
    else:
        _load_into(model, str(path), strict=True, device=str(device))
    return model.to(device)
