"""Consolidate a DeepSpeed checkpoint into full fp32 weights and export one safetensors file.

ZeRO-1/2/3 keep the fp32 master weights partitioned in the optimizer files; DeepSpeed's
`get_fp32_state_dict_from_zero_checkpoint` reassembles them (the fallback that works for any
world size). ZeRO-0 keeps the whole module in the rank-0 model file.

A pretrained backbone (`model.backbone: hf`) with a frozen or LoRA-adapted base trains only
some parameters: the optimizer holds only those (train/engine.py build_optimizer), so only
they have fp32 masters. What DeepSpeed keeps of the frozen rest differs by stage (the module
file at ZeRO-0/1/2, in the training dtype; separate "frozen fragments" at ZeRO-2/3), and none
of it is needed: the frozen weights are the pretrained checkpoint's, which `build_model`
loads again in fp32 from `model.hf`. So only the names its export holds are read from the
consolidated state (model/backbones/ `load_state`), strictly.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from model import ConfigError, ModelConfig, backbone_of, build_model, save_model
from model.weights_file import torch_load

from .checkpoint import CheckpointInfo
from .deepspeed_setup import import_deepspeed


def _load(path: Path) -> dict:
    """A file DeepSpeed wrote into the run's own checkpoint (trusted: it pickles optimizer
    objects, so not weights_only); a truncated or foreign file is a WeightsError naming it,
    not torch.load's traceback."""
    return torch_load(path, weights_only=False)


def _optimizer_files(info: CheckpointInfo) -> list[Path]:
    """Each rank's optimizer file (`zero_pp_rank_R_...`, `bf16_zero_pp_rank_R_...`), in
    rank order."""
    files = info.path.glob("*zero_pp_rank_*_mp_rank_00_optim_states.pt")
    return sorted(files, key=lambda f: int(f.name.split("zero_pp_rank_")[1].split("_")[0]))


def _bf16_optimizer_state_dict(info: CheckpointInfo, files: list[Path]) -> dict:
    """The fp32 master weights of DeepSpeed's bf16 optimizer (bf16 at ZeRO-1 with fp32
    gradient sums, deepspeed/runtime/bf16_optimizer.py). It partitions each parameter
    group's flat fp32 copy over the ranks as ZeRO-1 does (the parameters back to back, the
    group padded at its end to a multiple of the ranks), but its files carry no `zero_stage`,
    which DeepSpeed's zero_to_fp32 requires. So: the ranks' partitions in rank order, the
    padding dropped, cut at the parameters' shapes (the model file's `param_shapes`)."""
    states = _load(info.path / "mp_rank_00_model_states.pt")
    parts = [_load(f)["optimizer_state_dict"]["single_partition_of_fp32_groups"]
             for f in files]
    out = {}
    for g, shapes in enumerate(states["param_shapes"]):
        flat = torch.cat([part[g] for part in parts])
        numels = [shape.numel() for shape in shapes.values()]
        if sum(numels) > flat.numel():
            raise ValueError(f"{info.path}: the optimizer files hold {flat.numel()} values of "
                             f"group {g}, its parameters need {sum(numels)}")
        for (name, shape), piece in zip(shapes.items(), flat.split(numels), strict=False):
            out[name] = piece.view(shape).clone()
    buffers = set(states.get("buffer_names", []))
    out.update({k: v.float() for k, v in states["module"].items() if k in buffers})
    return out


def fp32_state_dict(info: CheckpointInfo) -> dict[str, torch.Tensor]:
    if info.zero_stage == 0:
        states = _load(info.path / "mp_rank_00_model_states.pt")
        return {k: v.float() for k, v in states["module"].items()}
    files = _optimizer_files(info)
    if files and "zero_stage" not in _load(files[0])["optimizer_state_dict"]:
        return _bf16_optimizer_state_dict(info, files)
    import_deepspeed()
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    # It prints its progress; stdout belongs to our commands' results (tables, JSON, text).
    with contextlib.redirect_stdout(sys.stderr):
        return get_fp32_state_dict_from_zero_checkpoint(str(info.path.parent), tag=info.tag)


# Model fields that only change how the weights are run (evaluation lengths, speed knobs,
# regularisation): a checkpoint may be loaded under other values. All others shape the model.
RUNTIME_FIELDS = ("tgt_len", "mem_len", "clamp_len", "same_length", "dropout", "dropatt",
                  "attn_impl", "checkpoint_layers", "compile", "compile_backend",
                  "paper_attention")


def _differences(saved: dict, wanted: dict, prefix: str = "model") -> list[tuple]:
    """(field, checkpoint value, config value) for every shape-relevant field that differs."""
    out = []
    for key in sorted(set(saved) | set(wanted)):
        a, b = saved.get(key, "<absent>"), wanted.get(key, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}.{key}")
        elif a != b and key not in RUNTIME_FIELDS:
            out.append((f"{prefix}.{key}", a, b))
    return out


def check_model_config(info: CheckpointInfo, model_cfg: ModelConfig) -> None:
    """Fail, naming the field, when the checkpoint was trained as another model than
    `model_cfg` describes, or with a config this code no longer understands."""
    saved = info.meta.get("model")
    if saved is None:  # checkpoints written before the config was recorded
        return
    try:
        # Read back through the config class, so a field this code added since the
        # checkpoint was written takes its default (the value the checkpoint's model ran
        # with) instead of being reported as changed.
        saved = ModelConfig.from_dict(saved).to_dict()
    except ConfigError as err:
        raise ConfigError(err.field, f"the checkpoint {info.path} was written with a model "
                          f"config this code does not accept: {err}") from None
    diffs = _differences(saved, model_cfg.to_dict())
    if diffs:
        field, a, b = diffs[0]
        more = "".join(f"; {f}: {x!r} vs {y!r}" for f, x, y in diffs[1:])
        raise ConfigError(field, f"the checkpoint {info.path} was trained with {a!r}, the "
                          f"config says {b!r}{more}")


def load_weights(info: CheckpointInfo, model_cfg: ModelConfig):
    """A plain (no DeepSpeed) model with the checkpoint's weights (fp32)."""
    check_model_config(info, model_cfg)
    model = build_model(model_cfg)
    backbone_of(model_cfg).load_state(model, fp32_state_dict(info), f"checkpoint {info.path}")
    return model


def load_weights_once(info: CheckpointInfo, model_cfg: ModelConfig, device: torch.device):
    """`load_weights` for a group of ranks: rank 0 consolidates the fp32 weights and
    broadcasts them; the other ranks only build the model. Consolidating a ZeRO checkpoint
    reads every rank's optimizer partition (~12 bytes per parameter), so done on each of N
    ranks it reads the checkpoint N times, all at once, from shared storage. A failure on
    rank 0 (wrong config, missing files) is raised on every rank, so none waits forever."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return load_weights(info, model_cfg).to(device)
    model, failure = None, [None]
    if dist.get_rank() == 0:
        try:
            model = load_weights(info, model_cfg)
        except (ValueError, OSError, KeyError) as err:  # ConfigError is a ValueError
            failure = [(type(err).__name__, str(err))]
    dist.broadcast_object_list(failure, src=0)
    if failure[0] is not None:
        kind, text = failure[0]
        raise (FileNotFoundError if kind == "FileNotFoundError" else ValueError)(
            f"rank 0 could not load {info.path}: {text}")
    if model is None:
        model = build_model(model_cfg)
    model = model.to(device)
    # Every rank builds the same names in order. A pretrained backbone's frozen weights are
    # the base every rank loaded from `model.hf`: only the trained ones travel.
    names = backbone_of(model_cfg).exported_names(model)
    tensors = (model.state_dict().values() if names is None
               else [dict(model.named_parameters())[n] for n in names])
    with torch.no_grad():
        for tensor in tensors:
            dist.broadcast(tensor.data, src=0)
    return model


def export_checkpoint(info: CheckpointInfo, out: Path, model_cfg: ModelConfig) -> Path:
    if info is None:
        raise FileNotFoundError("no complete checkpoint to export")
    model = load_weights(info, model_cfg)
    return save_model(model, out, extra={"step": info.step, "checkpoint": info.path.name})
