"""Render a readable sbatch script for a memtrain run; every user value validated and quoted.

The script is plain bash that `sbatch` takes as it is (no pickles, no hidden state):

    #SBATCH lines          resources, from validated options only
    setup lines            e.g. `module load cuda/12.1`, each re-quoted word by word
    launch                 `srun`: one task per GPU (ranks from SLURM's variables), or
                           `deepspeed`: DeepSpeed's launcher with its slurm backend, given a
                           hostfile written from `scontrol show hostnames` (no ssh needed)
    requeue on stop        SLURM's warning signal (--signal=USR1@<s>) or a preemption SIGTERM
                           makes every rank checkpoint and exit; the script then requeues the
                           job (at most --max-requeues times) when the run's status says
                           "interrupted", never after a crash ("running", "failed"). Before
                           the launch a previous job's "interrupted" becomes "running"
                           (cluster/job_state.py): ranks that die at start are not requeued.

Values that reach the script either match a strict pattern (partition, account, time, ...)
or go through shlex.quote, so a partition name or a setup line cannot run other commands.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from train.run_dir import RunDir

# The precision a GPU generation trains in when the overrides do not choose (cluster/layout.py).
from .layout import job_precision

# The options (one dataclass, also the `memtrain submit` flags) and their validation.
from .options import ConfigError, SubmitOptions

# The rank entry point as a file: DeepSpeed's slurm backend runs `python -u <script>` and
# ignores --module (deepspeed/launcher/multinode_runner.py, SlurmRunner.get_cmd).
TRAIN_SCRIPT = Path(__file__).resolve().parents[1] / "train" / "__main__.py"
_PATH = re.compile(r"^[A-Za-z0-9_./\-+]+$")


def _setup_line(line: str) -> str:
    """A setup command, word by word quoted: `module load cuda/12.1` stays as it is, and
    `x; rm -rf ~` becomes the harmless argument 'x;' followed by more arguments."""
    return " ".join(shlex.quote(word) for word in shlex.split(line))


def render(config_path: str | Path, overrides: list[str], run_dir: str | Path,
           opts: SubmitOptions, sweep: list[tuple[Path, list[str]]] | None = None) -> str:
    """The sbatch script for one run (config + overrides), as text. With `sweep`, a job
    array: element i runs with its own run directory and extra overrides, sweep[i]."""
    opts.validate()
    q = shlex.quote
    run_dir = Path(run_dir)
    if not _PATH.match(str(run_dir)):
        raise ConfigError("run_dir", f"{run_dir}: #SBATCH lines cannot quote a path; use "
                          "letters, digits and _ . / - + only")
    sb = [f"#SBATCH --job-name={opts.job_name}", f"#SBATCH --nodes={opts.nodes}",
          f"#SBATCH --ntasks-per-node={opts.ntasks_per_node}",
          f"#SBATCH --cpus-per-task={opts.cpus_per_task}", f"#SBATCH --time={opts.time}",
          f"#SBATCH --output={RunDir(run_dir).slurm_log('%j')}",
          # USR1 to every job step, i.e. the ranks (no B: prefix): they checkpoint.
          f"#SBATCH --signal=USR1@{opts.signal_seconds}", "#SBATCH --requeue",
          "#SBATCH --open-mode=append"]
    if opts.gpus_per_node:
        gres = f"gpu:{opts.gpu_type}:{opts.gpus_per_node}" if opts.gpu_type \
            else f"gpu:{opts.gpus_per_node}"
        sb.append(f"#SBATCH --gres={gres}")
    for name in ("partition", "account", "qos", "constraint"):
        if getattr(opts, name):
            sb.append(f"#SBATCH --{name}={getattr(opts, name)}")
    if opts.mem_per_node:
        sb.append(f"#SBATCH --mem={opts.mem_per_node}")
    if opts.exclusive:
        sb.append("#SBATCH --exclusive")
    if sweep:
        sb[5] = f"#SBATCH --output={RunDir(run_dir).slurm_log('%A_%a')}"
        sb.append(f"#SBATCH --array=0-{len(sweep) - 1}")

    overrides = list(overrides)
    precision, add = job_precision("", overrides, opts.gpu_type)
    if add:
        overrides.append(f"deepspeed.precision={precision}")
    if sweep:
        # Each element: its own run directory (its own checkpoints, requeue and resume).
        cases = ["case \"$SLURM_ARRAY_TASK_ID\" in"]
        for i, (element_dir, extra) in enumerate(sweep):
            if not _PATH.match(str(element_dir)):
                raise ConfigError("run_dir", f"{element_dir}: use letters, digits, _ . / - +")
            args = " ".join(q(a) for a in [*extra, f"run_dir={element_dir}"])
            cases.append(f"    {i}) RUN_DIR={q(str(element_dir))}; ELEMENT=({args}) ;;")
        cases += ["esac", ""]
        train_args = " ".join(q(a) for a in ["--config", str(config_path), *overrides])
        train_args += ' "${ELEMENT[@]}"'
    else:
        cases = [f"RUN_DIR={q(str(run_dir))}"]
        train_args = " ".join(q(a) for a in ["--config", str(config_path), *overrides,
                                             f"run_dir={run_dir}"])
    if opts.launcher == "srun":
        launch = [f"srun --kill-on-bad-exit=1 {q(opts.python)} -m train {train_args}"]
        # srun passes the signals it gets on to every rank.
        forward = "kill -{sig} $LAUNCH_PID"
    else:
        launch = _deepspeed_launch(opts, train_args)
        # The launcher process does not forward signals: send them to its child, the srun.
        forward = "pkill -{sig} -P $LAUNCH_PID"
    py = q(opts.python)
    lines = ["#!/bin/bash", "# Written by `memtrain submit`; plain sbatch runs it as it is.",
             *sb, "", "set -euo pipefail",
             *[_setup_line(s) for s in opts.setup],
             "# srun does not inherit the job's --cpus-per-task since SLURM 22.05: without",
             "# this every rank's step would get one CPU.",
             "export SRUN_CPUS_PER_TASK=\"$SLURM_CPUS_PER_TASK\"",
             "# The ranks come from SLURM: a launcher's RANK, WORLD_SIZE or LOCAL_RANK in the",
             "# submitting shell (sbatch passes its environment on) would win over SLURM_PROCID",
             "# in every task and make them all the same rank.",
             "unset RANK WORLD_SIZE LOCAL_RANK",
             "export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n1)",
             "# The job's port from $SLURM_JOB_ID, as the ranks compute it (train/distributed.py).",
             f"export MASTER_PORT=$({py} -m train.distributed master-port)",
             *cases,
             f"MAX_REQUEUES={opts.max_requeues}",
             "# The previous job's \"interrupted\" becomes \"running\": ranks that end before",
             "# writing a state of their own (a crash at start) are then not requeued",
             "# (cluster/job_state.py).",
             f"{py} -m cluster.job_state start \"$RUN_DIR\"", ""]
    lines += [
        *launch[:-1], f"{launch[-1]} &",
        "LAUNCH_PID=$!",
        "# SLURM's --signal reaches the ranks directly; `scancel --signal=USR1 --batch` and a",
        "# preemption reach this shell, which passes them on to the ranks.",
        *[f"trap 'echo \"memtrain: {sig}, ranks checkpoint\"; "
          f"{forward.format(sig=sig)} 2>/dev/null || true' {sig}" for sig in ("USR1", "TERM")],
        "while kill -0 \"$LAUNCH_PID\" 2>/dev/null; do wait \"$LAUNCH_PID\" || true; done",
        "",
        "# finished, interrupted or failed, from the run's status.json (train/run_dir.py);",
        "# running: the ranks died without writing an end (killed, crashed): not requeued.",
        f"STATE=$({py} -m train.run_dir status \"$RUN_DIR\" || echo failed)",
        "echo \"memtrain: run state $STATE after restart ${SLURM_RESTART_COUNT:-0}\"",
        "if [ \"$STATE\" = running ]; then",
        "    echo \"memtrain: the ranks ended without writing a state (crashed or killed);"
        " not requeued\"",
        "fi",
        "if [ \"$STATE\" = interrupted ] && "
        "[ \"${SLURM_RESTART_COUNT:-0}\" -lt \"$MAX_REQUEUES\" ]; then",
        "    scontrol requeue \"$SLURM_JOB_ID\"",
        "fi",
        "[ \"$STATE\" = finished ] || [ \"$STATE\" = interrupted ]",
        ""]
    return "\n".join(lines)


def _deepspeed_launch(opts: SubmitOptions, train_args: str) -> list[str]:
    """DeepSpeed's launcher inside the allocation: its slurm backend turns the hostfile into
    one `srun -n <nodes x slots>` (deepspeed/launcher/multinode_runner.py, SlurmRunner), so
    no ssh or pdsh is needed. `--force_multi` keeps that path on a single node (else the
    launcher starts local processes itself); `--no_ssh_check` because nodes need not allow ssh.
    The ranks read SLURM's variables and MASTER_ADDR/PORT as under srun."""
    q = shlex.quote
    # No --num_gpus: DeepSpeed would pass it on as `srun --gpus-per-node N`, a second GPU
    # request for a step inside an allocation that already holds the GPUs (--gres). Without
    # it the step gets all of the job's GPUs on each node (srun(1), --gres: "By default, a
    # job step is allocated all of the generic resources that have been requested by the
    # job"), as under the srun launcher; the hostfile's slots already give the ranks per node.
    options = ["--launcher=slurm", "--force_multi", "--no_ssh_check",
               f"--num_nodes={opts.nodes}", "--launcher_args=--kill-on-bad-exit=1"]
    return ["# DeepSpeed's slurm backend repeats the NCCL*, UCX*, PYTHON*, MLFLOW* and MV2*",
            "# variables in srun's --export=ALL,NAME=value,... list, which srun splits at commas",
            "# (NCCL_IB_HCA=mlx5_0,mlx5_1 would arrive as mlx5_0). Values with a comma go to a",
            "# file instead, loaded by every rank at start (train/distributed.py).",
            "mkdir -p \"$RUN_DIR\"",
            f"export MEMTRAIN_ENV_FILE=\"{RunDir('$RUN_DIR').env_file('$SLURM_JOB_ID')}\"",
            f"UNSET=$({q(opts.python)} -m train.distributed stash-env \"$MEMTRAIN_ENV_FILE\")",
            "eval \"$UNSET\"",
            f"HOSTFILE=\"{RunDir('$RUN_DIR').hostfile('$SLURM_JOB_ID')}\"",
            "scontrol show hostnames \"$SLURM_JOB_NODELIST\" | "
            f"sed 's/$/ slots={opts.ntasks_per_node}/' > \"$HOSTFILE\"",
            f"{q(opts.python)} -m deepspeed.launcher.runner --hostfile \"$HOSTFILE\" "
            "--master_addr \"$MASTER_ADDR\" --master_port \"$MASTER_PORT\" "
            f"{' '.join(q(o) for o in options)} {q(str(TRAIN_SCRIPT))} {train_args}"]
