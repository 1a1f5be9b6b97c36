"""The model the engine trains, with a pretrained base loaded sharded under ZeRO-3.

ZeRO-3 partitions every parameter over the ranks (Rajbhandari et al. 2020, §5.3), but a
model built whole first needs its whole weights on every rank until `deepspeed.initialize`
partitions them: a base that does not fit one device then cannot be trained at all. So for
`backbone: hf` at ZeRO-3 the base is built under `deepspeed.zero.Init`, each parameter
partitioned as soon as it is created, and filled from the checkpoint one module at a time
(transformers' own ZeRO-3 loading: `modeling_utils` asks `is_deepspeed_zero3_enabled()`,
then `integrations/deepspeed.py` `_load_state_dict_into_zero3_model` gathers one module's
parameters, rank 0 copies the checkpoint's values in, and they are partitioned again).
transformers enables that path while an `HfDeepSpeedConfig` with stage 3 is alive (it keeps
a weak reference to it). The memory parameters of the wrapper are created afterwards, outside
`zero.Init`: `deepspeed.initialize` partitions them (DeepSpeedZeRoOffload converts every
parameter that is not yet a ZeRO parameter).

At ZeRO-0/1/2 every rank holds the whole base anyway (only optimizer state and gradients
are partitioned), so it is loaded whole. At every stage the memory is drawn at the std of
the input embeddings as the run trains them (rounded to bf16 / fp16 in a half-precision
run, which is what zero.Init's load stores), so every stage starts from the same memory.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from model import ModelConfig, backbone_of, build_model
from model.pretrained.loading import load_base
from model.segment_lm import SegmentLM

from .deepspeed_setup import import_deepspeed
from .engine import zero_stage


def loads_sharded(model_cfg: ModelConfig, ds_config: dict) -> bool:
    """True when the base is loaded partitioned from the start (a backbone whose weights
    start from a pretrained checkpoint, at ZeRO-3)."""
    return backbone_of(model_cfg).loads_checkpoint and zero_stage(ds_config) == 3


@contextlib.contextmanager
def zero3_loading(ds_config: dict):
    """While inside, transformers' from_pretrained builds models under deepspeed.zero.Init
    with `ds_config` and loads the checkpoint into the partitions.

    Only while inside: the switch is process-wide, and every later from_pretrained in this
    process must load a plain, whole model (the final report's fp32 model in
    master_weights.py, and the export, which runs on rank 0 alone, where a zero.Init would
    wait for the other ranks forever). Nothing transformers runs in the training forward
    asks for it (only generate(), which the engine does not call)."""
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    switch = HfDeepSpeedConfig(ds_config)   # transformers holds only a weak reference
    try:
        yield switch
    finally:
        unset_hf_deepspeed_config()
        del switch


def zero_dtype(ds_config: dict) -> torch.dtype:
    """The dtype ZeRO keeps the module's parameters in (zero.Init reads the same keys)."""
    if ds_config.get("bf16", {}).get("enabled"):
        return torch.bfloat16
    if ds_config.get("fp16", {}).get("enabled"):
        return torch.float16
    return torch.float32


def memory_scale(base, dtype: torch.dtype) -> float:
    """The std of the base's input embeddings as the run trains them (in `dtype`), the
    same on every rank and at every stage: a ZeRO-3 partitioned embedding is gathered whole
    for the measurement (a collective) and partitioned again; a whole one in fp32 is
    rounded to `dtype` first, which is what zero.Init's load stores of it."""
    weight = base.get_input_embeddings().weight
    gathered = contextlib.nullcontext()
    if hasattr(weight, "ds_id"):
        gathered = import_deepspeed().zero.GatheredParameters([weight], modifier_rank=None)
    with gathered:
        return float(weight.detach().to(dtype).float().std())


def local_share(module: torch.nn.Module) -> tuple[int, int]:
    """(elements this rank holds, elements of the whole module) over its parameters: a
    ZeRO-3 parameter holds its partition in `ds_tensor` and an empty `data`."""
    local = full = 0
    for p in module.parameters():
        partition = getattr(p, "ds_tensor", None)
        local += p.numel() + (partition.numel() if partition is not None else 0)
        full += getattr(p, "ds_numel", p.numel())
    return local, full


def build_for_engine(model_cfg: ModelConfig, ds_config: dict,
                     is_main: bool = True) -> SegmentLM:
    """The model `deepspeed.initialize` gets. A pretrained base is loaded partitioned at
    ZeRO-3 (whole otherwise), and its memory drawn at the scale of the embeddings in the
    training dtype, so every stage starts from the same memory."""
    if not backbone_of(model_cfg).loads_checkpoint:
        return build_model(model_cfg)
    dtype, sharded = zero_dtype(ds_config), loads_sharded(model_cfg, ds_config)
    if not sharded:
        base = load_base(model_cfg)
    else:
        with zero3_loading(ds_config):
            base = load_base(model_cfg)
        local, full = local_share(base)
        shares = [local]
        if dist.is_initialized():
            shares = [None] * dist.get_world_size()
            dist.all_gather_object(shares, local)
        if is_main:
            print(f"memtrain: ZeRO-3 loaded the pretrained base partitioned: elements held "
                  f"per rank {shares} of {full}", flush=True)
    scale = (memory_scale(base, dtype) if model_cfg.mech.num_mem_tokens(model_cfg)
             else None)
    model = build_model(model_cfg, base=base, memory_scale=scale)
    if sharded:
        # The memory (and LoRA adapters) were made outside zero.Init, in fp32. DeepSpeed
        # casts a module to the training dtype only when none of it is partitioned yet
        # (engine._cast_module_mixed_precision), and ZeRO-3 keeps one dtype per group.
        for p in model.parameters():
            if not hasattr(p, "ds_id") and p.is_floating_point():
                p.data = p.data.to(dtype)
    return model
