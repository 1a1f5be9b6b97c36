"""The options of a SLURM job: one dataclass, the only place they are spelled out.

Each field's metadata carries its help text; `add_flags` turns the fields into the
`memtrain submit` flags (`gpus_per_node` -> `--gpus-per-node`) and `from_args` reads them
back, so adding a field adds its flag, its validation name and its input to the sbatch
rendering (cluster/sbatch.py) at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shlex
import sys
import typing
from dataclasses import dataclass, field

# The run config's error: cluster/ validates the run through train.config anyway, so a bad
# option and a bad config field are one kind of error (one line, exit code 2).
from train.config import ConfigError

LAUNCHERS = ("srun", "deepspeed")
# SLURM names: letters, digits and a few separators; no spaces, quotes or shell metacharacters.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")
_CONSTRAINT = re.compile(r"^[A-Za-z0-9_.\-&|\[\]*:()]{1,128}$")
_TIME = re.compile(r"^(\d+-)?\d{1,3}(:\d{2}){0,2}$")          # MM, H:MM:SS, D-HH:MM:SS
_MEM = re.compile(r"^\d+[KMGT]?$")
MEM_AUTO = "auto"
_GPU_TYPE = re.compile(r"^[A-Za-z0-9_\-]{1,32}$")


def _option(default, help: str, **cli):
    """A field with its help text (and extra argparse settings, e.g. choices)."""
    meta = {"help": help, **cli}
    if isinstance(default, list) or callable(default):
        factory = default if callable(default) else (lambda: list(default))
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def flag(name: str) -> str:
    """The command-line flag of a field: `gpus_per_node` -> `--gpus-per-node`."""
    return f"--{name.replace('_', '-')}"


@dataclass
class SubmitOptions:
    nodes: int = _option(1, "nodes to allocate")
    gpus_per_node: int = _option(1, "GPUs per node; 0: a CPU job")
    time: str = _option("24:00:00", "time limit: minutes, H:MM:SS or D-HH:MM:SS")
    partition: str = _option("", "SLURM partition")
    account: str = _option("", "SLURM account")
    qos: str = _option("", "SLURM quality of service")
    constraint: str = _option("", "node features, e.g. 'a100&ib'")
    cpus_per_task: int = _option(8, "CPU cores per rank")
    tasks_per_node: int = _option(0, "ranks per node (default: one per GPU, 1 for a CPU job)")
    # A GPU rank holds pinned host buffers, the data prefetch and (ZeRO offload) optimizer
    # state; a site's DefMemPerCPU is often a few GB per core, and an OOM kill reads as a
    # crash. A GPU job takes its nodes' memory (SLURM's --mem=0) unless told a size.
    mem: str = _option(MEM_AUTO, "memory per node: a size (e.g. 480G), 0 = all of each "
                                 "node's memory, or auto (default): 0 for a GPU job, the "
                                 "site's default for a CPU job")
    exclusive: bool = _option(False, "whole nodes, shared with no other job")
    gpu_type: str = _option("", "e.g. v100, a100 (in --gres=gpu:<type>:<n>; v100 trains in "
                                "fp16, a100/h100 in bf16 unless the overrides choose)")
    setup: list[str] = _option([], "a command run before training, e.g. "
                                   "'module load cuda/12.1' (repeat)")
    launcher: str = _option("srun", "srun: one task per GPU; deepspeed: DeepSpeed's launcher "
                                    "with its slurm backend and a hostfile from the node list",
                            choices=LAUNCHERS)
    skip_torch_check: bool = _option(False, "do not ask --python whether its torch has CUDA "
                                            "and kernels for --gpu-type "
                                            "(cluster/torch_check.py)")
    signal_seconds: int = _option(300, "SLURM sends USR1 this long before the time limit: "
                                       "checkpoint, requeue")
    max_requeues: int = _option(10, "requeues after a warning or preemption, at most")
    # `memtrain submit` names the job after the run; "memtrain" is for scripts rendered
    # directly from this class.
    job_name: str = _option("memtrain", "SLURM job name (default: the run's name)")
    # The interpreter that submits, i.e. the project's venv, which the nodes see on a
    # shared filesystem.
    python: str = _option(lambda: sys.executable, "python on the nodes (default: this one)")

    def validate(self) -> SubmitOptions:
        def need(cond, name, reason):
            if not cond:
                raise ConfigError(flag(name), reason)

        need(self.nodes >= 1, "nodes", f"must be >= 1, got {self.nodes}")
        need(self.gpus_per_node >= 0, "gpus_per_node", "must be >= 0 (0: CPU job)")
        need(self.cpus_per_task >= 1, "cpus_per_task", "must be >= 1")
        need(self.tasks_per_node >= 0, "tasks_per_node", "must be >= 0")
        need(bool(_TIME.match(self.time)), "time", f"{self.time!r} is not a SLURM time "
             "(minutes, H:MM:SS or D-HH:MM:SS)")
        for name in ("partition", "account", "qos", "job_name"):
            value = getattr(self, name)
            need(not value or bool(_NAME.match(value)), name,
                 f"{value!r}: only letters, digits, '_', '.', '-' are allowed")
        need(not self.constraint or bool(_CONSTRAINT.match(self.constraint)), "constraint",
             f"{self.constraint!r} is not a SLURM feature expression")
        need(self.mem in ("", MEM_AUTO) or bool(_MEM.match(self.mem)), "mem",
             f"{self.mem!r} is not a SLURM memory size (e.g. 64G, or 0: all of it)")
        need(not self.gpu_type or bool(_GPU_TYPE.match(self.gpu_type)), "gpu_type",
             f"{self.gpu_type!r} is not a GPU type name")
        need(self.launcher in LAUNCHERS, "launcher", f"choose {' or '.join(LAUNCHERS)}")
        need(self.signal_seconds >= 0, "signal_seconds", "must be >= 0")
        need(self.max_requeues >= 0, "max_requeues", "must be >= 0")
        for line in self.setup:
            need("\n" not in line and "\r" not in line, "setup", "one command per --setup")
            try:
                shlex.split(line)
            except ValueError as err:
                raise ConfigError("--setup", f"{line!r}: {err}") from None
        return self

    @property
    def ntasks_per_node(self) -> int:
        return self.tasks_per_node or max(1, self.gpus_per_node)

    @property
    def mem_per_node(self) -> str:
        """The #SBATCH --mem value, "" for none (the site's default)."""
        if self.mem == MEM_AUTO:
            return "0" if self.gpus_per_node else ""
        return self.mem


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per SubmitOptions field, typed by its annotation: int -> type=int, bool ->
    a switch, list[str] -> repeatable. A flag not given is absent from the parsed
    namespace, so `from_args` leaves the field's default to the dataclass."""
    hints = typing.get_type_hints(SubmitOptions)
    for f in dataclasses.fields(SubmitOptions):
        tp, meta = hints[f.name], dict(f.metadata)
        kwargs = {"dest": f.name, "default": argparse.SUPPRESS, "help": meta.pop("help")}
        if tp is bool:
            kwargs["action"] = "store_true"
        elif typing.get_origin(tp) is list:
            kwargs["action"] = "append"
        elif tp is int:
            kwargs["type"] = int
        default = f.default
        if default not in (dataclasses.MISSING, "", False) and "default" not in kwargs["help"]:
            kwargs["help"] += f" (default: {default})"
        parser.add_argument(flag(f.name), **kwargs, **meta)


def from_args(args: argparse.Namespace, **defaults) -> SubmitOptions:
    """The SubmitOptions of parsed flags; `defaults` fill fields whose flag was not given
    (e.g. the job name from the run), the dataclass defaults the rest."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(SubmitOptions)
             if hasattr(args, f.name)}
    return SubmitOptions(**{**defaults, **given})
