"""Who am I in the job: rank, world size and master, from whichever launcher started us.

torchrun and the deepspeed launcher set RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR /
MASTER_PORT. srun sets only SLURM's variables (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
SLURM_JOB_NODELIST), so we translate them; the master is the first host of the node list
(`scontrol show hostnames`). A plain `memtrain train` is a world of one on a free local port.
Everything ends up in the standard variables, which is what `deepspeed.init_distributed`
(env://) reads; without them it would try MPI discovery.

`python -m train.distributed master-port` prints the port of the SLURM job in
$SLURM_JOB_ID: the sbatch script exports it, so the script (the deepspeed launcher's
--master_port) and ranks started by a bare srun use the one formula, `slurm_master_port`.
`python -m train.distributed stash-env FILE` keeps comma-valued variables (NCCL_IB_HCA=a,b)
away from srun's --export list on the DeepSpeed launcher path; resolve_env loads them back.
torch is imported where it is used, so that command starts in a fraction of a second.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str          # "torchrun/deepspeed", "slurm" or "single"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Rendezvous ports of SLURM jobs: below Linux's ephemeral range (32768-60999, the default
# net.ipv4.ip_local_port_range), from which the kernel picks the local port of every outgoing
# connection (NCCL's and gloo's sockets among them), so that no connection of another job on
# the node can hold the port when the master binds it; below torchrun's 29500 too.
MASTER_PORT_BASE, MASTER_PORT_SPAN = 10000, 10000


def slurm_master_port(job_id: int) -> int:
    """The rendezvous port of a SLURM job: every task computes the same one from the job id,
    with no communication, and jobs sharing a node get different ones."""
    return MASTER_PORT_BASE + int(job_id) % MASTER_PORT_SPAN


def first_slurm_host(nodelist: str) -> str:
    """First hostname of a SLURM node list such as 'gpu[01-04],cpu7'."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], check=True,
                             capture_output=True, text=True, timeout=30).stdout.split()
        if out:
            return out[0]
    except (OSError, subprocess.SubprocessError):
        pass
    # No scontrol here: a plain host list, or the first name of a bracketed range.
    head = nodelist.split(",")[0]
    if "[" in head:
        prefix, rng = head.split("[", 1)
        return prefix + rng.split("-")[0].split(",")[0].rstrip("]")
    return head


# The prefixes of the variables DeepSpeed's launcher repeats in srun's --export list
# (deepspeed/launcher/runner.py: EXPORT_ENVS, plus the CUDA accelerator's export_envs()).
DEEPSPEED_EXPORTS = ("NCCL", "MLFLOW", "PYTHON", "MV2", "UCX")
ENV_FILE = "MEMTRAIN_ENV_FILE"


def stash_env(path: str | Path, environ: dict | None = None) -> list[str]:
    """Write the variables DeepSpeed would pass through srun --export and whose value holds a
    comma (srun would cut it there) to `path` as JSON; return their names, which the sbatch
    script then unsets so that the launcher never sees them. Ranks load the file
    (load_env_file) before anything reads them (NCCL reads its variables at the first
    collective)."""
    env = os.environ if environ is None else environ
    moved = {k: v for k, v in sorted(env.items())
             if k.startswith(DEEPSPEED_EXPORTS) and "," in v}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)   # values may be secret
    with os.fdopen(fd, "w") as f:
        json.dump(moved, f)
    return list(moved)


def load_env_file(environ: dict | None = None) -> None:
    """Put back the variables `stash_env` moved out of the launcher's way."""
    env = os.environ if environ is None else environ
    path = env.get(ENV_FILE)
    if path and os.path.isfile(path):
        with open(path) as f:
            env.update(json.load(f))


def resolve_env(environ: dict | None = None) -> DistEnv:
    """Read the launcher's variables, fill the standard ones, return who we are."""
    env = os.environ if environ is None else environ
    load_env_file(env)
    if "RANK" in env and "WORLD_SIZE" in env:
        launcher = "torchrun/deepspeed"
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_RANK", rank))
        addr = env.get("MASTER_ADDR", "127.0.0.1")
        port = int(env.get("MASTER_PORT", 29500))
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        launcher = "slurm"
        rank, world = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
        local = int(env.get("SLURM_LOCALID", 0))
        addr = env.get("MASTER_ADDR") or first_slurm_host(env.get("SLURM_JOB_NODELIST",
                                                                  "127.0.0.1"))
        port = int(env.get("MASTER_PORT") or slurm_master_port(env.get("SLURM_JOB_ID", 0)))
    else:
        launcher, rank, world, local = "single", 0, 1, 0
        addr, port = "127.0.0.1", int(env.get("MASTER_PORT", 0)) or _free_port()
    if not 0 <= rank < world:
        raise RuntimeError(f"launcher gave rank {rank} outside a world of {world}")
    env.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local),
                "MASTER_ADDR": addr, "MASTER_PORT": str(port)})
    return DistEnv(rank, world, local, addr, port, launcher)


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


def import_deepspeed():
    """The deepspeed module, imported without MLflow wherever it is imported first.

    DeepSpeed's autotuner imports mlflow when it is installed (deepspeed/autotuning/
    autotuner.py, for its own logging, which memtrain does not use), as part of `import
    deepspeed`: 2.2 of its 4.7 s of CPU (measured on the 2-core machine), on every rank
    and in every command that reads a checkpoint. MLflow is imported for real only where a
    run is tracked (train/tracking.py, rank 0). While the import runs, `import mlflow`
    fails at once (a None entry in sys.modules), so the autotuner sees no MLflow; the entry
    is removed after, and a later `import mlflow` imports it as usual."""
    if "deepspeed" not in sys.modules and "mlflow" not in sys.modules:
        sys.modules["mlflow"] = None
        try:
            import deepspeed
        finally:
            del sys.modules["mlflow"]
    import deepspeed

    return deepspeed


# A build of DeepSpeed's op takes under 2 minutes here (about 30 s alone on the machine).
STALE_LOCK_S = 15 * 60


def clear_stale_build_locks(extensions: Path, max_age_s: float = STALE_LOCK_S) -> list[Path]:
    """Remove the build locks of JIT-compiled ops (torch.utils.cpp_extension's FileBaton,
    `<op>/lock`) older than `max_age_s`: a build killed midway leaves its lock behind, and
    every later process that loads the op, built or not, waits for it to go, forever
    (seen: every DeepSpeed start hung). Returns what was removed, each with a warning."""
    import warnings

    removed = []
    for lock in sorted(extensions.glob("*/lock")):
        try:
            age = time.time() - lock.stat().st_mtime
            if age > max_age_s:
                lock.unlink()
        except FileNotFoundError:     # a build finished meanwhile
            continue
        if age > max_age_s:
            warnings.warn(f"removed {lock}: the build lock of an op, {age / 60:.0f} minutes "
                          "old, left by a build that was stopped; every process loading the "
                          "op would have waited for it", stacklevel=2)
            removed.append(lock)
    return removed


def use_environments_ninja() -> bool:
    """Put this interpreter's scripts folder first on PATH when it holds `ninja` (the
    environment's own, a DeepSpeed dependency); True if PATH changed. torch builds an op with
    the first `ninja` on PATH, and a ninja of another version does not read the build log the
    last one kept, so it builds everything again: launches from an activated environment
    (its ninja 1.13) and from a plain shell (the system's 1.11) sharing one op folder rebuilt
    DeepSpeed's op in turn, about a minute of both cores each time, every other rank waiting
    on the build lock (measured on the 2-core machine)."""
    bin_dir = str(Path(sys.executable).parent)
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p]
    if not (Path(bin_dir) / "ninja").is_file() or path[:1] == [bin_dir]:
        return False
    os.environ["PATH"] = os.pathsep.join([bin_dir, *(p for p in path if p != bin_dir)])
    return True


def init_process_group(env: DistEnv, timeout_minutes: float = 60) -> None:
    """gloo on CPU (oneCCL is not installable here), nccl on CUDA; collectives wait at most
    `timeout_minutes` for the slowest rank (the run config's distributed.timeout_minutes).
    The rank's GPU is bound first, and LOCAL_RANK made its index (bind_gpu)."""
    # DeepSpeed JIT-compiles an op on first use (~30 s); scripts/setup.sh builds it into the
    # checkout, so reuse that build unless the user chose another place.
    prebuilt = Path(__file__).resolve().parents[1] / ".cache" / "torch_ext"
    if prebuilt.is_dir():
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(prebuilt))
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        clear_stale_build_locks(Path(os.environ["TORCH_EXTENSIONS_DIR"]))
    use_environments_ninja()
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


def main(argv: list[str] | None = None) -> int:
    """The sbatch script's helpers: `master-port` prints the job's port; `stash-env FILE`
    moves comma-valued variables out of the DeepSpeed launcher's way (stash_env) and prints
    the `unset` command for the script to eval."""
    args = sys.argv[1:] if argv is None else argv
    job = os.environ.get("SLURM_JOB_ID")
    if args == ["master-port"] and job:
        print(slurm_master_port(int(job)))
        return 0
    if len(args) == 2 and args[0] == "stash-env":
        moved = stash_env(args[1])
        if moved:
            print("unset " + " ".join(moved))
        return 0
    print("usage: SLURM_JOB_ID=<id> python -m train.distributed master-port\n"
          "       python -m train.distributed stash-env FILE", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
