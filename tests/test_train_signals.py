"""Stopping cleanly: SIGUSR1 / SIGTERM on ONE rank makes every rank checkpoint at the same
step and leave; the run then resumes to the uninterrupted losses. A non-finite loss stops
the run with exit code 3 before the update, leaving the last checkpoint intact."""

import json
import os
import signal
import subprocess
import time

import pytest
from train_helpers import (
    ROOT,
    child_env,
    run_train,
    step_losses,
    tiny_config,
    torchrun_exit_codes,
    train_cmd,
)

from train.checkpoint import find_latest

pytestmark = pytest.mark.slow


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


# RMT with BPTT, ZeRO-2, 2 ranks: the run the signals stop and resume. Long enough for two
# stops: a signal lands within a few steps of being sent.
STEPS = 40
SIGNALLED = dict(max_steps=STEPS, model={"mechanism": "rmt", "mem_len": 4,
                                         "rmt": {"num_mem_tokens": 3}},
                 bptt={"depth": 1}, deepspeed={"zero_stage": 2}, eval={"max_segments": 4},
                 tracking={})   # a signal stops MLflow's run too, and the resume reopens it


def _last_step(metrics) -> int:
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    return max((json.loads(line).get("step", 0) for line in lines), default=0)


def _stopped_by_a_signal_on_one_rank(cfg, run_dir, sig, after_step: int) -> int:
    """Start (or resume) the run on 2 ranks, send `sig` to one rank once `after_step` is
    logged; the run must leave with every rank checkpointed at one step: that step."""
    proc = subprocess.Popen(train_cmd(cfg, nproc=2), cwd=ROOT, env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    metrics = run_dir / "metrics.jsonl"
    # A guard against a hung run only: the run ends by itself if it fails, and 2 ranks
    # starting beside a busy suite have taken 4 minutes to reach their first step.
    deadline = time.time() + 900
    while time.time() < deadline and proc.poll() is None and _last_step(metrics) < after_step:
        time.sleep(0.1)
    assert _last_step(metrics) >= after_step, f"the run never reached step {after_step}"
    ranks = _children(proc.pid)
    assert len(ranks) == 2, f"expected 2 rank processes under the launcher, found {ranks}"
    os.kill(max(ranks), sig)  # one rank only: the other must learn of it and agree
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "interrupted" and after_step <= status["step"] < STEPS, status
    info = find_latest(run_dir / "checkpoints")
    assert info.step == status["step"] and info.world_size == 2
    assert f"checkpointed at step {status['step']}" in out
    return status["step"]


def test_usr1_then_sigterm_on_one_rank_checkpoint_every_rank_at_one_step_and_resume_exactly(
        tmp_path):
    # One run, stopped twice: by SIGUSR1 (what SLURM sends before the time limit), then,
    # resumed, by SIGTERM (what a cancelled job gets); resumed again to the end, its losses
    # are the uninterrupted run's, bit for bit.
    straight = tiny_config(tmp_path, "straight", **SIGNALLED)
    run_train(straight, nproc=2)
    cfg = tiny_config(tmp_path, "signalled", **SIGNALLED)
    run_dir = tmp_path / "runs" / "signalled"
    first = _stopped_by_a_signal_on_one_rank(cfg, run_dir, signal.SIGUSR1, after_step=5)
    run_id = json.loads((run_dir / "tracking.json").read_text())["run_id"]
    _stopped_by_a_signal_on_one_rank(cfg, run_dir, signal.SIGTERM, after_step=first + 3)
    run_train(cfg, nproc=2)
    assert json.loads((run_dir / "status.json").read_text())["state"] == "finished"
    assert step_losses(run_dir) == step_losses(tmp_path / "runs" / "straight")
    # Each resume went on in the MLflow run the first launch opened.
    assert json.loads((run_dir / "tracking.json").read_text())["run_id"] == run_id


def test_a_non_finite_loss_stops_every_rank_with_exit_3_and_keeps_the_last_checkpoint(
        tmp_path):
    # An absurd learning rate: Adam moves every weight by ~1e12 at step 1, so the loss of
    # step 2 overflows. Nothing of step 2 may be saved.
    cfg = tiny_config(tmp_path, "diverged", max_steps=10, save_every=1,
                      optim={"lr": 1e12, "schedule": "constant"}, model={"dropout": 0.0})
    run_dir = tmp_path / "runs" / "diverged"
    done = run_train(cfg, nproc=2, launcher="torchrun", check=False)
    assert done.returncode != 0  # torchrun's own code is 1 whatever the ranks returned
    root, codes = torchrun_exit_codes(done.stderr)
    assert root == 3 and set(codes.values()) <= {3, -15}, codes
    assert "non-finite loss at step 2 on 2 rank(s)" in done.stderr
    assert "the last checkpoint is intact" in done.stderr
    assert find_latest(run_dir / "checkpoints").step == 1
    assert not (run_dir / "checkpoints" / "step00000002").exists()
    assert json.loads((run_dir / "status.json").read_text())["state"] == "failed"
