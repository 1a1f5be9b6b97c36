"""RMT learns to use its memory, and the segment-count curriculum that trains it on more
segments: a short training that fails when the memory stops carrying the source, the
curriculum's stages, its checks, and its exact resume through the engine."""

import json

import numpy as np
import pytest
import torch
from train_helpers import ROOT, run_train, step_losses

from data_pipeline import tasks
from data_pipeline.prepare import main_tasks
from data_pipeline.shards import load_manifest
from data_pipeline.streams import EpisodeStream, LayoutError, SegmentBatch
from model import ConfigError, ModelConfig, build_model
from train.bptt import run_window
from train.config import load_config


def _episode_batches(data: tasks.TaskData, idx: np.ndarray, n_seg: int, seg: int):
    tokens = torch.as_tensor(data.tokens[idx])
    mask = torch.as_tensor(data.loss_mask[idx])
    return [SegmentBatch(tokens[:, s * seg:(s + 1) * seg + 1], torch.full((len(idx),), s == 0),
                         mask[:, s * seg:(s + 1) * seg], 0, 0) for s in range(n_seg)]


def train_tiny_rmt_on_copy(carry_memory: bool, steps: int = 300) -> float:
    """2-layer pre-LN RMT on copy with a 6-symbol source in 2 segments of 9, full BPTT.
    Returns the test accuracy on the 5 answer positions that only the memory can answer:
    segment 2 opens with x3..x6 x1 as inputs and must predict x4 x5 x6 x1 x2 (later
    positions can be copied from inside segment 2, measured 0.54 accuracy overall without
    memory, so they are not scored)."""
    torch.manual_seed(0)
    spec = tasks.make_task("copy", src_len=6, n_segments=2)
    train, test = tasks.generate(spec, 8000, 1), tasks.generate(spec, 500, 2)
    model = build_model(ModelConfig(mechanism="rmt", vocab_size=spec.vocab_size, n_layer=2,
                                    d_model=64, n_head=4, d_inner=128, dropout=0.0,
                                    tgt_len=9, mem_len=0, pre_lnorm=True,
                                    rmt={"num_mem_tokens": 6}))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    rng = np.random.default_rng(0)
    model.train()
    for _ in range(steps):
        segs = _episode_batches(train, rng.integers(0, 8000, 32), 2, 9)
        # No memory: segment 2 starts again from the learned initial memory, as if it were
        # a new sample (RMT's "MT" ablation: memory tokens without recurrence).
        segs[1].reset[:] = not carry_memory
        res = run_window(model, None, segs, torch.device("cpu"))
        opt.zero_grad()
        res.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        opt.step()
    model.eval()
    tokens = torch.as_tensor(test.tokens)
    with torch.no_grad():
        state = model(tokens[:, :9]).state
        out = model(tokens[:, 9:18], state if carry_memory else None, return_log_probs=True)
    hits = out.log_probs.argmax(-1)[:, :5] == tokens[:, 10:15]
    return float(hits.float().mean())


def test_tiny_rmt_learns_a_two_segment_copy_and_fails_without_its_memory():
    """Chance is 1/8. With its memory the RMT answers from segment 1's source (measured
    0.97 after 300 steps, ~15 s); with the memory reset before segment 2 it stays near
    chance."""
    with_memory = train_tiny_rmt_on_copy(carry_memory=True)
    without = train_tiny_rmt_on_copy(carry_memory=False, steps=150)
    assert with_memory > 0.8, with_memory
    assert without < 0.25, without


# ----------------------------------------------------------------------------- curriculum
@pytest.fixture(scope="module")
def copy_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("copy") / "copy4-s4"
    assert main_tasks(["copy", "--src-len", "4", "--n-segments", "4", "--train-size", "512",
                       "--valid-size", "64", "--test-size", "64", "--out", str(out)]) == 0
    return out


def test_episode_stream_cuts_the_same_samples_into_any_dividing_segment_count(copy_data):
    m = load_manifest(copy_data)
    stream = EpisodeStream(m, "train", 4, seed=0, shuffle=False)
    whole = next(iter(stream))
    stream = EpisodeStream(m, "train", 4, seed=0, shuffle=False, n_segments=2)
    halves = next(iter(stream))
    assert [s.tokens.shape[1] for s in whole] == [4] * 4 and len(halves) == 2
    joined = torch.cat([halves[0].tokens[:, :-1], halves[1].tokens], dim=1)
    assert torch.equal(joined, torch.cat([whole[0].tokens[:, :-1], whole[1].tokens[:, :-1],
                                          whole[2].tokens[:, :-1], whole[3].tokens], dim=1))
    assert halves[0].reset.all() and not halves[1].reset.any()
    with pytest.raises(LayoutError, match="cannot cut samples of 12 positions into 5 equal "
                                          "segments; segment counts that work: 1, 2, 3, 4, 6"):
        stream.set_segments(5)
    stream.set_segments(3)
    state = stream.state_dict()
    again = EpisodeStream(m, "train", 4, seed=0, shuffle=False)
    again.load_state_dict(state)
    assert again.n_segments == 3 and again.seg_len == 4


@pytest.mark.parametrize("override, field, message", [
    (["curriculum.segments=[2, 1]"], "curriculum.segments", "increasing"),
    (["curriculum.segments=[1, 2]"], "curriculum.every", "every > 0"),
    (["curriculum.segments=[1, 2]", "curriculum.advance=loss"], "curriculum.advance",
     "unknown 'loss'"),
    (["curriculum.segments=[1, 2]", "curriculum.advance=accuracy", "eval.every=0"],
     "eval.every", "periodic validation"),
])
def test_curriculum_settings_are_checked_by_name(override, field, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_config(ROOT / "configs" / "copy-rmt-cpu.yaml", override)
    assert err.value.field == field


def _curriculum_config(tmp_path, copy_data, name, **extra):
    cfg = {
        "name": name, "run_dir": str(tmp_path / "runs" / name), "max_steps": 10,
        "log_every": 1, "threads": 1, "save_every": 6,
        "model": {"mechanism": "rmt", "vocab_size": 10, "n_layer": 1, "d_model": 32,
                  "n_head": 2, "d_inner": 64, "tgt_len": 3, "mem_len": 0, "dropout": 0.1,
                  "pre_lnorm": True, "rmt": {"num_mem_tokens": 3}},
        "data": {"path": str(copy_data), "global_batch": 8},
        "bptt": {"depth": 3},
        "curriculum": {"segments": [1, 2, 4], "advance": "steps", "every": 4},
        "optim": {"lr": 3e-3, "schedule": "constant"},
        "eval": {"every": 5, "split": "test"},
        **extra,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(json.dumps(cfg))
    return path, tmp_path / "runs" / name


def test_curriculum_advances_at_fixed_steps_logs_its_stage_and_resumes_exactly(tmp_path,
                                                                               copy_data):
    """Stages 1 -> 2 -> 4 segments after steps 4 and 8, logged as curriculum_segments; a run
    stopped at step 6 (in stage 2) resumes in stage 2 and reproduces the uninterrupted
    run's losses; validation scores the stage being trained, the final evaluation the
    task's own 4 segments."""
    whole_cfg, whole_dir = _curriculum_config(tmp_path, copy_data, "whole")
    run_train(whole_cfg)
    stages = step_losses(whole_dir, "curriculum_segments")
    assert stages == {s: (1 if s <= 4 else 2 if s <= 8 else 4) for s in range(1, 11)}
    report = json.loads((whole_dir / "eval_report.json").read_text())
    assert report["main"]["tokens"] == 64 * 8  # 8 answer positions of 64 test samples

    part_cfg, part_dir = _curriculum_config(tmp_path, copy_data, "part")
    run_train(part_cfg, ["max_steps=6"])
    run_train(part_cfg)
    resumed = step_losses(part_dir)
    expected = step_losses(whole_dir)
    for step in range(7, 11):
        assert resumed[step] == pytest.approx(expected[step], rel=1e-5), step
    assert step_losses(part_dir, "curriculum_segments")[7] == 2


def test_curriculum_must_end_at_the_tasks_segment_count(tmp_path, copy_data):
    cfg, _ = _curriculum_config(tmp_path, copy_data, "bad",
                                curriculum={"segments": [1, 2], "every": 4})
    done = run_train(cfg, launcher="single", check=False)
    assert done.returncode == 2
    assert "curriculum.segments: must end at the task's 4 segments" in done.stderr
