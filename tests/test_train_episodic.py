"""Episodic training (the RMT algorithmic tasks) through the engine: fresh memory per
sample, BPTT through the sample, the answer accuracy of the trained weights reported, and
the plateau schedule halving the lr after `plateau_patience` validations without
improvement."""

import json
import subprocess

import numpy as np
import pytest
import torch
from daemons import run_ok
from train_helpers import BIN, ROOT, child_env, run_train, step_losses, tiny_config

from data_pipeline.shards import load_manifest, read_episodes
from data_pipeline.tasks import TaskData, accuracy, make_task
from model import load_model

pytestmark = pytest.mark.slow


def _copy_accuracy_of_exported_model(run_dir, data) -> float:
    """Teacher-forced answer accuracy of the exported weights on the whole test split,
    computed apart from the engine: the plain model, fresh memory per sample, scored by the
    task's own metric (data_pipeline.tasks.accuracy over the answer mask)."""
    model = load_model(run_dir / "model.safetensors").eval()
    tokens, loss_mask, answer_mask = read_episodes(load_manifest(data), "test")
    x = torch.from_numpy(tokens.astype(np.int64))
    preds, state = [], None
    with torch.no_grad():
        for s in range(3):
            seg = x[:, s * 6:s * 6 + 7]
            out = model(seg[:, :-1], state, targets=seg[:, 1:], return_log_probs=True)
            preds.append(out.log_probs.argmax(-1))
            state = out.state
    return accuracy(make_task("copy", src_len=6, n_segments=3), torch.cat(preds, 1).numpy(),
                    TaskData(tokens, loss_mask, answer_mask))


def test_copy_task_trains_with_full_bptt_reports_its_accuracy_and_the_plateau_halves_lr(
        tmp_path):
    data = tmp_path / "copy6"
    done = subprocess.run([str(BIN / "memtrain"), "tasks", "copy", "--src-len", "6",
                           "--n-segments", "3", "--out", str(data), "--train-size", "256",
                           "--valid-size", "64", "--test-size", "64"], cwd=ROOT,
                          env=child_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lr = 1e-2
    cfg = tiny_config(tmp_path, "copy", max_steps=8,
                      model={"mechanism": "rmt", "vocab_size": 10, "tgt_len": 6, "mem_len": 0,
                             "rmt": {"num_mem_tokens": 4}},
                      data={"path": str(data), "global_batch": 8},
                      bptt={"depth": 2, "checkpoint_segments": True},
                      optim={"schedule": "plateau", "plateau_patience": 1,
                             "plateau_factor": 0.5, "lr": lr},
                      eval={"every": 1, "split": "test", "batch": 8, "max_segments": 0})
    # Validations after steps 1..7 (none at the last step). With patience 1 the lr halves at
    # the SECOND validation in a row without improvement (steps 4 and 7), not the first.
    valid = [2.0, 1.5, 1.6, 1.7, 1.4, 1.45, 1.5]
    done = subprocess.run([str(BIN / "python"), str(ROOT / "tests" / "scripted_validation.py"),
                           json.dumps(valid), "--config", str(cfg)], cwd=ROOT,
                          env=child_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = tmp_path / "runs" / "copy"
    assert sorted(step_losses(run_dir)) == list(range(1, 9))
    # The lr logged at step s is the one the optimizer holds after step s (and uses for
    # step s+1); the schedule writes it into the param groups DeepSpeed's optimizer steps.
    lrs = step_losses(run_dir, "lr")
    assert [lrs[s] for s in range(1, 9)] == [lr] * 4 + [lr / 2] * 3 + [lr / 4]
    assert done.stdout.count("plateau: lr lowered to") == 2
    assert "[valid step 4] loss 1.7000" in done.stdout

    report = json.loads((run_dir / "eval_report.json").read_text())["main"]
    assert report["metric"] == "accuracy"
    # 64 test samples x 12 answer positions (the source copied twice).
    assert report["tokens"] == 64 * 12
    # The reported accuracy is the exported model's, to within one answer token (a logit
    # tie broken differently by another batch size).
    assert report["accuracy"] == pytest.approx(_copy_accuracy_of_exported_model(run_dir, data),
                                               abs=1.01 / (64 * 12))


def test_sliding_bptt_is_refused_on_task_data(tmp_path):
    data = tmp_path / "copy6"
    run_ok([str(BIN / "memtrain"), "tasks", "copy", "--src-len", "6", "--n-segments",
            "3", "--out", str(data), "--train-size", "64", "--valid-size", "16",
            "--test-size", "16"], cwd=ROOT, env=child_env(), timeout=120)
    cfg = tiny_config(tmp_path, "bad", model={"mechanism": "rmt", "vocab_size": 10,
                                              "tgt_len": 6, "mem_len": 0},
                      data={"path": str(data)}, bptt={"depth": 1, "mode": "sliding"})
    done = run_train(cfg, nproc=1, check=False)
    assert done.returncode != 0
    assert "bptt.mode: sliding applies to token streams" in done.stderr
