"""Consolidate a DeepSpeed checkpoint into full fp32 weights and export one safetensors file.

ZeRO-1/2/3 keep the fp32 master weights partitioned in the optimizer files; DeepSpeed's
`get_fp32_state_dict_from_zero_checkpoint` reassembles them (the fallback that works for any
world size). ZeRO-0 keeps the whole module in the rank-0 model file.
"""

from __future__ import annotations

from pathlib import Path

import torch

from model import ModelConfig, build_model, save_model

from .checkpoint import CheckpointInfo


def fp32_state_dict(info: CheckpointInfo) -> dict[str, torch.Tensor]:
    if info.zero_stage == 0:
        states = torch.load(info.path / "mp_rank_00_model_states.pt", map_location="cpu",
                            weights_only=False)
        return {k: v.float() for k, v in states["module"].items()}
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    return get_fp32_state_dict_from_zero_checkpoint(str(info.path.parent), tag=info.tag)


def load_weights(info: CheckpointInfo, model_cfg: ModelConfig):
    """A plain (no DeepSpeed) MemoryLM with the checkpoint's weights."""
    model = build_model(model_cfg)
    state = fp32_state_dict(info)
    missing, unexpected = model.load_state_dict(state, strict=False)
    # Tied weights may be stored under one name only; anything else missing is an error.
    tied = {n for n, p in model.named_parameters(remove_duplicate=False)} - \
        {n for n, p in model.named_parameters()}
    missing = [m for m in missing if m not in tied]
    if missing or unexpected:
        raise ValueError(f"checkpoint {info.path} does not match the model config: missing "
                         f"{missing[:5]}, unexpected {unexpected[:5]}")
    return model


def export_checkpoint(info: CheckpointInfo, out: Path, model_cfg: ModelConfig) -> Path:
    if info is None:
        raise FileNotFoundError("no complete checkpoint to export")
    model = load_weights(info, model_cfg)
    return save_model(model, out, extra={"step": info.step, "checkpoint": info.path.name})
