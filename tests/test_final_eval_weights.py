"""Which weights a run's evaluations score (train/master_weights.py). A bf16 run holds a bf16
training copy in the engine's module and fp32 master weights in DeepSpeed's optimizer: its
validations score the training copy and say so, its final report (`[final step N]`,
eval_report.json) scores the fp32 master weights and says so, and that number is the one
`memtrain eval` gives for the last checkpoint (its consolidated fp32 weights, the exported
ones), not the training copy's. An fp32 run is scored as before, its protocol saying fp32.

Each run is `train.trainer.train` in this process (a world of one over gloo; bf16 runs on
DeepSpeed's CPU accelerator), 12 steps of the tiny config at lr 0.01 so that the master
weights move off the bf16 grid."""

from __future__ import annotations

import json

import pytest
import torch
from train_helpers import tiny_config, train_in_process

from evaluation.cli import run_eval
from train import trainer
from train.config import load_config
from train.evaluate import EvalProtocol, evaluate, protocol_for
from train.loop import TrainingLoop
from train.master_weights import master_state, scored_weights

TRAINING_COPY = "weights bf16 (training copy)"
MASTER = "weights fp32 (master copy)"


def _train(tmp_path, monkeypatch, capsys, overrides):
    """Train in this process; returns (cfg, stdout, eval_report.json, seen): seen holds the
    engine's own loss on the final protocol, its master_state and module parameters at the
    end, and the params given to the tracker."""
    seen = {}

    class Recording(TrainingLoop):
        def final_reports(self):
            super().final_reports()
            proto = protocol_for(self.cfg)
            seen["engine_loss"] = evaluate(self.engine, self.engine.module, self.manifest,
                                           proto, 0, 1, self.device)["loss"]
            seen["master"] = master_state(self.engine)
            seen["module"] = {n: p.detach().clone()
                              for n, p in self.engine.module.named_parameters()}

    monkeypatch.setattr(trainer, "TrainingLoop", Recording)
    tracker = trainer.Tracker

    def recording_tracker(*args, **kwargs):
        seen["params"] = kwargs["params"]      # what MLflow gets as the run's params
        return tracker(*args, **kwargs)

    monkeypatch.setattr(trainer, "Tracker", recording_tracker)
    cfg = load_config(tiny_config(tmp_path), ["eval.every=6", "optim.lr=0.01",
                                              "tracking.enabled=false", *overrides])
    train_in_process(cfg, monkeypatch)
    report = json.loads((cfg.resolved_run_dir / "eval_report.json").read_text())
    return cfg, capsys.readouterr().out, report, seen


def _memtrain_eval(cfg) -> dict:
    """`memtrain eval` of the run's last checkpoint (its fp32 weights consolidated into a
    plain model: the exported weights), on the final protocol."""
    return run_eval(cfg, None, track=False)


def _line(out: str, prefix: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(prefix))


def test_the_protocol_text_names_the_weights_it_scored():
    proto = EvalProtocol("valid", 8, 8, -1, False, 4, 0, 10, weights="bf16 (training copy)")
    assert proto.describe().endswith(", 10 segments per row, weights bf16 (training copy)")
    assert "weights" not in EvalProtocol("valid", 8, 8, -1, False, 4, 0, 10).describe()
    assert [scored_weights(p, final) for p in ("fp32", "bf16") for final in (False, True)] \
        == ["fp32", "fp32", "bf16 (training copy)", "fp32 (master copy)"]


@pytest.mark.parametrize("stage", [1, 3])
def test_a_bf16_runs_final_report_scores_the_fp32_master_weights(tmp_path, monkeypatch,
                                                                  capsys, stage):
    """ZeRO-1: DeepSpeed's bf16 optimizer; ZeRO-3: its partitioned stage-3 optimizer."""
    cfg, out, report, seen = _train(tmp_path, monkeypatch, capsys,
                                    ["deepspeed.precision=bf16",
                                     f"deepspeed.zero_stage={stage}"])
    assert _line(out, "[valid step 6]").endswith(f"{TRAINING_COPY}]")
    assert _line(out, "[final step 12]").endswith(f"{MASTER}]")
    main = report["main"]
    assert main["protocol"]["weights"] == "fp32 (master copy)"
    assert seen["params"]["valid_protocol"]["weights"] == "bf16 (training copy)"
    assert seen["params"]["final_protocol"] == main["protocol"]
    assert main["protocol_text"].endswith(MASTER)
    # `memtrain eval` of the checkpoint (the exported fp32 weights) scores the same weights
    # under the same protocol and gets the same loss; the bf16 training copy another one.
    evaluated = _memtrain_eval(cfg)
    assert evaluated["protocol"] == main["protocol"]
    assert main["loss"] == pytest.approx(evaluated["loss"], rel=1e-6, abs=1e-7)
    assert abs(seen["engine_loss"] - evaluated["loss"]) > 1e-5
    assert abs(seen["engine_loss"] - evaluated["loss"]) > \
        100 * abs(main["loss"] - evaluated["loss"])


def test_without_zero_the_master_copy_is_the_one_the_training_copy_is_rounded_from(
        tmp_path, monkeypatch, capsys):
    """bf16 at ZeRO-0 (gradients summed in bf16): DeepSpeed's FP16 optimizer wrapper keeps
    the fp32 copies; every bf16 weight is its master rounded, and the masters are off the
    bf16 grid (else the two copies would be one model)."""
    cfg, out, report, seen = _train(tmp_path, monkeypatch, capsys,
                                    ["deepspeed.precision=bf16", "deepspeed.zero_stage=0",
                                     "deepspeed.grad_dtype=half"])
    assert report["main"]["protocol_text"].endswith(MASTER)
    # The checkpoint's module file holds the training copy, and `memtrain eval` says so.
    assert _memtrain_eval(cfg)["protocol_text"].endswith(TRAINING_COPY)
    master, module = seen["master"], seen["module"]
    assert master.keys() == module.keys()
    for name, weight in module.items():
        assert master[name].dtype == torch.float32 and weight.dtype == torch.bfloat16
        assert torch.equal(master[name].to(torch.bfloat16), weight), name
    assert any(not torch.equal(master[n], module[n].float()) for n in module)
    assert report["main"]["loss"] != seen["engine_loss"]


def test_an_fp32_runs_evaluations_score_the_engine_and_say_fp32(tmp_path, monkeypatch, capsys):
    cfg, out, report, seen = _train(tmp_path, monkeypatch, capsys, [])
    assert _line(out, "[valid step 6]").endswith("weights fp32]")
    assert report["main"]["protocol_text"].endswith("weights fp32")
    assert report["main"]["loss"] == seen["engine_loss"]
    assert _memtrain_eval(cfg)["protocol"] == report["main"]["protocol"]
    assert seen["params"]["valid_protocol"]["weights"] == "fp32"
