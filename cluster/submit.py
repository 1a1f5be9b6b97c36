"""`memtrain submit`: render a run's sbatch script into its run directory and submit it.

    memtrain submit --config configs/enwik8-xl-base.yaml --nodes 4 --gpus-per-node 8 \\
        --gpu-type a100 --time 2-00:00:00 --partition gpu --setup "module load cuda/12.1"
    memtrain submit --config quickstart --gpus-per-node 0 --tasks-per-node 2 --dry-run
    memtrain submit --config quickstart --launcher deepspeed --gpus-per-node 0 \
        --tasks-per-node 2 --dry-run

The run config is loaded and validated first (a bad field fails here, not on the cluster),
then the job's rank layout against it (cluster/layout.py: batches divisible by the ranks,
one rank per GPU, a precision the GPU type has; a GPU job that would train in fp32 is warned
about), for a GPU job the torch of --python (cluster/torch_check.py: a CUDA build with
kernels for the GPU type), and the CPUs and GPUs one node must hold against the partition's
nodes as sinfo lists them (cluster/partition.py; skipped, with a line, where sinfo cannot
answer); the script is written to <run_dir>/submit-<time>.sbatch and stays usable with
plain sbatch.
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import time
from pathlib import Path

from memtrain.command_line import error_line
from train.config import ConfigError, checkpoint_source, load_config, resolve_path
from train.run_dir import RunDir, atomic_write_json, atomic_write_text, sqlite_uri

from . import partition, torch_check
from .jobs import record_job
from .layout import check_layout, precision_warnings
from .options import add_flags, flag, from_args
from .sbatch import render


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="memtrain submit", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True,
                   help="a YAML run config, or the name of one in configs/")
    p.add_argument("overrides", nargs="*", metavar="section.field=value")
    add_flags(p)  # one flag per SubmitOptions field (cluster/options.py)
    p.add_argument("--sweep", action="append", default=[], metavar="FIELD=V1,V2,...",
                   help="a grid axis (repeat for more axes): one job array element per "
                        "combination, each its own run and MLflow run in one experiment")
    p.add_argument("--dry-run", action="store_true", help="print the script, submit nothing")
    return p


def _check_layout(cfg, overrides: list[str], opts) -> None:
    """The job's rank layout against this run config (cluster/layout.py)."""
    check_layout(cfg, overrides, nodes=opts.nodes, tasks_per_node=opts.ntasks_per_node,
                 gpus_per_node=opts.gpus_per_node, gpu_type=opts.gpu_type)


def absolute_paths(cfg) -> list[str]:
    """Overrides that pin the run config's relative paths to the directory `memtrain submit`
    ran in (what a local run there would use), so that the job does not depend on the
    directory sbatch starts it in: data.path, deepspeed.config, a sqlite tracking.uri, a
    pretrained checkpoint directory (model.hf.path), the init_from file. URLs,
    url_template and hub names are left as they are."""
    out = []
    field, path = checkpoint_source(cfg) or ("", "")
    if path and os.path.isdir(os.path.expanduser(path)) and not os.path.isabs(path):
        out.append(f"{field}={os.path.abspath(os.path.expanduser(path))}")
    if cfg.init_from and not os.path.isabs(cfg.init_from):
        out.append(f"init_from={os.path.abspath(cfg.init_from)}")
    data = cfg.data.path
    if "://" not in data and not data.startswith("pipe:") and not os.path.isabs(data):
        out.append(f"data.path={os.path.abspath(data)}")
    if not os.path.isabs(cfg.deepspeed.config):
        out.append(f"deepspeed.config={os.path.abspath(resolve_path(cfg.deepspeed.config))}")
    uri, sqlite = cfg.tracking.uri, "sqlite:///"
    if uri.startswith(sqlite) and not os.path.isabs(uri[len(sqlite):]):
        out.append(f"tracking.uri={sqlite_uri(os.path.abspath(uri[len(sqlite):]))}")
    return out


def _hub_name(cfg) -> str:
    """The pretrained checkpoint the job reads (model.hf.path) when it names a hub model
    rather than a local directory."""
    _, path = checkpoint_source(cfg) or ("", "")
    return "" if not path or os.path.isdir(os.path.expanduser(path)) else path


def _check_torch(opts, strict: bool) -> None:
    """The torch of the nodes' python has CUDA and kernels for the GPU type: an error before
    sbatch, a warning under --dry-run (which only shows the script)."""
    info = torch_check.probe(opts.python)
    if info is None:
        print(f"memtrain submit: warning: could not run {opts.python} here to check its torch "
              "for the GPUs", file=sys.stderr)
    problem = torch_check.torch_problem(info, opts.python, opts.gpus_per_node, opts.gpu_type)
    if problem and strict:
        raise ConfigError(flag("python"), problem)
    if problem:
        print(f"memtrain submit: warning (an error without --dry-run): {flag('python')}: "
              f"{problem}",
              file=sys.stderr)


def _check_partition(opts, strict: bool) -> None:
    """One node's share of the job (CPUs, GPUs of the type) against the partition's nodes,
    from sinfo (cluster/partition.py): an error before sbatch, a warning under --dry-run;
    one line saying the check was skipped when sinfo cannot tell."""
    try:
        nodes = partition.query_nodes(opts.partition)
    except partition.PartitionUnknown as err:
        print(f"memtrain submit: note: CPUs and GPUs per node not checked against the "
              f"partition's nodes: {err}", file=sys.stderr)
        return
    problem = partition.request_problem(opts, nodes)
    if problem and strict:
        raise ConfigError(*problem)
    if problem:
        print(f"memtrain submit: warning (an error without --dry-run): {problem[0]}: "
              f"{problem[1]}", file=sys.stderr)


def _sweep(args, name: str, run_dir: Path, opts) -> list[tuple[Path, list[str]]] | None:
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
        shared.append(f"tracking.uri={RunDir(run_dir).own_store_uri}")
    elements = []
    for i, combo in enumerate(itertools.product(*axes)):
        element = [*combo, f"name={name}-{i:02d}", *shared]
        # Fail here, not on the nodes: the element's config and its rank layout.
        cfg = load_config(args.config, [*args.overrides, *element])
        _check_layout(cfg, [*args.overrides, *element], opts)
        element += absolute_paths(cfg)   # after the element's own values, which may be paths
        elements.append((run_dir.parent / f"{name}-{i:02d}", element))
    return elements


def main_submit(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        run_dir = cfg.resolved_run_dir.absolute()
        opts = from_args(args, job_name=cfg.name).validate()
        _check_layout(cfg, args.overrides, opts)
        for warning in precision_warnings(cfg.deepspeed.precision, args.overrides,
                                          opts.gpus_per_node, opts.gpu_type):
            print(f"memtrain submit: {warning}", file=sys.stderr)
        hub_name = _hub_name(cfg)
        if hub_name:
            print(f"memtrain submit: note: model.hf.path {hub_name!r} is a hub name: every "
                  "node resolves it through its own Hugging Face cache (HF_HOME), and a node "
                  "without network fails unless that cache holds it; a directory every node "
                  "reads (huggingface-cli download ... --local-dir) avoids both",
                  file=sys.stderr)
        if opts.gpus_per_node and not opts.skip_torch_check:
            _check_torch(opts, strict=not args.dry_run)
        _check_partition(opts, strict=not args.dry_run)
        config_path = Path(args.config)
        config_path = config_path.absolute() if config_path.is_file() else args.config
        sweep = _sweep(args, cfg.name, run_dir, opts)
        script = render(config_path, [*args.overrides, *absolute_paths(cfg)], run_dir, opts,
                        sweep)
    except ConfigError as err:  # a config field or an option, named in the message
        return error_line("memtrain submit", err)
    if args.dry_run:
        print(script, end="")
        return 0
    run_dir.mkdir(parents=True, exist_ok=True)
    run = RunDir(run_dir)
    if sweep:
        atomic_write_json(run.sweep, [{"run_dir": str(d), "overrides": o} for d, o in sweep])
    path = atomic_write_text(run.submit_script(time.strftime('%Y%m%d-%H%M%S')), script)
    done = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        print(f"memtrain submit: sbatch failed: {done.stderr.strip()}", file=sys.stderr)
        return 1
    job_id = done.stdout.strip().split(";")[0]
    record_job(run_dir, job_id, path, opts.nodes)
    print(f"submitted job {job_id}: script {path}, log {run.slurm_log(job_id)}")
    return 0
