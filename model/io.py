"""Single-file fp32 weights: save and load a MemoryLM with its config, no trainer needed.

The file is safetensors; the model config travels in its metadata, so
`load_model("model.safetensors")` rebuilds the exact model. Tied input/output weights are
stored once (safetensors' save_model de-duplicates shared tensors).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_model as _load_into
from safetensors.torch import save_model as _save_from

from data_pipeline.atomic import AtomicFile

from .config import ModelConfig
from .lm import MemoryLM, build_model

CONFIG_KEY = "memtrain_model_config"


def save_model(model: MemoryLM, path: str | Path, extra: dict | None = None) -> Path:
    path = Path(path)
    meta = {CONFIG_KEY: json.dumps(model.cfg.to_dict())}
    meta.update({k: str(v) for k, v in (extra or {}).items()})
    # safetensors writes by file name: into AtomicFile's temporary file, which is then
    # fsynced and renamed onto `path` (a killed export leaves the old file or none).
    with AtomicFile(path) as f:
        _save_from(model.float(), f.name, metadata=meta)
    return path


def read_config(path: str | Path) -> ModelConfig:
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if CONFIG_KEY not in meta:
        raise ValueError(f"{path} has no {CONFIG_KEY!r} metadata: not a memtrain export")
    return ModelConfig.from_dict(json.loads(meta[CONFIG_KEY]))


def load_model(path: str | Path, device: str | torch.device = "cpu") -> MemoryLM:
    """Rebuild the model from the file's config and load its weights (strictly)."""
    model = build_model(read_config(path))
    missing, unexpected = _load_into(model, str(path), strict=True, device=str(device))
    return model.to(device)
