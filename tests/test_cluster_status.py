"""status.json says "running" from the start of a job, so a job whose ranks die hard
(SIGKILL, segfault, a lost node) or fail at start leaves "running", not the previous job's
"interrupted": the sbatch script marks it before the launch and rank 0 before its process
group; the script requeues only "interrupted", at most --max-requeues times, and
`memtrain jobs` shows such a run as crashed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from train_helpers import ROOT, run_train, tiny_config

from cluster.jobs import list_jobs, record_job
from cluster.options import SubmitOptions
from cluster.sbatch import render
from train.run_dir import RunDir


def _end_of_job(tmp_path: Path, state: str | None, restart: int) -> tuple[int, str, list]:
    """The script's lines after the ranks ended, run by bash with a recording `scontrol`:
    (exit code, output, scontrol calls)."""
    run = RunDir(tmp_path / "run")
    run.path.mkdir(exist_ok=True)
    run.status.unlink(missing_ok=True)
    if state:
        run.write_status(state, 7)
    script = render("configs/quickstart.yaml", [], run.path,
                    SubmitOptions(gpus_per_node=0, python=sys.executable, max_requeues=3))
    lines = script.splitlines()
    tail = "\n".join(lines[next(i for i, line in enumerate(lines)
                                if line.startswith("STATE=")):])
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    calls = tmp_path / "scontrol.calls"
    calls.unlink(missing_ok=True)
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (bin_dir / "scontrol").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT),
           "SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": str(restart)}
    done = subprocess.run(["bash", "-euo", "pipefail", "-c",
                           f"RUN_DIR={run.path}\nMAX_REQUEUES=3\n{tail}"], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    made = calls.read_text().splitlines() if calls.exists() else []
    return done.returncode, done.stdout, made


@pytest.mark.parametrize("state, restart, code, requeued", [
    ("interrupted", 0, 0, True),       # a warning or preemption: continue
    ("interrupted", 3, 0, False),      # bounded by --max-requeues
    ("finished", 0, 0, False),
    ("running", 0, 1, False),          # died hard: a failed job, not requeued
    ("failed", 0, 1, False),
    (None, 0, 1, False),               # never started
])
def test_only_an_interrupted_run_is_requeued(tmp_path, state, restart, code, requeued):
    rc, out, calls = _end_of_job(tmp_path, state, restart)
    assert rc == code
    assert calls == (["requeue 42"] if requeued else [])
    if state == "running":
        assert "without writing a state (crashed or killed); not requeued" in out


def test_memtrain_jobs_shows_a_run_left_running_by_an_ended_job_as_crashed(tmp_path,
                                                                          monkeypatch):
    run = RunDir(tmp_path / "r1")
    run.path.mkdir()
    record_job(run.path, "99", run.path / "s.sbatch", 4)
    run.write_status("running", 12)
    monkeypatch.setattr("cluster.jobs._squeue", lambda ids: {})   # the job is over
    assert list_jobs(tmp_path)[0]["state"] == "ended (crashed)"


@pytest.mark.slow
def test_a_hard_crash_leaves_running_not_the_previous_jobs_interrupted(tmp_path):
    """A previous job was interrupted (and requeued this one); this job's rank is killed
    midway through a checkpoint (SIGKILL-like): the status must not read "interrupted"."""
    cfg = tiny_config(tmp_path, "crash", max_steps=6, save_every=2)
    run = RunDir(tmp_path / "runs" / "crash")
    run.path.mkdir(parents=True)
    run.write_status("interrupted", 0)
    done = run_train(cfg, launcher="single", env={"MEMTRAIN_FAULT": "after_rank_files:4"},
                     check=False)
    assert done.returncode == 137, done.stderr[-3000:]
    assert json.loads(run.status.read_text()) == {"state": "running", "step": 0}
    # Resumed, it ends as usual.
    run_train(cfg, launcher="single")
    assert json.loads(run.status.read_text()) == {"state": "finished", "step": 6}


def test_the_first_rank_writes_running_before_the_process_group_and_the_data(tmp_path):
    """A requeued job's ranks fail at start (here: the data path is gone) after a previous
    job left "interrupted": rank 0 has already replaced it by "running" at the step of the
    latest complete checkpoint, so the sbatch script does not requeue the job again."""
    cfg = tiny_config(tmp_path, "gone", data={"path": str(tmp_path / "no-such-data")})
    run = RunDir(tmp_path / "runs" / "gone")
    ckpt = run.checkpoints / "step00000004"       # what read_checkpoint takes as complete
    ckpt.mkdir(parents=True)
    (ckpt / "COMPLETE").write_text(json.dumps({"step": 4, "world_size": 1}))
    (ckpt / "memtrain_rank00000.pt").write_bytes(b"")
    run.write_status("interrupted", 4)
    done = run_train(cfg, launcher="single", check=False)
    assert done.returncode == 2 and "no-such-data" in done.stderr, done.stderr[-3000:]
    assert json.loads(run.status.read_text()) == {"state": "running", "step": 4}


def _start_to_end(tmp_path: Path, ranks_exit: int) -> tuple[int, str, list, dict]:
    """The script from the line before the launch to its end, run by bash; `srun` is a
    stub that exits with `ranks_exit` without writing anything (ranks that die at start),
    `scontrol` a recorder. (exit code, output, scontrol calls, status.json after)."""
    run = RunDir(tmp_path / "run")
    run.path.mkdir(exist_ok=True)
    run.write_status("interrupted", 7)
    script = render("configs/quickstart.yaml", [], run.path,
                    SubmitOptions(gpus_per_node=0, python=sys.executable, max_requeues=3))
    lines = script.splitlines()
    body = "\n".join(lines[lines.index("MAX_REQUEUES=3"):])
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    calls = tmp_path / "scontrol.calls"
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (bin_dir / "srun").write_text(f"#!/bin/sh\nexit {ranks_exit}\n")
    for tool in ("scontrol", "srun"):
        (bin_dir / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT),
           "SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "1"}
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", f"RUN_DIR={run.path}\n{body}"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    made = calls.read_text().splitlines() if calls.exists() else []
    return done.returncode, done.stdout, made, run.read_status()


@pytest.mark.parametrize("ranks_exit", [2, 127])   # a config error; a python not found
def test_ranks_that_end_before_writing_a_state_are_not_requeued(tmp_path, ranks_exit):
    """Whatever stops the ranks before train() writes "running" (the rank's command line,
    imports, the interpreter): the script itself turned the previous "interrupted" into
    "running" before the launch, so the job ends failed instead of requeuing itself up to
    --max-requeues times."""
    rc, out, calls, status = _start_to_end(tmp_path, ranks_exit)
    assert status == {"state": "running", "step": 7}
    assert rc == 1 and calls == []
    assert "run state running after restart 1" in out and "not requeued" in out
