"""`memtrain submit` and the sbatch script: golden V100/A100 scripts, validation and quoting
against injection, and a real single-node SLURM: a 2-task CPU training job runs to the end,
and one warned with USR1 mid-run checkpoints, requeues itself, resumes and ends with the
losses of an uninterrupted run."""

import contextlib
import json
import os
import re
import socket
import subprocess
import time
from pathlib import Path

import pytest
from daemons import run_ok
from slurm_cluster import SlurmUnavailable, _own_ports, start_cluster_for_test
from train_helpers import BIN, ROOT, child_env, step_losses, tiny_config

from cluster.sbatch import TRAIN_SCRIPT, SubmitOptions, render
from model import ConfigError

GOLDEN = Path(__file__).parent / "golden"
VENV_PY = "/opt/venvs/memtrain/bin/python"


def test_v100_and_a100_scripts_match_their_golden_files():
    v100 = render("configs/enwik8-xl-base.yaml", ["max_steps=1000"],
                  "/scratch/runs/enwik8-xl-base",
                  SubmitOptions(nodes=2, gpus_per_node=8, gpu_type="v100", time="2-00:00:00",
                                partition="gpu", account="lm-team", qos="normal",
                                cpus_per_task=6, mem="480G", exclusive=True,
                                setup=["module load cuda/11.8",
                                       "source /opt/venvs/memtrain/bin/activate"],
                                python=VENV_PY, job_name="enwik8-xl-base"))
    a100 = render("configs/wt103-rmt.yaml", [], "/scratch/runs/wt103-rmt",
                  SubmitOptions(nodes=4, gpus_per_node=4, gpu_type="a100", time="24:00:00",
                                partition="a100", constraint="a100&ib", cpus_per_task=16,
                                setup=["module load cuda/12.1"], signal_seconds=600,
                                max_requeues=20, python=VENV_PY, job_name="wt103-rmt",
                                launcher="deepspeed"))
    a100 = a100.replace(str(TRAIN_SCRIPT), "/checkout/train/__main__.py")
    if os.environ.get("MEMTRAIN_WRITE_GOLDEN") == "1":  # after a deliberate change
        (GOLDEN / "v100.sbatch").write_text(v100)
        (GOLDEN / "a100.sbatch").write_text(a100)
    assert v100 == (GOLDEN / "v100.sbatch").read_text()
    assert a100 == (GOLDEN / "a100.sbatch").read_text()
    # What differs between the clusters: GPUs per node in --gres and the precision.
    assert "#SBATCH --gres=gpu:v100:8" in v100 and "deepspeed.precision=fp16" in v100
    assert "#SBATCH --gres=gpu:a100:4" in a100 and "deepspeed.precision=bf16" in a100
    explicit = render("configs/wt103-rmt.yaml", ["deepspeed.precision=fp32"], "/r",
                      SubmitOptions(gpu_type="a100"))
    assert "deepspeed.precision=bf16" not in explicit  # the user's choice wins


@pytest.mark.parametrize("field, value", [
    ("partition", "debug; rm -rf ~"), ("partition", "gpu\n#SBATCH --uid=0"),
    ("account", "$(reboot)"), ("qos", "a b"), ("time", "1:00; id"), ("mem", "64G`id`"),
    ("constraint", "a100; id"), ("job_name", "x'y"), ("gpu_type", "a100:8,gpu"),
])
def test_values_that_would_reach_the_shell_unquoted_are_refused(field, value):
    with pytest.raises(ConfigError) as err:
        render("configs/quickstart.yaml", [], "/r", SubmitOptions(**{field: value}))
    assert err.value.field == f"--{field.replace('_', '-')}"


def test_setup_lines_and_overrides_cannot_inject_commands(tmp_path):
    pwned = tmp_path / "pwned"
    script = render("configs/quickstart.yaml", [f"name=x;touch {pwned}"], "/r",
                    SubmitOptions(setup=[f"echo hi; touch {pwned}", f"echo $(touch {pwned})"]))
    setup = [line for line in script.splitlines() if line.startswith("echo ")][:2]
    assert len(setup) == 2
    done = subprocess.run(["bash", "-c", "\n".join(setup)], capture_output=True, text=True)
    assert done.returncode == 0 and not pwned.exists()
    assert f"hi; touch {pwned}" in done.stdout           # printed, not run
    assert f"'name=x;touch {pwned}'" in script            # one quoted argument
    with pytest.raises(ConfigError):
        render("configs/quickstart.yaml", [], "/r", SubmitOptions(setup=["a\nb"]))
    with pytest.raises(ConfigError):
        render("configs/quickstart.yaml", [], "/path with space", SubmitOptions())


def test_dry_run_prints_the_script_and_a_bad_run_config_fails_before_sbatch(capsys):
    from cluster.submit import main_submit
    assert main_submit(["--config", "quickstart", "--gpus-per-node", "0", "--dry-run"]) == 0
    assert capsys.readouterr().out.startswith("#!/bin/bash")
    assert main_submit(["--config", "quickstart", "model.mem_len=-1", "--dry-run"]) == 2
    assert "model.mem_len" in capsys.readouterr().err


def test_a_foreign_process_on_a_test_clusters_port_is_refused_by_name(tmp_path):
    # What tests/slurm_cluster.py checks once the node is up: the listener on each port is
    # the cluster's own daemon (its pid file), not whatever took the port first.
    with socket.socket() as foreign:
        foreign.bind(("127.0.0.1", 0))
        foreign.listen()
        (tmp_path / "slurmctld.pid").write_text(str(os.getpid() + 10_000_000))  # no such pid
        with pytest.raises(SlurmUnavailable, match=rf"port {foreign.getsockname()[1]}: "
                                                   rf"pid {os.getpid()} \("):
            _own_ports(tmp_path, {"slurmctld": foreign.getsockname()[1]})


# ----------------------------------------------------------------------------- real SLURM
@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    env, stop = start_cluster_for_test(tmp_path_factory.mktemp("slurm"))
    yield env
    stop()


def _ports(env) -> set[int]:
    conf = Path(env["SLURM_CONF"]).read_text()
    return {int(p) for p in re.findall(r"^Slurm(?:ctld|d)Port=(\d+)$", conf, re.MULTILINE)}


@pytest.mark.slow
def test_a_second_cluster_starts_beside_the_first_with_slurms_default_port_held(slurm,
                                                                                 tmp_path):
    # SLURM's default controller port held (here by this test, unless something else holds
    # it already): the clusters pick free ports of their own, so neither waits for the other.
    with contextlib.ExitStack() as stack:
        with contextlib.suppress(OSError):
            held = stack.enter_context(socket.socket())
            held.bind(("0.0.0.0", 6817))
            held.listen()
        other, stop = start_cluster_for_test(tmp_path / "other")
    try:
        assert len(_ports(slurm)) == len(_ports(other)) == 2
        assert not _ports(slurm) & _ports(other) and 6817 not in _ports(other)
        for env in (slurm, other):
            assert run_ok(["sinfo", "-h", "-o", "%T"], env=env).stdout.strip() == "idle"
    finally:
        stop()


def _submit(env, cfg, *extra):
    done = subprocess.run([str(BIN / "memtrain"), "submit", "--config", str(cfg),
                           "--gpus-per-node", "0", "--tasks-per-node", "2",
                           "--cpus-per-task", "1", "--time", "15", *extra], cwd=ROOT,
                          env=child_env(env), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()[2].rstrip(":")


def _wait(env, job, timeout=600, on_pending=None):
    deadline = time.time() + timeout
    while time.time() < deadline:
        state = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T %r"], env=env,
                               capture_output=True, text=True).stdout.strip()
        if not state:
            return
        if on_pending and state.startswith("PENDING"):
            on_pending(state)
        time.sleep(0.5)
    raise AssertionError(f"job {job} still {state!r} after {timeout} s")


def _config(tmp_path, name):
    return tiny_config(tmp_path, name, max_steps=30, deepspeed={"zero_stage": 2},
                       model={"mechanism": "rmt", "mem_len": 4, "rmt": {"num_mem_tokens": 3}},
                       bptt={"depth": 1}, eval={"max_segments": 4},
                       tracking={})   # the requeued job must go on in its MLflow run


@pytest.fixture(scope="module")
def uninterrupted(slurm, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("slurm_runs")
    job = _submit(slurm, _config(tmp, "straight"))
    _wait(slurm, job)
    return tmp / "runs" / "straight", job


@pytest.mark.slow
def test_a_two_task_training_job_runs_to_the_end_under_srun(uninterrupted):
    run_dir, job = uninterrupted
    log = (run_dir / f"slurm-{job}.out").read_text()
    assert "2 rank(s) via slurm" in log and "run state finished after restart 0" in log
    assert json.loads((run_dir / "status.json").read_text())["state"] == "finished"
    assert (run_dir / "checkpoints" / "latest").read_text() == "step00000030"
    assert json.loads((run_dir / "tracking.json").read_text())["run_id"]
    assert sorted(step_losses(run_dir)) == list(range(1, 31))


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["srun", "deepspeed"])
def test_usr1_checkpoints_requeues_and_resumes_to_the_uninterrupted_losses(
        slurm, uninterrupted, tmp_path, launcher):
    job = _submit(slurm, _config(tmp_path, "warned"), "--launcher", launcher)
    run_dir = tmp_path / "runs" / "warned"
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 900   # a hang guard: a job under load starts in minutes
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 5):
        assert time.time() < deadline, "the job never started training"
        time.sleep(0.2)
    # What SLURM sends before the time limit, here by hand, to the batch shell only.
    run_ok(["scancel", "--signal=USR1", "--batch", job], env=slurm)

    released = []

    def release(state):  # SLURM delays a requeued job (BeginTime); start it sooner, once
        if "BeginTime" in state and not released:
            # Not at once: slurmd refuses a start within the second the previous run's
            # credential was revoked ("Job credential revoked"), which is why SLURM delays.
            time.sleep(3)
            subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now"], env=slurm,
                           capture_output=True)
            released.append(True)
    _wait(slurm, job, on_pending=release)
    log = (run_dir / f"slurm-{job}.out").read_text()
    assert "run state interrupted after restart 0" in log
    assert "resumed from" in log and "run state finished after restart 1" in log
    assert log.count("2 rank(s) via slurm") == 2  # both starts: ranks from SLURM's variables
    if launcher == "deepspeed":  # DeepSpeed's slurm backend made the job step, from the hostfile
        assert "cmd = srun -n 2" in log
        assert (run_dir / f"hostfile-{job}").read_text().split() == ["localhost", "slots=2"]
    assert step_losses(run_dir) == step_losses(uninterrupted[0])


@pytest.mark.slow
def test_memtrain_jobs_lists_ended_and_queued_jobs_with_their_runs(slurm, uninterrupted,
                                                                   tmp_path):
    run_dir, job = uninterrupted
    # The partition is down while the job is submitted and held: on an idle node SLURM may
    # start a job before a later `scontrol hold` arrives (seen under load, ~1 s apart).
    def partition(state):
        run_ok(["scontrol", "update", "PartitionName=debug", f"State={state}"], env=slurm)

    partition("DOWN")
    try:
        held = _submit(slurm, _config(tmp_path, "held"))
        run_ok(["scontrol", "hold", held], env=slurm)
    finally:
        partition("UP")
    try:
        rows = {}
        for root in (run_dir.parent, tmp_path / "runs"):
            done = subprocess.run([str(BIN / "memtrain"), "jobs", "--runs-root", str(root),
                                   "--json"], env=child_env(slurm), capture_output=True,
                                  text=True, timeout=60)
            assert done.returncode == 0, done.stderr
            rows.update({r["job_id"]: r for r in map(json.loads, done.stdout.splitlines())})
        ended = rows[job]
        assert ended["state"] == "ended (finished)" and ended["last_step"] == 30
        assert ended["mlflow_run_id"] == json.loads(
            (run_dir / "tracking.json").read_text())["run_id"]
        assert rows[held]["state"] == "PENDING" and rows[held]["nodes"] == 1
        assert rows[held]["run"] == "held" and rows[held]["last_step"] is None
    finally:
        subprocess.run(["scancel", held], env=slurm, capture_output=True)


@pytest.mark.slow
def test_a_sweep_is_one_job_array_with_one_mlflow_run_per_element(slurm, tmp_path):
    from mlflow import MlflowClient

    cfg = tiny_config(tmp_path, "grid", max_steps=4, eval={"max_segments": 2}, tracking={})
    done = subprocess.run([str(BIN / "memtrain"), "submit", "--config", str(cfg),
                           "--gpus-per-node", "0", "--tasks-per-node", "2",
                           "--cpus-per-task", "1", "--time", "15",
                           "--sweep", "model.mem_len=0,8"], cwd=ROOT,
                          env=child_env(slurm), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    job = done.stdout.split()[2].rstrip(":")
    script = next((tmp_path / "runs" / "grid").glob("submit-*.sbatch")).read_text()
    assert "#SBATCH --array=0-1" in script
    _wait(slurm, job)
    for i in (0, 1):
        status = json.loads((tmp_path / "runs" / f"grid-{i:02d}" / "status.json").read_text())
        assert status == {"state": "finished", "step": 4}
    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'grid'}/mlflow.db")
    exp = client.get_experiment_by_name("grid")
    runs = client.search_runs([exp.experiment_id])
    assert sorted(r.data.params["model.mem_len"] for r in runs) == ["0", "8"]
    assert sorted(r.info.run_name for r in runs) == ["grid-00", "grid-01"]


@pytest.mark.slow
def test_on_slurm_a_requeued_run_whose_ranks_fail_at_start_ends_failed_not_requeued(
        slurm, tmp_path):
    """A previous job of the run left "interrupted"; this job's ranks fail at start (its data
    path is gone). The job must end failed: requeued on the stale state it would start and
    fail again, up to --max-requeues times."""
    from train.run_dir import RunDir

    cfg = tiny_config(tmp_path, "stale", data={"path": str(tmp_path / "gone")})
    run = RunDir(tmp_path / "runs" / "stale")
    run.path.mkdir(parents=True)
    run.write_status("interrupted", 0)
    job = _submit(slurm, cfg)

    def requeued(state):
        assert "BeginTime" not in state, f"job {job} was requeued: {state}"
    _wait(slurm, job, timeout=120, on_pending=requeued)
    log = run.slurm_log(job).read_text()
    assert "run state running after restart 0" in log and "not requeued" in log, log[-3000:]
    assert "gone" in log                                      # the ranks' error is there
    shown = subprocess.run(["scontrol", "show", "job", "-o", job], env=slurm,
                           capture_output=True, text=True).stdout
    assert "JobState=FAILED" in shown and "Restarts=0" in shown, shown
