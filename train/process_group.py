"""The process group and what ranks do together: gloo on the CPU, nccl on CUDA, the
collectives' timeout, each rank's seed, sums and barriers."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

from .deepspeed_setup import import_deepspeed, use_prebuilt_ops
from .distributed import DistEnv
from .gpu_binding import bind_gpu

if TYPE_CHECKING:
    import torch


def init_process_group(env: DistEnv, timeout_minutes: float = 60) -> None:
    """gloo on CPU (oneCCL is not installable here), nccl on CUDA; collectives wait at most
    `timeout_minutes` for the slowest rank (the run config's distributed.timeout_minutes).
    The rank's GPU is bound first, and LOCAL_RANK made its index (bind_gpu)."""
    use_prebuilt_ops()
    deepspeed = import_deepspeed()

    backend = "gloo" if bind_gpu(env) is None else "nccl"
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False,
                               verbose=False, timeout=timedelta(minutes=timeout_minutes))


def rank_seed(seed: int, rank: int) -> int:
    """The seed of a rank's training RNG (dropout) after the shared initial weights: its own
    per rank, so that ranks do not draw the same masks; reproducible; and not seed + rank,
    with which run seed 1's rank 0 would replay run seed 0's rank 1."""
    import numpy as np

    return int(np.random.SeedSequence([seed, rank]).generate_state(1, np.uint64)[0] >> 1)


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    import torch

    t = torch.tensor(values, dtype=torch.float64, device=device)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(t)
    return t.tolist()


def barrier() -> None:
    import torch

    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()
