"""The job's request per node against the nodes of its partition, asked of `sinfo` at submit.

sbatch refuses a job that no node of the partition can hold ("Requested node configuration
is not available"), without saying which number is too large; the default --cpus-per-task 8
with 8 tasks asks for 64 CPUs per node, more than a 40-core V100 node has. `memtrain submit`
asks the partition's nodes first,

    sinfo -h -N -p <partition> -o "%N|%c|%G|%P"     (no -p: the default partition, "*")

(one line per node: name, CPUs, generic resources such as `gpu:tesla_v100:4(S:0-1)`) and
refuses, naming the numbers and the flag to change, a request of more CPUs per node
(--cpus-per-task x tasks per node) or more GPUs of the --gpu-type than any node has. Where
sinfo is missing or does not answer (a laptop, a dry run away from the cluster) the check is
skipped with one line that says so.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass, field

from .options import SubmitOptions, flag

SINFO_FORMAT = "%N|%c|%G|%P"


class PartitionUnknown(RuntimeError):
    """sinfo could not tell what the partition's nodes have (the check is skipped)."""


@dataclass(frozen=True)
class Node:
    name: str
    cpus: int
    gpus: dict[str, int] = field(default_factory=dict)   # gres type ("": untyped) -> count

    def gpus_of(self, gpu_type: str) -> int:
        """GPUs a --gres=gpu[:<type>]:<n> request can take here: any type when none is named
        (SLURM then counts every GPU), else those of that type."""
        if not gpu_type:
            return sum(self.gpus.values())
        return sum(n for t, n in self.gpus.items() if t.lower() == gpu_type.lower())


def parse_gres(gres: str) -> dict[str, int]:
    """GPUs per type of a node's gres list, as sinfo's %G prints it: "gpu:a100:8",
    "gpu:tesla_v100:4(S:0-1)", "gpu:2,nic:1", "(null)"."""
    out: dict[str, int] = {}
    for item in re.sub(r"\([^)]*\)", "", gres).split(","):
        parts = item.strip().split(":")
        if parts[0] != "gpu" or len(parts) not in (2, 3):
            continue
        count = re.match(r"\d+", parts[-1])
        if count:
            gpu_type = parts[1] if len(parts) == 3 else ""
            out[gpu_type] = out.get(gpu_type, 0) + int(count.group())
    return out


def parse_sinfo(text: str, partition: str) -> list[Node]:
    """The nodes of `partition` (or of the default one, marked "*", when it is "") from
    `sinfo -h -N -o SINFO_FORMAT` lines."""
    nodes = []
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 4 or not parts[1].rstrip("+").isdigit():
            continue
        name, cpus, gres, part = parts
        if partition and part.rstrip("*") != partition:
            continue
        if not partition and not part.endswith("*"):
            continue
        nodes.append(Node(name, int(cpus.rstrip("+")), parse_gres(gres)))
    return nodes


def query_nodes(partition: str, timeout: float = 20) -> list[Node]:
    """The partition's nodes from sinfo; PartitionUnknown with the reason when it cannot
    tell."""
    cmd = ["sinfo", "-h", "-N", "-o", SINFO_FORMAT]
    if partition:
        cmd[1:1] = ["-p", partition]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise PartitionUnknown("sinfo is not installed here") from None
    except (OSError, subprocess.SubprocessError) as err:
        raise PartitionUnknown(f"sinfo did not answer ({err})") from None
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        reason = lines[-1] if lines else f"exit code {done.returncode}"
        raise PartitionUnknown(f"sinfo failed: {reason}")
    nodes = parse_sinfo(done.stdout, partition)
    if not nodes:
        raise PartitionUnknown(f"sinfo lists no nodes in partition {partition or '(default)'}")
    return nodes


def _gres_list(nodes: list[Node]) -> str:
    """The GPU kinds a partition offers, e.g. "gpu:tesla_v100:4 (12 nodes)"."""
    kinds: dict[str, int] = {}
    for node in nodes:
        for gpu_type, count in node.gpus.items():
            key = f"gpu:{gpu_type}:{count}" if gpu_type else f"gpu:{count}"
            kinds[key] = kinds.get(key, 0) + 1
    return ", ".join(f"{k} ({n} node{'s' * (n != 1)})" for k, n in sorted(kinds.items())) \
        or "no GPUs"


def request_problem(opts: SubmitOptions, nodes: list[Node]) -> tuple[str, str] | None:
    """(flag, reason with the numbers and the fix) when no node of the partition holds one
    node's share of the job, else None."""
    where = f"partition {opts.partition}" if opts.partition else "the default partition"
    tasks = opts.ntasks_per_node
    cpus = opts.cpus_per_task * tasks
    fits = nodes
    if opts.gpus_per_node:
        fits = [n for n in nodes if n.gpus_of(opts.gpu_type) >= opts.gpus_per_node]
        if not fits:
            most = max(n.gpus_of(opts.gpu_type) for n in nodes)
            kind = f"GPUs of type {opts.gpu_type}" if opts.gpu_type else "GPUs"
            if most:
                fix = (f"use {flag('gpus_per_node')} {most} (and more {flag('nodes')}), "
                       f"or another {flag('partition')}")
            elif opts.gpu_type and {t for n in nodes for t in n.gpus} == {""}:
                fix = (f"these GPUs have no type in SLURM: leave {flag('gpu_type')} out and "
                       "choose the precision with deepspeed.precision=bf16 (Ampere or "
                       "newer) or fp16")
            elif opts.gpu_type:
                fix = (f"use {flag('gpu_type')} with a type listed there, or another "
                       f"{flag('partition')}")
            else:
                fix = (f"choose a {flag('partition')} with GPU nodes, or "
                       f"{flag('gpus_per_node')} 0 (a CPU job)")
            return (flag("gpus_per_node") if most or not opts.gpu_type else flag("gpu_type"),
                    f"{opts.gpus_per_node} {kind} per node asked, but no node of {where} "
                    f"has them (the most per node: {most}; its nodes have "
                    f"{_gres_list(nodes)}): {fix}")
    most = max(n.cpus for n in fits)
    if cpus > most:
        holders = "its nodes" if len(fits) == len(nodes) else \
            f"its nodes with {opts.gpus_per_node} GPUs"
        per_task = most // tasks
        fix = (f"use {flag('cpus_per_task')} {per_task} ({per_task} x {tasks} = "
               f"{per_task * tasks})" if per_task
               else f"use fewer {flag('tasks_per_node')} (at most {most})")
        return (flag("cpus_per_task"),
                f"{opts.cpus_per_task} CPUs per task x {tasks} tasks per node = {cpus} CPUs "
                f"per node asked, but {holders} in {where} have at most {most} CPUs: {fix}")
    return None
