"""The segment-count curriculum runs a pretrained backbone as it runs the native models: the
stages advance at the configured steps, and a stop inside a stage resumes to the
uninterrupted losses (the curriculum's stage and the memory restored with the data cursor)."""

import pytest
from pretrained_helpers import hf_model_section, tiny_llama
from train_helpers import step_losses, train_in_process

from data_pipeline.prepare import main_tasks
from train.config import from_dict


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_curriculum")
    data = root / "copy4-s4"
    assert main_tasks(["copy", "--src-len", "4", "--n-segments", "4", "--train-size", "256",
                       "--valid-size", "32", "--test-size", "32", "--out", str(data)]) == 0
    return tiny_llama(root / "llama"), data


def _config(tmp_path, sources, name, max_steps):
    ckpt, data = sources
    return from_dict({
        "name": name, "run_dir": str(tmp_path / "runs" / name), "max_steps": max_steps,
        "log_every": 1, "save_every": 4, "threads": 1, "seed": 1,
        "model": hf_model_section(ckpt, m=3, tgt_len=3),
        "data": {"path": str(data), "global_batch": 8}, "bptt": {"depth": 3},
        "curriculum": {"segments": [1, 2, 4], "advance": "steps", "every": 3},
        "optim": {"lr": 3e-3, "schedule": "constant"}, "eval": {"every": 0, "split": "test"},
        "tracking": {"enabled": False}})


def test_a_pretrained_backbone_follows_the_curriculum_and_resumes_inside_a_stage(
        tmp_path, sources, monkeypatch):
    whole = _config(tmp_path, sources, "whole", 8)
    train_in_process(whole, monkeypatch)
    stages = step_losses(whole.resolved_run_dir, "curriculum_segments")
    assert stages == {s: (1 if s <= 3 else 2 if s <= 6 else 4) for s in range(1, 9)}

    part = _config(tmp_path, sources, "part", 4)
    train_in_process(part, monkeypatch)        # stops at step 4, in stage 2 (checkpointed)
    part.max_steps = 8
    train_in_process(part, monkeypatch)
    resumed, expected = step_losses(part.resolved_run_dir), step_losses(whole.resolved_run_dir)
    assert [resumed[s] for s in range(5, 9)] == pytest.approx(
        [expected[s] for s in range(5, 9)], rel=1e-6)
