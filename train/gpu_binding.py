"""Which GPU a rank uses: the job's allocation read from SLURM's and the launcher's
variables, a CPU-only torch refused under it, one device per rank (checked across ranks),
and the binding DeepSpeed is handed through LOCAL_RANK."""

from __future__ import annotations

import os
import socket
import sys
from typing import TYPE_CHECKING

from .distributed import DistEnv

if TYPE_CHECKING:
    import torch


# What shows that the job gave this process GPUs: SLURM's gres allocation, or a launcher's
# binding. A CPU-only torch (or a CUDA build that sees no GPU) under any of them would make
# the ranks train on the CPU over gloo without a word, so that is refused at start.
GPU_VARIABLES = ("SLURM_GPUS_ON_NODE", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS",
                 "CUDA_VISIBLE_DEVICES")
_NO_GPU = ("", "-1", "NoDevFiles", "none", "void")


def node_has_nvidia_gpus() -> bool:
    """NVIDIA device files on this node: what the driver creates, whatever torch was built
    for."""
    return os.path.exists("/dev/nvidia0") or os.path.isdir("/proc/driver/nvidia/gpus")


def allocated_gpus(environ: dict | None = None) -> str | None:
    """`NAME=value` of the first variable that gives this process GPUs, None if none does.
    CUDA_VISIBLE_DEVICES counts only on a node with NVIDIA devices: the deepspeed launcher
    sets it (0,1,...) from its own rank count on any machine, a CPU-only one included."""
    env = os.environ if environ is None else environ
    for name in GPU_VARIABLES:
        value = env.get(name, "").strip()
        if name == "SLURM_GPUS_ON_NODE":     # a count
            if value.isdigit() and int(value) > 0:
                return f"{name}={value}"
        elif name == "CUDA_VISIBLE_DEVICES" and not node_has_nvidia_gpus():
            continue
        elif value not in _NO_GPU:          # GPU indices or UUIDs
            return f"{name}={value}"
    return None


def require_cuda_if_allocated(environ: dict | None = None) -> None:
    """Refuse to start on the CPU when the job has GPUs (MEMTRAIN_ALLOW_CPU=1 allows it)."""
    import torch

    env = os.environ if environ is None else environ
    given = allocated_gpus(env)
    if not given or env.get("MEMTRAIN_ALLOW_CPU") == "1" or torch.cuda.is_available():
        return
    from model.typed import ConfigError

    if torch.version.cuda:
        why = (f"torch {torch.__version__} is a CUDA {torch.version.cuda} build that sees no "
               "GPU: check `nvidia-smi` on the node, the driver and the job's module loads")
    else:
        why = (f"torch {torch.__version__} in {sys.executable} is a CPU-only build: install "
               "the CUDA wheel for these GPUs into the venv the nodes use, e.g. "
               "PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cu126 "
               "TORCH_SPEC=torch==2.13.0+cu126 bash scripts/setup.sh (cu126 is the wheel "
               "that still has V100 kernels; docs/cluster.md)")
    raise ConfigError("torch", f"the job has GPUs ({given}) but {why}. Without CUDA the ranks "
                      "would train on the CPU; MEMTRAIN_ALLOW_CPU=1 does that on purpose")


def gpu_index(local_rank: int, visible: int) -> int:
    """The CUDA device of a rank among the `visible` ones (CUDA_VISIBLE_DEVICES): the one
    visible GPU when the site binds one per task (`--gpus-per-task=1`), else the local rank's
    (every GPU of the node visible). A local rank beyond the visible GPUs would share one."""
    if visible == 1:
        return 0
    if local_rank < visible:
        return local_rank
    from model.typed import ConfigError

    raise ConfigError("--tasks-per-node", f"local rank {local_rank} sees only {visible} GPUs "
                      f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')!r}), "
                      f"so it would share cuda:{local_rank % visible} with local rank "
                      f"{local_rank % visible}: run one rank per GPU (--tasks-per-node = "
                      "--gpus-per-node) or bind one GPU per task (--gpus-per-task=1)")


def shared_gpus(owners: list[tuple[str, str]]) -> dict[tuple[str, str], list[int]]:
    """{(host, GPU id): ranks} for every GPU that more than one rank uses, from each rank's
    (host, GPU id) in rank order."""
    users: dict[tuple[str, str], list[int]] = {}
    for rank, owner in enumerate(owners):
        users.setdefault(tuple(owner), []).append(rank)
    return {gpu: ranks for gpu, ranks in users.items() if len(ranks) > 1}


def _gpu_id(index: int) -> str:
    """A GPU's identity across processes: its UUID (the same whatever CUDA_VISIBLE_DEVICES
    renumbers), else its PCI bus id, else the visible list and the index."""
    import torch

    props = torch.cuda.get_device_properties(index)
    for attr in ("uuid", "pci_bus_id"):
        value = getattr(props, attr, None)
        if value is not None:
            return str(value)
    return f"{os.environ.get('CUDA_VISIBLE_DEVICES', '')}#{index}"


def _refuse_shared_gpu(index: int) -> None:
    """Collective once the process group exists: every rank gathers the (host, GPU) of all
    and all refuse alike when two use one GPU (e.g. --gres=gpu:1 with 2 tasks per node)."""
    import torch

    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    owners: list = [None] * dist.get_world_size()
    dist.all_gather_object(owners, (socket.gethostname(), _gpu_id(index)))
    shared = shared_gpus(owners)
    if shared:
        from model.typed import ConfigError

        (host, gpu), ranks = next(iter(shared.items()))
        raise ConfigError("--tasks-per-node", f"ranks {ranks} all use GPU {gpu} on {host}: "
                          "one rank per GPU (--tasks-per-node = --gpus-per-node), or one GPU "
                          "per task (--gpus-per-task=1)")


def device_for(local_rank: int) -> torch.device:
    """This rank's device: a CUDA device of its own (gpu_index; checked against the other
    ranks when the process group exists), else the CPU."""
    import torch

    require_cuda_if_allocated()
    if not torch.cuda.is_available():
        return torch.device("cpu")
    index = gpu_index(local_rank, torch.cuda.device_count())
    torch.cuda.set_device(index)
    _refuse_shared_gpu(index)
    return torch.device("cuda", index)


# The launcher's local rank, kept when LOCAL_RANK is rewritten for DeepSpeed (bind_gpu).
LAUNCHER_LOCAL_RANK = "MEMTRAIN_LOCAL_RANK"


def bind_gpu(env: DistEnv) -> int | None:
    """Take this rank's GPU (gpu_index) before DeepSpeed looks for one; its index, or None
    without CUDA.

    DeepSpeed 0.19.8 does not ask which GPU a rank uses: wherever it needs the rank's
    device it reads LOCAL_RANK from the environment and takes cuda:LOCAL_RANK, which is
    right only when the rank sees its whole node. Where a site binds one GPU per task
    (CUDA_VISIBLE_DEVICES=3, LOCAL_RANK=5, one visible device) each of these asks for a
    device that does not exist ("invalid device ordinal"):
    - deepspeed.init_distributed: torch's init_process_group gets
      device_id=cuda:LOCAL_RANK (deepspeed/comm/torch.py, TorchBackend.init_process_group;
      world size > 1);
    - deepspeed.initialize: the engine's local_rank is int(os.environ["LOCAL_RANK"])
      (runtime/engine.py, _configure_with_arguments), its device
      set_device(local_rank) / device_name(local_rank) (_set_distributed_vars);
    - ZeRO-3: the engine converts the model with zero.Init(module=...)
      (runtime/zero/parameter_offload.py), whose local_device is
      device_name(os.environ["LOCAL_RANK"]), then set_device
      (runtime/zero/partition_parameters.py, Init.__init__); its list checks build
      tensors there (runtime/zero/utils.py, assert_lst_len_same_as_other_ranks,
      get_lst_from_rank0).
    Only the engine takes a device from its caller (an `args` with `device_rank` given to
    deepspeed.initialize); the process group and ZeRO-3 read the variable only. So the
    variable is what DeepSpeed is handed: LOCAL_RANK becomes this GPU's index among the
    visible ones for the rest of the process (unchanged when the whole node is visible),
    and the launcher's value stays in DistEnv.local_rank and MEMTRAIN_LOCAL_RANK.
    DeepSpeed's other uses of LOCAL_RANK do not choose a device and are off in memtrain:
    checkpoint files named by local rank (checkpoint.use_node_local_storage) and ZeRO-3's
    checkpoint loading in local-rank order (zero_optimization.pipeline_loading_checkpoint).
    AutoTP and pipeline modules, which read it too, are not used."""
    import torch

    require_cuda_if_allocated()   # gloo on the CPU only when the job has no GPUs
    if not torch.cuda.is_available():
        return None
    index = gpu_index(env.local_rank, torch.cuda.device_count())
    torch.cuda.set_device(index)
    os.environ[LAUNCHER_LOCAL_RANK] = str(env.local_rank)
    os.environ["LOCAL_RANK"] = str(index)
    return index
