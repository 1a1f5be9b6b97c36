"""Numeric precision of a run: what a device can train in, what each dtype holds, TF32.

`deepspeed.precision` chooses the training copy of the model; DeepSpeed does the casting
(deepspeed/runtime/engine.py casts the module, the optimizer wrapper keeps the master copy):

- fp32: everything fp32.
- bf16: the model runs with bf16 weights; activations and the carried memory (the XL and
  LaMemo caches, RMT's memory tokens) are bf16, but for LaMemo's log-normalisers (fp32 by
  design, model/mechanisms/lamemo/core.py); the optimizer keeps fp32 master weights and fp32 Adam
  moments; gradients are summed in fp32 (`deepspeed.grad_dtype`).
- fp16: as bf16 in fp16, with the loss scaled (dynamic loss scaling, skipped steps).

So a checkpoint of a bf16 run holds bf16 module weights, fp32 master weights and moments
(DeepSpeed's optimizer files) and each row's memory as carried; the universal conversion and
`memtrain export` read the fp32 master weights. tests/test_bf16_engine.py checks each line.

Why the gradients are summed in fp32 by default: bf16 keeps 8 bits of mantissa, so a sum
of 32 ranks' gradients, or of many micro-steps, rounds each addend to ~0.4% of the running
sum; in fp32 the sum is exact to ~1e-7 and rounded to bf16 once. The cost is fp32 gradient
buffers (4 bytes per parameter instead of 2) and twice the bytes on the wire for the
gradient all-reduce or reduce-scatter. `deepspeed.grad_dtype: half` takes DeepSpeed's own
default instead (sums in the training dtype). BENCHMARKS.md ("Gradient sums in bf16")
measures the difference.
"""

from __future__ import annotations

import sys

import torch

from .config import ConfigError, DeepSpeedSection
from .deepspeed_setup import import_deepspeed

HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
AMPERE = (8, 0)   # bf16 tensor cores and TF32 (NVIDIA A100 whitepaper, "TF32")


def training_dtype(precision: str) -> torch.dtype:
    return HALF.get(precision, torch.float32)


def _accelerator_supports(precision: str) -> bool | None:
    """DeepSpeed's own answer for a device that is not CUDA (its engine refuses the same)."""
    import_deepspeed()
    from deepspeed.accelerator import get_accelerator
    accel = get_accelerator()
    return accel.is_bf16_supported() if precision == "bf16" else accel.is_fp16_supported()


def check_precision(precision: str, device: torch.device) -> None:
    """Refuse, with the reason, a precision the device cannot train in (before any engine)."""
    if precision == "fp32":
        return
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if precision == "bf16" and cap < AMPERE:
            raise ConfigError("deepspeed.precision", f"bf16 needs compute capability 8.0 "
                              f"(Ampere) or newer; {torch.cuda.get_device_name(device)} is "
                              f"{cap[0]}.{cap[1]}: use fp16 (dynamic loss scaling)")
        return
    if not _accelerator_supports(precision):
        from deepspeed.accelerator import get_accelerator
        name = get_accelerator().device_name()
        raise ConfigError("deepspeed.precision", f"{precision} is not supported by "
                          f"DeepSpeed's {name!r} accelerator on this {device.type} device "
                          "(fp16 with loss scaling runs on CUDA GPUs, e.g. V100); use bf16 or "
                          "fp32 here")


def precision_sections(s: DeepSpeedSection, zero_stage: int) -> dict:
    """The ds_config sections that carry the precision: bf16, fp16 (dynamic loss scaling),
    and, for bf16/fp16 with `grad_dtype: fp32`, fp32 gradient accumulation
    (data_types.grad_accum_dtype) and fp32 all-reduce / reduce-scatter
    (communication_data_type)."""
    out = {"bf16": {"enabled": s.precision == "bf16"},
           # fp16 (V100): dynamic loss scaling; an overflowing step is skipped by DeepSpeed.
           "fp16": {"enabled": s.precision == "fp16", "loss_scale": 0,
                    "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
                    "min_loss_scale": 1}}
    if s.precision in HALF and s.grad_dtype == "fp32":
        if zero_stage == 0:
            # DeepSpeed 0.19 sums half-precision gradients in fp32 only inside a ZeRO
            # optimizer (runtime/engine.py, _do_optimizer_sanity_check raises otherwise).
            raise ConfigError("deepspeed.grad_dtype", f"fp32 gradient sums under "
                              f"{s.precision} need ZeRO stage 1, 2 or 3 (DeepSpeed has no "
                              "fp32 accumulation without ZeRO); use zero_stage 1 (same "
                              "memory as 0 for the weights) or grad_dtype=half")
        out["data_types"] = {"grad_accum_dtype": "fp32"}
        out["communication_data_type"] = "fp32"
    return out


def configure_matmul(precision: str, tf32: bool, device: torch.device,
                     is_main: bool) -> str:
    """Set the fp32 matmul mode for this process and say what the run computes in.

    On a CUDA GPU of compute capability 8.0 or newer an fp32 run multiplies in TF32 unless
    `deepspeed.tf32: false` (torch's default is full fp32: several times slower on an A100);
    an fp32 run on any GPU is announced loudly, since bf16 / fp16 is what such a job should
    normally use. Returns the one-line description printed at start."""
    if device.type != "cuda":
        return f"{precision} on {device.type}"
    name = torch.cuda.get_device_name(device)
    cap = torch.cuda.get_device_capability(device)
    if precision != "fp32":
        return f"{precision} on {name} (compute capability {cap[0]}.{cap[1]})"
    use_tf32 = tf32 and cap >= AMPERE
    torch.set_float32_matmul_precision("high" if use_tf32 else "highest")
    mode = "TF32 matmuls" if use_tf32 else "full fp32 matmuls"
    if is_main:
        better = "bf16" if cap >= AMPERE else "fp16"
        print(f"memtrain: WARNING: this GPU job trains in fp32 ({mode}) on {name}, "
              f"compute capability {cap[0]}.{cap[1]}: deepspeed.precision={better} is "
              f"usually several times faster and halves activation memory. If fp32 is "
              f"what you want, ignore this.", file=sys.stderr, flush=True)
    return f"fp32 ({mode}) on {name} (compute capability {cap[0]}.{cap[1]})"
