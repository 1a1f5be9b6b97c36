"""What the rendered sbatch script does for a first multi-node job: srun steps get the job's
CPUs per task (SRUN_CPUS_PER_TASK, SLURM >= 22.05), GPU jobs ask for their nodes' memory, the
master port stays out of the ephemeral range, relative run paths are pinned at submit time,
comma-valued variables (NCCL_IB_HCA=mlx5_0,mlx5_1) survive the DeepSpeed launcher's srun
--export list, and that launcher's srun step takes the job's GPUs without asking for them
again, on a real single-node SLURM too (with fake GPUs)."""

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from daemons import run_ok
from slurm_cluster import start_cluster_for_test
from train_helpers import ROOT, child_env

from cluster.options import SubmitOptions
from cluster.sbatch import TRAIN_SCRIPT, render
from cluster.submit import main_submit
from train import distributed
from train.config import ConfigError
from train.run_dir import RunDir


def _lines(script: str, first: str, last: str) -> str:
    """The script's lines from the first starting with `first` to the first with `last`."""
    lines = script.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(first))
    end = next(i for i, line in enumerate(lines) if i >= start and line.startswith(last))
    return "\n".join(lines[start:end + 1])


@pytest.mark.parametrize("launcher", ["srun", "deepspeed"])
def test_srun_steps_get_the_jobs_cpus_per_task(launcher):
    script = render("configs/quickstart.yaml", [], "/r",
                    SubmitOptions(cpus_per_task=6, launcher=launcher, python=sys.executable))
    lines = script.splitlines()
    export = lines.index('export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"')
    launch = next(i for i, line in enumerate(lines)
                  if line.startswith(("srun ", f"{sys.executable} -m deepspeed")))
    assert export < launch
    done = subprocess.run(["bash", "-euc", f"{lines[export]}; echo $SRUN_CPUS_PER_TASK"],
                          env={"SLURM_CPUS_PER_TASK": "6", "PATH": os.environ["PATH"]},
                          capture_output=True, text=True)
    assert done.stdout.strip() == "6"


def test_gpu_jobs_take_their_nodes_memory_unless_given_a_size():
    def mem(**kw):
        script = render("configs/quickstart.yaml", [], "/r", SubmitOptions(**kw))
        return [line for line in script.splitlines() if line.startswith("#SBATCH --mem")]

    assert mem(gpus_per_node=8) == ["#SBATCH --mem=0"]
    assert mem(gpus_per_node=0) == []                    # a CPU job: the site's default
    assert mem(gpus_per_node=8, mem="480G") == ["#SBATCH --mem=480G"]
    assert mem(gpus_per_node=0, mem="0") == ["#SBATCH --mem=0"]
    assert mem(gpus_per_node=8, mem="") == []
    with pytest.raises(ConfigError):
        mem(mem="lots")


def test_master_ports_stay_below_the_ephemeral_range_and_the_same_in_bash():
    low, high = 32768, 60999
    proc = Path("/proc/sys/net/ipv4/ip_local_port_range")
    if proc.exists():
        low, high = map(int, proc.read_text().split())
    ports = {distributed.slurm_master_port(job) for job in range(0, 300_000, 7)}
    assert min(ports) >= 10000 and max(ports) < 20000     # not 20000-39999 either
    assert not any(low <= p <= high for p in ports)
    assert len(ports) > 9000                               # jobs on one node rarely collide
    done = subprocess.run([sys.executable, "-m", "train.distributed", "master-port"], cwd=ROOT,
                          env={**os.environ, "SLURM_JOB_ID": "1234567"}, capture_output=True,
                          text=True, timeout=60)
    assert done.stdout.strip() == str(distributed.slurm_master_port(1234567)) == "14567"


def test_relative_run_paths_are_pinned_to_the_submit_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    cfg = yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())
    cfg["data"]["path"] = "data/qs"
    cfg["tracking"] = {"uri": "sqlite:///runs/store.db"}
    Path("qs.yaml").write_text(yaml.safe_dump(cfg))
    assert main_submit(["--config", "qs.yaml", "--gpus-per-node", "0", "--dry-run"]) == 0
    script = capsys.readouterr().out
    assert f"data.path={tmp_path}/data/qs" in script
    assert f"tracking.uri=sqlite:///{tmp_path}/runs/store.db" in script
    assert f"deepspeed.config={ROOT}/ds_config.json" in script
    # A sweep over a path: each element's value is pinned after it.
    assert main_submit(["--config", "qs.yaml", "--gpus-per-node", "0", "--dry-run",
                        "--sweep", "data.path=a,b"]) == 0
    cases = [line for line in capsys.readouterr().out.splitlines() if "ELEMENT=(" in line]
    for case, value in zip(cases, "ab", strict=True):
        assert case.index(f"data.path={value} ") < case.index(f"data.path={tmp_path}/{value} ")


def test_a_relative_pretrained_checkpoint_directory_is_pinned_too(tmp_path, monkeypatch,
                                                                 capsys):
    from pretrained_helpers import hf_model_section, tiny_gpt2

    monkeypatch.chdir(tmp_path)
    tiny_gpt2(tmp_path / "ckpt" / "gpt2")
    cfg = yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())
    cfg["model"] = hf_model_section(Path("ckpt/gpt2"), m=2, tgt_len=16)
    Path("hf.yaml").write_text(yaml.safe_dump(cfg))
    assert main_submit(["--config", "hf.yaml", "--gpus-per-node", "0", "--dry-run"]) == 0
    out = capsys.readouterr()
    assert f"model.hf.path={tmp_path}/ckpt/gpt2" in out.out
    assert "hub name" not in out.err


def test_the_stash_covers_every_variable_deepspeed_passes_on_cuda():
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator
    from deepspeed.launcher.runner import EXPORT_ENVS

    for prefix in [*EXPORT_ENVS, *CUDA_Accelerator.export_envs(None)]:
        assert prefix in distributed.DEEPSPEED_EXPORTS


def test_comma_values_reach_the_ranks_whole_on_the_deepspeed_launcher_path(tmp_path):
    script = render("configs/quickstart.yaml", [], tmp_path / "run",
                    SubmitOptions(gpus_per_node=0, launcher="deepspeed", python=sys.executable))
    stash = _lines(script, 'mkdir -p "$RUN_DIR"', 'eval "$UNSET"')
    env = {**child_env(), "RUN_DIR": str(tmp_path / "run"), "SLURM_JOB_ID": "77",
           "NCCL_IB_HCA": "mlx5_0,mlx5_1", "UCX_NET_DEVICES": "mlx5_0:1,mlx5_1:1",
           "NCCL_DEBUG": "INFO"}
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", f"{stash}\nenv -0"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    launcher_env = dict(kv.split("=", 1) for kv in done.stdout.split("\0") if "=" in kv)
    # What DeepSpeed's launcher would repeat in srun --export holds no comma any more.
    prefixes = ("NCCL", "MLFLOW", "PYTHON", "MV2", "UCX")   # DeepSpeed's, checked above
    passed = {k: v for k, v in launcher_env.items() if k.startswith(prefixes)}
    assert not any("," in v for v in passed.values()), passed
    assert passed["NCCL_DEBUG"] == "INFO"
    # A rank (which inherits MEMTRAIN_ENV_FILE through --export=ALL) gets them back whole.
    rank_env = {"MEMTRAIN_ENV_FILE": launcher_env["MEMTRAIN_ENV_FILE"], "RANK": "0",
                "WORLD_SIZE": "1"}
    distributed.resolve_env(rank_env)
    assert rank_env["NCCL_IB_HCA"] == "mlx5_0,mlx5_1"
    assert rank_env["UCX_NET_DEVICES"] == "mlx5_0:1,mlx5_1:1"
    assert oct(os.stat(launcher_env["MEMTRAIN_ENV_FILE"]).st_mode & 0o777) == "0o600"


def _deepspeed_srun(script: str, hosts: list[str], tmp_path: Path) -> list[str]:
    """The srun command DeepSpeed's launcher builds from the script's launcher line
    (deepspeed/launcher/runner.py main: hostfile, resource filters; multinode_runner.py
    SlurmRunner.get_cmd), for an allocation of `hosts`."""
    from deepspeed.launcher import runner
    from deepspeed.launcher.multinode_runner import SlurmRunner

    line = next(line for line in script.splitlines() if "-m deepspeed.launcher.runner" in line)
    slots = re.search(r"slots=(\d+)", script).group(1)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{h} slots={slots}\n" for h in hosts))
    line = line.replace('"$HOSTFILE"', str(hostfile)).replace('"$MASTER_ADDR"', hosts[0])
    argv = shlex.split(line.replace('"$MASTER_PORT"', "12345"))
    args = runner.parse_args(argv[argv.index("deepspeed.launcher.runner") + 1:])
    pool = runner.fetch_hostfile(args.hostfile)
    active = runner.parse_inclusion_exclusion(pool, args.include, args.exclude)
    active = runner.apply_num_nodes_and_gpus(active, args.num_nodes, args.num_gpus)
    slurm = SlurmRunner(args, runner.encode_world_info(active), pool)
    return slurm.get_cmd(dict(os.environ), active)


def test_the_deepspeed_launchers_job_step_takes_the_jobs_gpus_without_asking_again(tmp_path):
    """Inside a --gres allocation the ranks' srun step must not request GPUs itself: srun(1),
    --gres: "By default, a job step is allocated all of the generic resources that have
    been requested by the job". DeepSpeed's slurm backend turns its --num_gpus into
    `srun --gpus-per-node N`, a second request in another syntax that the step must be
    granted again from the job's GPUs (refused or waiting when SLURM cannot match it, e.g.
    typed gres, or GPUs another step holds). So the launcher gets no --num_gpus; the hostfile's
    slots give the ranks per node, and the step runs nodes x tasks ranks on all the nodes,
    one per GPU, each seeing its node's GPUs as under the srun launcher."""
    script = render("configs/wt103-rmt.yaml", [], "/r", SubmitOptions(
        nodes=4, gpus_per_node=8, gpu_type="a100", launcher="deepspeed",
        python=sys.executable))
    assert "#SBATCH --gres=gpu:a100:8" in script
    cmd = _deepspeed_srun(script, [f"node{i}" for i in range(4)], tmp_path)
    srun = cmd[:cmd.index(next(a for a in cmd if a.startswith("--export=")))]
    assert srun[0] == "srun"
    assert not [a for a in srun if a.startswith(("--gpus", "--gres", "-G"))], srun
    assert srun[srun.index("-n") + 1] == "32" and srun[srun.index("--nodes") + 1] == "4"
    assert "--kill-on-bad-exit=1" in srun
    assert "--nodelist" not in srun            # no resource filter: the whole allocation


# ----------------------------------------------------------------------------- real SLURM
PROBE = """\
import os, sys
from train.distributed import resolve_env
from train.run_dir import RunDir
who = resolve_env()
print(f"memtrain-probe rank {who.rank} NCCL_IB_HCA={os.environ.get('NCCL_IB_HCA')}", flush=True)
run_dir = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("run_dir="))
if who.rank == 0:
    RunDir(run_dir).write_status("finished", 0)
"""


def _run_job(script: str, run, tmp_path, env, limit: int) -> str:
    """sbatch the script on the local SLURM, wait up to `limit` seconds for the job to
    leave the queue, and return its log."""
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    job = run_ok(["sbatch", "--parsable", str(path)], env=env, cwd=ROOT).stdout.strip()
    deadline = time.time() + limit
    while subprocess.run(["squeue", "-h", "-j", job], env=env, capture_output=True,
                         text=True).stdout.strip():
        assert time.time() < deadline, "the job did not end"
        time.sleep(0.5)
    return run.slurm_log(job).read_text()


@pytest.mark.slow
def test_on_slurm_the_deepspeed_launcher_delivers_comma_values_whole_and_slurms_ranks(tmp_path):
    slurm, stop = start_cluster_for_test(tmp_path / "slurm")
    try:
        # What srun does with DeepSpeed's kind of list for a variable that is not in its
        # own environment (a .deepspeed_env entry): cut at the comma. (Measured on SLURM
        # 22.05.8: a variable that is also in srun's environment keeps that value.)
        cut = subprocess.run(["srun", "-n1", "--export=ALL,NCCL_IB_HCA=mlx5_0,mlx5_1",
                              "printenv", "NCCL_IB_HCA"], env=child_env(slurm),
                             capture_output=True, text=True, timeout=120)
        assert cut.stdout.strip() == "mlx5_0"
        # Submitted from a shell that holds a launcher's variables (a notebook on a DDP node):
        # the ranks still come from SLURM.
        env = child_env({**slurm, "NCCL_IB_HCA": "mlx5_0,mlx5_1", "RANK": "0",
                         "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
        probe = tmp_path / "probe.py"
        probe.write_text(PROBE)
        run = RunDir(tmp_path / "run")
        run.path.mkdir()
        script = render("configs/quickstart.yaml", [], run.path, SubmitOptions(
            gpus_per_node=0, tasks_per_node=2, cpus_per_task=1, time="10",
            launcher="deepspeed", python=sys.executable))
        log = _run_job(script.replace(str(TRAIN_SCRIPT), str(probe)), run, tmp_path, env,
                       limit=300)
        assert "cmd = srun -n 2" in log                    # DeepSpeed's slurm backend ran
        ranks = sorted(line for line in log.splitlines() if line.startswith("memtrain-probe"))
        assert ranks == [f"memtrain-probe rank {r} NCCL_IB_HCA=mlx5_0,mlx5_1" for r in (0, 1)]
        assert json.loads(run.status.read_text())["state"] == "finished"
    finally:
        stop()


GPU_PROBE = """\
import os, sys
from train.distributed import resolve_env
from train.run_dir import RunDir
who = resolve_env()
print(f"memtrain-probe rank {who.rank} local {who.local_rank} "
      f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')} "
      f"SLURM_STEP_GPUS={os.environ.get('SLURM_STEP_GPUS')}", flush=True)
run_dir = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("run_dir="))
if who.rank == 0:
    RunDir(run_dir).write_status("finished", 0)
"""


@pytest.mark.slow
def test_on_slurm_with_gpus_the_deepspeed_launchers_ranks_see_all_the_jobs_gpus(tmp_path):
    """A node with 2 (fake) GPUs, a --gres=gpu:fake:2 job of 2 tasks started by DeepSpeed's
    launcher: its srun step asks for no GPUs and each rank sees both of the job's GPUs
    (one per rank by LOCAL_RANK, as under the srun launcher)."""
    slurm, stop = start_cluster_for_test(tmp_path / "slurm", gpus=2)
    try:
        env = child_env(slurm)
        probe = tmp_path / "probe.py"
        probe.write_text(GPU_PROBE)
        run = RunDir(tmp_path / "run")
        run.path.mkdir()
        script = render("configs/quickstart.yaml", [], run.path, SubmitOptions(
            gpus_per_node=2, gpu_type="fake", cpus_per_task=1, time="10", mem="",
            launcher="deepspeed", python=sys.executable))
        assert "#SBATCH --gres=gpu:fake:2" in script
        log = _run_job(script.replace(str(TRAIN_SCRIPT), str(probe)), run, tmp_path, env,
                       limit=120)
        step = next(line for line in log.splitlines() if "cmd = srun" in line)
        assert "cmd = srun -n 2" in step and "--gpus" not in step, step
        ranks = sorted(line for line in log.splitlines() if line.startswith("memtrain-probe"))
        assert ranks == [f"memtrain-probe rank {r} local {r} CUDA_VISIBLE_DEVICES=0,1 "
                         "SLURM_STEP_GPUS=0,1" for r in (0, 1)], log[-3000:]
        assert json.loads(run.status.read_text())["state"] == "finished"
    finally:
        stop()
