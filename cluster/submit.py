"""`memtrain submit`: render a run's sbatch script into its run directory and submit it.

    memtrain submit --config configs/enwik8-xl-base.yaml --nodes 4 --gpus-per-node 8 \\
        --gpu-type a100 --time 2-00:00:00 --partition gpu --setup "module load cuda/12.1"
    memtrain submit --config quickstart --gpus-per-node 0 --tasks-per-node 2 --dry-run
    memtrain submit --config quickstart --launcher deepspeed --gpus-per-node 0 \
        --tasks-per-node 2 --dry-run

The run config is loaded and validated first (a bad field fails here, not on the cluster);
the script is written to <run_dir>/submit-<time>.sbatch and stays usable with plain sbatch.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from model import ConfigError
from train.config import load_config

from .jobs import record_job
from .sbatch import LAUNCHERS, SubmitOptions, render


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="memtrain submit", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("overrides", nargs="*", metavar="section.field=value")
    d = SubmitOptions()
    p.add_argument("--nodes", type=int, default=d.nodes)
    p.add_argument("--gpus-per-node", type=int, default=d.gpus_per_node)
    p.add_argument("--gpu-type", default=d.gpu_type, help="e.g. v100, a100 (in --gres)")
    p.add_argument("--tasks-per-node", type=int, default=d.tasks_per_node,
                   help="ranks per node (default: one per GPU)")
    p.add_argument("--launcher", choices=LAUNCHERS, default=d.launcher,
                   help="srun: one task per GPU; deepspeed: DeepSpeed's launcher with its "
                        "slurm backend and a hostfile from the node list")
    p.add_argument("--time", default=d.time)
    for name in ("partition", "account", "qos", "constraint", "mem"):
        p.add_argument(f"--{name}", default="")
    p.add_argument("--cpus-per-task", type=int, default=d.cpus_per_task)
    p.add_argument("--exclusive", action="store_true")
    p.add_argument("--setup", action="append", default=[],
                   help="a command run before training, e.g. 'module load cuda/12.1' (repeat)")
    p.add_argument("--signal-seconds", type=int, default=d.signal_seconds,
                   help="SLURM sends USR1 this long before the time limit: checkpoint, requeue")
    p.add_argument("--max-requeues", type=int, default=d.max_requeues)
    p.add_argument("--job-name", default="")
    p.add_argument("--python", default=sys.executable, help="python on the nodes")
    p.add_argument("--sweep", action="append", default=[], metavar="FIELD=V1,V2,...",
                   help="a grid axis (repeat for more axes): one job array element per "
                        "combination, each its own run and MLflow run in one experiment")
    p.add_argument("--dry-run", action="store_true", help="print the script, submit nothing")
    return p


def _sweep(args, name: str, run_dir: Path) -> list[tuple[Path, list[str]]] | None:
    """The grid of --sweep axes: per element its run directory and overrides. Every element
    is validated here, so a bad value fails before sbatch. Elements share one MLflow
    experiment (the base name) and, unless a tracking URI is set, one sqlite store in the
    base run directory (use a tracking server when elements run concurrently on a cluster)."""
    if not args.sweep:
        return None
    axes = []
    for axis in args.sweep:
        key, sep, values = axis.partition("=")
        if not sep or not key or not values:
            raise ConfigError("--sweep", f"{axis!r}: write FIELD=V1,V2,...")
        axes.append([f"{key}={v}" for v in values.split(",")])
    shared = [f"tracking.experiment={name}"]
    if not os.environ.get("MLFLOW_TRACKING_URI") and \
            not any(o.startswith("tracking.uri=") for o in args.overrides):
        shared.append(f"tracking.uri=sqlite:///{run_dir}/mlflow.db")
    elements = []
    for i, combo in enumerate(itertools.product(*axes)):
        element = [*combo, f"name={name}-{i:02d}", *shared]
        load_config(args.config, [*args.overrides, *element])  # fail here, not on the nodes
        elements.append((run_dir.parent / f"{name}-{i:02d}", element))
    return elements


def main_submit(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        run_dir = cfg.resolved_run_dir.absolute()
        opts = SubmitOptions(
            nodes=args.nodes, gpus_per_node=args.gpus_per_node, gpu_type=args.gpu_type,
            tasks_per_node=args.tasks_per_node, time=args.time, partition=args.partition,
            account=args.account, qos=args.qos, constraint=args.constraint, mem=args.mem,
            cpus_per_task=args.cpus_per_task, exclusive=args.exclusive, setup=args.setup,
            signal_seconds=args.signal_seconds, max_requeues=args.max_requeues,
            job_name=args.job_name or cfg.name, python=args.python,
            launcher=args.launcher)
        config_path = Path(args.config)
        config_path = config_path.absolute() if config_path.is_file() else args.config
        sweep = _sweep(args, cfg.name, run_dir)
        script = render(config_path, args.overrides, run_dir, opts, sweep)
    except ConfigError as err:
        print(f"memtrain submit: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(script, end="")
        return 0
    run_dir.mkdir(parents=True, exist_ok=True)
    if sweep:
        (run_dir / "sweep.json").write_text(json.dumps(
            [{"run_dir": str(d), "overrides": o} for d, o in sweep], indent=1))
    path = run_dir / f"submit-{time.strftime('%Y%m%d-%H%M%S')}.sbatch"
    path.write_text(script)
    done = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        print(f"memtrain submit: sbatch failed: {done.stderr.strip()}", file=sys.stderr)
        return 1
    job_id = done.stdout.strip().split(";")[0]
    record_job(run_dir, job_id, path, opts.nodes)
    print(f"submitted job {job_id}: script {path}, log {run_dir}/slurm-{job_id}.out")
    return 0
