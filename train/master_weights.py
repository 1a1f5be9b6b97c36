"""Which weights an evaluation scores, and the fp32 master weights of a half-precision run
as a plain model.

In a bf16 / fp16 run DeepSpeed casts the engine's module to the training dtype and keeps
the fp32 master copy in its optimizer wrapper, which the updates are applied to
(train/precision.py). So the same run holds two models: validations during training score
the half-precision training copy (what the next steps compute with), while the checkpoint's
consolidated weights, `memtrain export` and `memtrain eval` are the fp32 master copy (at
ZeRO 1-3; `checkpoint_weights`). The final report of a run (`[final step N]`,
eval_report.json) scores the fp32 master copy, so that it is the number `memtrain eval`
gives for the last checkpoint, and every protocol line says which copy it scored
(`scored_weights`). In an fp32 run the two are one model.

`fp32_master_model` gathers the master copy in memory, where DeepSpeed keeps it:
- ZeRO-1/2/3 and DeepSpeed's bf16 optimizer (bf16 at ZeRO-1 with fp32 gradient sums):
  `deepspeed.utils.safe_get_full_fp32_param`, which reassembles a parameter's fp32
  partitions from all ranks (a collective);
- no ZeRO (fp16 / bf16 with `deepspeed.grad_dtype: half` at stage 0): the FP16 optimizer
  wrappers' own fp32 copies (`fp32_groups`, or `fp32_groups_flat` for the fused one) of their
  `fp16_groups` (deepspeed/runtime/fp16/), every rank holding all of it.
"""

from __future__ import annotations

import torch

from model import ModelConfig, backbone_of, build_model

from .deepspeed_setup import import_deepspeed

MASTER = "fp32 (master copy)"


def gathers_masters(model_cfg: ModelConfig, zero_stage: int) -> bool:
    """Whether the final report of a half-precision run gathers its fp32 masters into a
    whole model on every rank. Not for a pretrained backbone at ZeRO-3: its base is sharded
    because one device need not hold it whole (train/pretrained.py), so the report scores
    the training copy and says so; `memtrain eval` of the checkpoint scores the masters."""
    return not (backbone_of(model_cfg).loads_checkpoint and zero_stage == 3)


def scored_weights(precision: str, final: bool, masters: bool = True) -> str:
    """The words of EvalProtocol.weights for an evaluation of a `precision` run: the final
    report scores the fp32 master copy (when `masters`: `gathers_masters`), the validations
    the training copy."""
    if precision == "fp32":
        return "fp32"
    return MASTER if final and masters else f"{precision} (training copy)"


def checkpoint_weights(precision: str, zero_stage: int) -> str:
    """The words of EvalProtocol.weights for the weights `memtrain eval` reads from a
    checkpoint of a `precision` run (train/export.py, fp32_state_dict): the fp32 master
    copy, consolidated from the optimizer files, at ZeRO 1-3; without ZeRO the module
    file's weights, which are the training copy (a bf16/fp16 run at ZeRO-0 keeps its fp32
    copies only inside the optimizer's state, with no parameter names to read them by)."""
    if precision == "fp32" or zero_stage > 0:
        return scored_weights(precision, final=True)
    return f"{precision} (training copy)"


def _fp16_optimizer_masters(optimizer) -> dict[int, torch.Tensor]:
    """{id(training parameter): its fp32 master} of DeepSpeed's FP16_Optimizer /
    FP16_UnfusedOptimizer (no ZeRO); empty for any other optimizer."""
    groups = getattr(optimizer, "fp16_groups", None)
    if groups is None:
        return {}
    if hasattr(optimizer, "fp32_groups_flat"):          # fused: one flat tensor per group
        from torch._utils import _unflatten_dense_tensors

        masters = [_unflatten_dense_tensors(flat, group)
                   for flat, group in zip(optimizer.fp32_groups_flat, groups, strict=True)]
    elif hasattr(optimizer, "fp32_groups"):             # unfused: one tensor per parameter
        masters = optimizer.fp32_groups
    else:
        return {}
    return {id(p): m for group, ms in zip(groups, masters, strict=True)
            for p, m in zip(group, ms, strict=True)}


def master_state(engine) -> dict[str, torch.Tensor] | None:
    """{parameter name: full fp32 master tensor} of the engine's module's trained
    parameters; None when DeepSpeed keeps no master copy this code knows. Frozen parameters
    (a pretrained base with `model.hf.finetune` frozen or lora) are not in the optimizer, so
    they have no master: they are the pretrained weights, which `build_model` loads in fp32.
    Collective: every rank calls it."""
    import_deepspeed()
    from deepspeed.utils import safe_get_full_fp32_param

    fallback: dict[int, torch.Tensor] | None = None
    out = {}
    for name, param in engine.module.named_parameters():
        if not param.requires_grad:
            continue
        full = safe_get_full_fp32_param(param)
        if full is None:
            if fallback is None:
                fallback = _fp16_optimizer_masters(engine.optimizer)
            full = fallback.get(id(param))
        if full is None:
            return None
        out[name] = full.detach()
    return out


def fp32_master_model(engine, model_cfg: ModelConfig, device: torch.device):
    """A plain fp32 model (no DeepSpeed) holding the engine's fp32 master weights, on
    `device`; None when no master copy was found. Collective (master_state)."""
    state = master_state(engine)
    if state is None:
        return None
    with torch.random.fork_rng(devices=[]):   # its random init must not move the run's RNG
        model = build_model(model_cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad:  # the frozen rest: the base as build_model loaded it
                param.copy_(state[name].reshape(param.shape))
    return model.to(device)
