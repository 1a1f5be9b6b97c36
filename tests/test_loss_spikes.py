"""A single step gone wrong is visible: the training log and MLflow record, beside the mean
loss of each logging interval, the largest loss of one optimizer step in it (`loss_max`),
for every mechanism (train/loop.py); the progress line names it when it stands out."""

import pytest
import torch

from model import build_model
from train.bptt import StreamWindows, TrainState
from train.config import from_dict
from train.loop import LoopParts, TrainingLoop


class _Recorder:
    def __init__(self):
        self.rows = []

    def log_metrics(self, metrics, step):
        self.rows.append((step, dict(metrics)))


def _loop(per_step: list[float], log_every: int, grad_accum: int = 1) -> TrainingLoop:
    """A loop whose micro-steps report scripted sums: per optimizer step a loss per token
    (10 tokens on its reading micro-step), and a stop flag after the last one."""
    cfg = from_dict({"model": {"vocab_size": 16, "n_layer": 1, "d_model": 16, "n_head": 2,
                               "d_inner": 32, "tgt_len": 4, "mem_len": 4},
                     "data": {"path": "unused", "global_batch": 2},
                     "deepspeed": {"grad_accum": grad_accum},
                     "log_every": log_every, "max_steps": 1000})
    env = type("Env", (), {"is_main": True, "rank": 0, "world_size": 1})()
    schedule = type("Schedule", (), {"get_last_lr": lambda self: [1e-3]})()
    curriculum = type("Curriculum", (), {"metrics": lambda self: {},
                                         "after_step": lambda self, step: None})()
    engine = type("Engine", (), {"module": build_model(cfg.model),
                                 "train": lambda self: None})()
    loop = TrainingLoop(LoopParts(
        cfg=cfg, engine=engine, state=TrainState(plan=StreamWindows(cfg.bptt)),
        device=torch.device("cpu"), stage=0, env=env, schedule=schedule,
        tracker=_Recorder(), curriculum=curriculum,
        signals=type("NoSignal", (), {"received": None})()))
    script = []
    for i, loss in enumerate(per_step):
        # the sums arrive with the step's last micro-step (the one that reads the flags)
        script += [(0.0, 0.0, False, 0)] * (grad_accum - 1)
        script.append((loss * 10, 10.0, i == len(per_step) - 1, 10))
    moves = iter(script)
    loop._micro_step = lambda batches: next(moves)
    loop.save = lambda: None
    loop.stream = iter(())
    return loop


@pytest.mark.parametrize("grad_accum", [1, 3])
def test_loss_max_is_the_largest_single_step_of_each_logging_interval(grad_accum, capsys):
    losses = [2.0, 3.0, 1000.0, 2.0, 2.0, 2.5, 2.0, 2.0]
    loop = _loop(losses, log_every=4, grad_accum=grad_accum)
    assert loop.run() == "interrupted"          # the scripted stop after step 8
    logged = {step: m for step, m in loop.tracker.rows}
    assert logged[4]["loss"] == pytest.approx(sum(losses[:4]) / 4)
    assert logged[4]["loss_max"] == pytest.approx(1000.0)
    assert logged[8]["loss_max"] == pytest.approx(2.5)     # a new interval forgets the spike
    first, second = [line for line in capsys.readouterr().out.splitlines()
                     if line.startswith("step ")]
    assert "(max step 1000.0000)" in first and "max step" not in second


def test_a_quiet_interval_logs_its_largest_step_too():
    loop = _loop([2.0, 2.2, 2.1], log_every=3)
    loop.run()
    (step, metrics), = loop.tracker.rows
    assert step == 3 and metrics["loss_max"] == pytest.approx(2.2)


def test_an_auxiliary_loss_term_shows_in_the_progress_line(capsys):
    from train.progress import Progress
    base = {"loss": 2.5, "lr": 1e-3, "tokens_per_s": 100.0, "peak_mem_mb": 10.0}
    progress = Progress(10, 0, enabled=True)
    progress.update(1, {**base, "aux_loss": 0.0123})
    progress.update(2, base)
    first, second = capsys.readouterr().out.splitlines()
    assert "| aux 0.0123 | peak" in first and "aux" not in second
