"""fp16 with dynamic loss scaling through DeepSpeed's real ZeRO engine, on the CPU.

DeepSpeed's CPU accelerator says it has no fp16 (`is_fp16_supported()` is None) and its
engine refuses fp16 for that answer alone: torch's CPU kernels compute in fp16. With that one
flag forced, the V100 path runs here end to end: ZeRO's fp16 optimizer with fp32 gradient
sums (train/precision.py), DeepSpeed's own dynamic loss scaler (halving the scale on every
overflow, the step skipped), checkpoints that carry the scaler, and the loop's fp16
handling around it. What a V100 adds (its fused kernels, NCCL) is not here.

Each run is `train.trainer.train` in this process (a world of one over gloo)."""

from __future__ import annotations

import json

import pytest
import torch
from deepspeed.accelerator import get_accelerator
from train_helpers import step_losses, tiny_config, train_in_process

from train import trainer
from train.config import load_config
from train.loop import TrainingLoop

pytestmark = pytest.mark.slow

# The initial loss scale 2^POWER: a scale whose scaled gradients overflow fp16 at this model
# size (DeepSpeed's default 2^16 does not, here), so that the scaler has work to do.
POWER = 20


def _train(tmp_path, monkeypatch, name, overrides):
    """Train run `name` in this process in fp16; returns (cfg, per-step records): each
    optimizer step's (loss scale after it, DeepSpeed's skipped-step count, whether any
    master weight changed)."""
    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: True)
    records = []

    class Recording(TrainingLoop):
        def _engine_step(self, step):
            before = [p.detach().clone() for p in self.engine.module.parameters()]
            super()._engine_step(step)
            if self.engine.is_gradient_accumulation_boundary():
                moved = any(not torch.equal(a, p) for a, p in
                            zip(before, self.engine.module.parameters(), strict=True))
                records.append((self.engine._get_optimizer_loss_scale(),
                                self.engine.skipped_steps, moved))

    monkeypatch.setattr(trainer, "TrainingLoop", Recording)
    cfg = load_config(tiny_config(tmp_path, name),
                      ["tracking.enabled=false", "deepspeed.precision=fp16", "eval.every=0",
                       f"deepspeed.overrides.fp16.initial_scale_power={POWER}", *overrides])
    train_in_process(cfg, monkeypatch)
    return cfg, records


@pytest.mark.parametrize("stage", [1, 2])
def test_deepspeeds_zero_fp16_engine_skips_overflowed_steps_halving_the_scale_then_trains(
        tmp_path, monkeypatch, stage):
    cfg, records = _train(tmp_path, monkeypatch, "fp16",
                          ["max_steps=12", f"deepspeed.zero_stage={stage}"])
    ds = json.loads((cfg.resolved_run_dir / "ds_config.json").read_text())
    assert ds["fp16"]["enabled"] and ds["data_types"] == {"grad_accum_dtype": "fp32"}
    # Gradients scaled by 2^20 pass fp16's 65504: DeepSpeed skips those updates and halves
    # the scale (the first overflow only uses up the config's hysteresis of 2); once the
    # gradients fit, the weights move, and a later overflow is skipped in turn.
    prev_skipped, prev_scale = 0, 2.0 ** POWER
    for scale, skipped, moved in records:
        assert moved == (skipped == prev_skipped), records   # updated exactly when not skipped
        if not moved:
            assert scale in (prev_scale, prev_scale / 2), records
        prev_skipped, prev_scale = skipped, scale
    assert [r[0] for r in records[:2]] == [2.0 ** POWER, 2.0 ** (POWER - 1)], records
    assert records[-1][1] >= 3 and sum(r[2] for r in records) >= 5, records
    losses = step_losses(cfg.resolved_run_dir)
    assert sorted(losses) == list(range(1, 13))
    assert all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    report = json.loads((cfg.resolved_run_dir / "eval_report.json").read_text())
    assert report["main"]["protocol"]["weights"] == "fp32 (master copy)"


def test_a_stopped_fp16_run_resumes_with_its_loss_scale_to_the_uninterrupted_losses(
        tmp_path, monkeypatch):
    whole, whole_records = _train(tmp_path, monkeypatch, "whole", ["max_steps=12"])
    stopped, _ = _train(tmp_path, monkeypatch, "stopped", ["max_steps=7"])
    resumed, resumed_records = _train(tmp_path, monkeypatch, "stopped", ["max_steps=12"])
    # The checkpoint carried the scaler: the resumed steps run at the uninterrupted scales
    # (a scaler restarted at 2^16 would skip steps again and change every loss after).
    assert [r[0] for r in resumed_records] == [r[0] for r in whole_records[7:]]
    assert step_losses(resumed.resolved_run_dir) == step_losses(whole.resolved_run_dir)
