"""A job's rank layout against its run config, checked by `memtrain submit` before sbatch.

What would stop the ranks at start, or waste the allocation, is refused at submit time with
the fix named:

    rows          data.global_batch and eval.batch must divide among nodes x tasks-per-node
                  ranks. The rule is `data_pipeline.streams.rows_of_rank`, the function the
                  trainer's start check (`train.trainer.check_run`) and the DeepSpeed config
                  (`train.engine.build_ds_config`) call, so submit and start cannot disagree.
    GPUs/tasks    one rank per GPU: more tasks than GPUs per node would put two ranks on a GPU
                  (train/gpu_binding.py refuses that at start), fewer leave GPUs idle.
    precision     bf16 needs compute capability 8.0 (Ampere) or newer; a V100 (7.0) trains in
                  fp16 with loss scaling, a CPU job in fp32 (check_run refuses the rest).

The GPU generation comes from `--gpu-type` (also the type in --gres=gpu:<type>:<n>), read
as SLURM gres and NVML name GPUs ("tesla_v100", "nvidia_a100-sxm4-80gb", "NVIDIA H100 80GB
HBM3": `gpu_model`); an unknown type is not checked for precision, and submit says so
(`precision_warnings`), loudly when the GPUs would then train in fp32.
"""

from __future__ import annotations

import re

from data_pipeline.streams import LayoutError, rows_of_rank
from train.config import ConfigError, RunConfig

# Compute capability (major, minor) per GPU model, from NVIDIA's list of CUDA GPUs
# (developer.nvidia.com/cuda-gpus).
GPU_CAPABILITY = {
    "p100": (6, 0), "v100": (7, 0), "t4": (7, 5), "rtx8000": (7, 5),
    "a100": (8, 0), "a30": (8, 0), "a10": (8, 6), "a10g": (8, 6), "a40": (8, 6),
    "a6000": (8, 6), "l4": (8, 9), "l40": (8, 9), "l40s": (8, 9),
    "h100": (9, 0), "h200": (9, 0), "gh200": (9, 0), "b200": (10, 0),
}
BF16_CAPABILITY = (8, 0)
# Words of a GPU name that are not its model: the vendor and product lines of NVML's names
# ("Tesla V100-SXM2-32GB", "NVIDIA A100-SXM4-80GB", "Quadro RTX 8000") and of SLURM gres
# types written from them ("tesla_v100", "nvidia_a100-sxm4-80gb").
_VENDOR_WORDS = {"nvidia", "tesla", "geforce", "quadro"}


def gpu_model(gpu_type: str) -> str | None:
    """The model of a GPU type name (a key of GPU_CAPABILITY), or None when none is named.

    The name is split into words at '_', '-' and spaces, vendor words dropped, and a word
    (or two adjacent words run together: "RTX 8000") must equal a model exactly: a prefix
    would read a10 as a100 and l4 as l40, or miss "tesla_v100". Memory sizes and form
    factors ("80gb", "sxm4", "hbm3", "pcie") are words of their own and match nothing."""
    words = [w for w in re.split(r"[_\-\s]+", gpu_type.lower())
             if w and w not in _VENDOR_WORDS]
    for i, word in enumerate(words):
        for candidate in (word, word + "".join(words[i + 1:i + 2])):
            if candidate in GPU_CAPABILITY:
                return candidate
    return None


def gpu_capability(gpu_type: str) -> tuple[int, int] | None:
    """Compute capability of a GPU type name as SLURM gres or NVML write it (gpu_model),
    None for a name that names no known model."""
    model = gpu_model(gpu_type)
    return GPU_CAPABILITY[model] if model else None


def default_precision(gpu_type: str) -> str | None:
    """What a GPU generation trains in when the overrides do not choose: bf16 from Ampere on,
    fp16 with dynamic loss scaling before (V100 has no bf16); None for an unknown type."""
    cap = gpu_capability(gpu_type) if gpu_type else None
    if cap is None:
        return None
    return "bf16" if cap >= BF16_CAPABILITY else "fp16"


def job_precision(config_precision: str, overrides: list[str], gpu_type: str
                  ) -> tuple[str, bool]:
    """(precision the ranks will use, whether the script must add the override): an explicit
    `deepspeed.precision=` override wins, else the GPU generation's default, else the config."""
    chosen = any(o.startswith("deepspeed.precision=") for o in overrides)
    default = None if chosen else default_precision(gpu_type)
    return (default, True) if default else (config_precision, False)


def precision_warnings(config_precision: str, overrides: list[str], gpus_per_node: int,
                       gpu_type: str) -> list[str]:
    """What `memtrain submit` says on stderr about a GPU job's precision, [] for none: a
    --gpu-type that names no known model (so nothing chooses or checks its precision), and,
    loudly, a GPU job that would train in fp32 (no tensor-core bf16/fp16), with why and how
    to choose another precision. A CPU job (gpus_per_node 0) trains in fp32 by design."""
    if not gpus_per_node:
        return []
    precision, _ = job_precision(config_precision, overrides, gpu_type)
    known = bool(gpu_type) and gpu_model(gpu_type) is not None
    out = []
    if gpu_type and not known:
        out.append(f"--gpu-type {gpu_type} names no GPU model this check knows (cluster/"
                   f"layout.py, GPU_CAPABILITY: {', '.join(GPU_CAPABILITY)}): its precision "
                   f"is neither chosen nor checked, deepspeed.precision stays as the config "
                   f"says ({precision})")
    if precision == "fp32":
        if any(o.startswith("deepspeed.precision=") for o in overrides):
            why = "the override deepspeed.precision=fp32 chooses it"
        elif not gpu_type:
            why = "no --gpu-type was given, so the run config's deepspeed.precision (fp32) stays"
        else:
            why = (f"--gpu-type {gpu_type} is not a known model, so the run config's "
                   "deepspeed.precision (fp32) stays")
        out.append(f"WARNING: this job trains in fp32 on its GPUs ({gpus_per_node} per "
                   f"node): {why}.\n  fp32 leaves the GPUs' bf16/fp16 tensor cores unused. "
                   "To train in half precision:\n  --gpu-type a100/h100 (bf16) or v100 "
                   "(fp16), or the override deepspeed.precision=bf16 (Ampere or newer) or "
                   "deepspeed.precision=fp16 (V100, loss scaling)")
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _nearest_multiple(n: int, world: int) -> int:
    return world * max(1, round(n / world))


def _rows_fix(field: str, value: int, world: int, layout: str) -> str | None:
    """None if `value` rows divide among `world` ranks (rows_of_rank's rule), else the fix."""
    try:
        rows_of_rank(value, 0, world)
        return None
    except LayoutError:
        fits = ", ".join(map(str, _divisors(value)))
        return (f"{value} rows do not divide among {world} ranks ({layout}): use "
                f"{field}={_nearest_multiple(value, world)} (the multiple of {world} nearest "
                f"{value}), or a rank count that divides {value} ({fits})")


def check_layout(cfg: RunConfig, overrides: list[str], *, nodes: int, tasks_per_node: int,
                 gpus_per_node: int, gpu_type: str = "") -> None:
    """Raise ConfigError naming every layout problem of this job and its fix."""
    world = nodes * tasks_per_node
    layout = f"{nodes} node(s) x {tasks_per_node} task(s) per node"
    problems: list[tuple[str, str]] = []
    fix = _rows_fix("data.global_batch", cfg.data.global_batch, world, layout)
    if fix:
        problems.append(("data.global_batch", fix))
    if cfg.eval.batch:   # 0 = the global batch, already checked
        fix = _rows_fix("eval.batch", cfg.eval.batch, world, layout)
        if fix:
            problems.append(("eval.batch", fix))
    if gpus_per_node and tasks_per_node > gpus_per_node:
        problems.append(("--tasks-per-node", f"{tasks_per_node} ranks on {gpus_per_node} GPUs "
                         f"per node would share GPUs: use --tasks-per-node {gpus_per_node} (or "
                         "leave it unset: one rank per GPU)"))
    elif gpus_per_node and tasks_per_node < gpus_per_node:
        problems.append(("--tasks-per-node", f"{tasks_per_node} ranks per node leave "
                         f"{gpus_per_node - tasks_per_node} of {gpus_per_node} GPUs idle (a "
                         f"rank uses one GPU): use --gpus-per-node {tasks_per_node}, or leave "
                         "--tasks-per-node unset"))
    precision, _ = job_precision(cfg.deepspeed.precision, overrides, gpu_type)
    if not gpus_per_node and precision != "fp32":
        problems.append(("deepspeed.precision", f"{precision} is for GPUs and this is a CPU "
                         "job (--gpus-per-node 0): use deepspeed.precision=fp32"))
    cap = gpu_capability(gpu_type) if gpus_per_node and gpu_type else None
    if cap is not None and precision == "bf16" and cap < BF16_CAPABILITY:
        problems.append(("deepspeed.precision", f"bf16 needs an Ampere (compute capability "
                         f"8.0) or newer GPU; {gpu_type} is {cap[0]}.{cap[1]}: use "
                         "deepspeed.precision=fp16 (dynamic loss scaling), or leave it unset "
                         f"with --gpu-type {gpu_type}"))
    if problems:
        field, reason = problems[0]
        more = "".join(f"\n  {f}: {r}" for f, r in problems[1:])
        raise ConfigError(field, reason + more)
