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

The rest of starting a rank lives beside it: which GPU it takes (train/gpu_binding.py),
importing DeepSpeed and its ops (train/deepspeed_setup.py), the process group and the
collectives (train/process_group.py).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


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
