"""Episodic training (the RMT algorithmic tasks) through the engine: fresh memory per
sample, BPTT through the sample, answer accuracy reported, plateau schedule stepping."""

import json
import subprocess

import pytest
from train_helpers import BIN, ROOT, child_env, run_train, step_losses, tiny_config

pytestmark = pytest.mark.slow


def test_copy_task_trains_with_full_bptt_and_reports_answer_accuracy(tmp_path):
    data = tmp_path / "copy6"
    done = subprocess.run([str(BIN / "memtrain"), "tasks", "copy", "--src-len", "6",
                           "--n-segments", "3", "--out", str(data), "--train-size", "256",
                           "--valid-size", "64", "--test-size", "64"], cwd=ROOT,
                          env=child_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    cfg = tiny_config(tmp_path, "copy", max_steps=8,
                      model={"mechanism": "rmt", "vocab_size": 10, "tgt_len": 6, "mem_len": 0,
                             "rmt": {"num_mem_tokens": 4}},
                      data={"path": str(data), "global_batch": 8},
                      bptt={"depth": 2, "checkpoint_segments": True},
                      optim={"schedule": "plateau", "plateau_patience": 0, "lr": 1e-3},
                      eval={"every": 2, "split": "test", "batch": 8, "max_segments": 0})
    done = run_train(cfg, nproc=1)
    run_dir = tmp_path / "runs" / "copy"
    assert sorted(step_losses(run_dir)) == list(range(1, 9))
    report = json.loads((run_dir / "eval_report.json").read_text())["main"]
    assert report["metric"] == "accuracy" and 0.0 <= report["accuracy"] <= 1.0
    # 64 test samples x 12 answer positions (the source copied twice).
    assert report["tokens"] == 64 * 12
    assert "[valid step 2] loss" in done.stdout and "accuracy" in done.stdout


def test_sliding_bptt_is_refused_on_task_data(tmp_path):
    data = tmp_path / "copy6"
    subprocess.run([str(BIN / "memtrain"), "tasks", "copy", "--src-len", "6", "--n-segments",
                    "3", "--out", str(data), "--train-size", "64", "--valid-size", "16",
                    "--test-size", "16"], cwd=ROOT, env=child_env(), check=True,
                   capture_output=True, timeout=120)
    cfg = tiny_config(tmp_path, "bad", model={"mechanism": "rmt", "vocab_size": 10,
                                              "tgt_len": 6, "mem_len": 0},
                      data={"path": str(data)}, bptt={"depth": 1, "mode": "sliding"})
    done = run_train(cfg, nproc=1, check=False)
    assert done.returncode != 0
    assert "bptt.mode: sliding applies to token streams" in done.stderr
