"""A job's rank layout against its run config, checked by `memtrain submit` before sbatch.

What would stop the ranks at start, or waste the allocation, is refused at submit time with
the fix named:

    rows          data.global_batch and eval.batch must divide among nodes x tasks-per-node
                  ranks. The rule is `data_pipeline.streams.rows_of_rank`, the function the
                  trainer's start check (`train.trainer.check_run`) and the DeepSpeed config
                  (`train.engine.build_ds_config`) call, so submit and start cannot disagree.
    GPUs/tasks    one rank per GPU: more tasks than GPUs per node would put two ranks on a GPU
                  (train/distributed.py refuses that at start), fewer leave GPUs idle.
    precision     bf16 needs compute capability 8.0 (Ampere) or newer; a V100 (7.0) trains in
                  fp16 with loss scaling, a CPU job in fp32 (check_run refuses the rest).

The GPU generation comes from `--gpu-type` (also the type in --gres=gpu:<type>:<n>); an
unknown type is not checked for precision.
"""

from __future__ import annotations

from data_pipeline.streams import LayoutError, rows_of_rank
from train.config import ConfigError, RunConfig

# Compute capability (major, minor) per GPU type, from NVIDIA's list of CUDA GPUs. A type is
# matched by its longest known prefix, so site names such as "a100_80gb" or "v100-sxm2"
# resolve to their generation.
GPU_CAPABILITY = {
    "p100": (6, 0), "v100": (7, 0), "t4": (7, 5), "rtx8000": (7, 5),
    "a100": (8, 0), "a30": (8, 0), "a10": (8, 6), "a40": (8, 6), "a6000": (8, 6),
    "l4": (8, 9), "l40": (8, 9), "l40s": (8, 9),
    "h100": (9, 0), "h200": (9, 0), "gh200": (9, 0), "b200": (10, 0),
}
BF16_CAPABILITY = (8, 0)


def gpu_capability(gpu_type: str) -> tuple[int, int] | None:
    name = gpu_type.lower()
    for key in sorted(GPU_CAPABILITY, key=len, reverse=True):
        if name.startswith(key):
            return GPU_CAPABILITY[key]
    return None


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
