"""fp16 (V100) non-finite losses: the step is skipped by DeepSpeed's loss scaling, and the
memory that window produced must not be carried on; a run of them stops the run clearly.

The training loop's micro-step runs here on one process with the bare model behind a fake
engine, and behind DeepSpeed's own fp16 optimizer object (ScalingEngine: its loss scaler
skips the overflowed update and changes the scale; what is tested is what the loop carries
around it)."""

import math
import os
import warnings

import pytest
import torch

from data_pipeline.streams import SegmentBatch
from model import build_model
from train.bptt import StreamWindows, TrainState
from train.config import ConfigError, from_dict
from train.loop import LoopParts, NonFiniteLoss, TrainingLoop

B, L, V = 2, 4, 16


class FakeEngine:
    """The model behind the engine interface the loop uses. Forward calls listed in `poison`
    (1-based) return an infinite NLL and a NaN memory, as an fp16 overflow would."""

    def __init__(self, model, poison=()):
        self.module, self.poison = model, set(poison)
        self.calls = 0
        self.entering = []       # the memory entering each forward
        self.steps = 0

    def __call__(self, tokens, state, **kw):
        self.calls += 1
        self.entering.append(state)
        out = self.module(tokens, state, **kw)
        if self.calls in self.poison:
            out.nll = out.nll + float("inf")
            out.state = out.state._map(lambda _, t: t.float().fill_(float("nan"))
                                       if t.is_floating_point() else t)
        return out

    def backward(self, loss):
        pass

    def step(self):
        self.steps += 1          # DeepSpeed would skip the update on overflow

    def is_gradient_accumulation_boundary(self):
        return True


def make_loop(poison=(), mode="window", depth=0, limit=10, precision="fp16"):
    cfg = from_dict({
        "model": {"mechanism": "xl", "vocab_size": V, "n_layer": 2, "d_model": 16,
                  "n_head": 2, "d_inner": 32, "tgt_len": L, "mem_len": 4, "dropout": 0.0},
        "data": {"path": "unused", "global_batch": B},
        "bptt": {"mode": mode, "depth": depth},
        "optim": {"max_nonfinite_steps": limit}, "deepspeed": {"precision": precision},
        "log_every": 1000, "max_steps": 1000})
    torch.manual_seed(0)
    engine = FakeEngine(build_model(cfg.model).eval(), poison)
    # Only what _micro_step reads: no stream, tracker or checkpoints.
    return TrainingLoop(LoopParts(
        cfg=cfg, engine=engine, state=TrainState(plan=StreamWindows(cfg.bptt)),
        device=torch.device("cpu"), stage=1,
        signals=type("NoSignal", (), {"received": None})()))


def batches():
    g = torch.Generator().manual_seed(1)
    t = 0
    while True:
        yield SegmentBatch(torch.randint(0, V, (B, L + 1), generator=g),
                           torch.full((B,), t == 0), None, 0, t)
        t += 1


def finite_memory(state) -> bool:
    return all(torch.isfinite(h).all() for h in state.hids)


def test_a_non_finite_window_resets_the_memory_and_training_continues():
    loop = make_loop(poison={3})
    data = batches()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(6):
            nll, n, _, _ = loop._micro_step(data)
            loop.state.step += 1
            assert math.isfinite(nll) == (step != 2), step
    assert [str(w.message) for w in caught if "non-finite" in str(w.message)] == [
        "non-finite loss at step 3 on 1 rank(s) (1 in a row; the run stops at 10): fp16 "
        "loss scaling skips this step and every row's memory is reset"]
    entering = loop.engine.entering
    assert entering[3] is None                 # the window after the bad one starts afresh
    assert finite_memory(entering[4]) and finite_memory(loop.state.memory)
    assert loop.state.nonfinite_in_a_row == 0 and loop.engine.steps == 6


def test_the_sliding_history_of_a_non_finite_window_is_dropped():
    loop = make_loop(poison={5}, mode="sliding", depth=2)   # window 3 = calls 4, 5, 6
    data = batches()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            loop._micro_step(data)
            loop.state.step += 1
    assert loop.state.memory is None and len(loop.state.plan.history.items) == 0
    loop._micro_step(data)                    # a 1-segment window from fresh memory
    assert loop.engine.entering[-1] is None and loop.engine.calls == 7
    assert finite_memory(loop.state.memory) and len(loop.state.plan.history.items) == 1


def test_n_non_finite_windows_in_a_row_stop_with_a_clear_error():
    loop = make_loop(poison=set(range(2, 100)), limit=4)
    data = batches()
    loop._micro_step(data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            loop.state.step += 1
            loop._micro_step(data)
        assert loop.state.nonfinite_in_a_row == 3
        loop.state.step += 1
        with pytest.raises(NonFiniteLoss, match=r"4 non-finite losses in a row under fp16 "
                           r"loss scaling \(the last at step 5\).*optim.max_nonfinite_steps"):
            loop._micro_step(data)
    assert loop.engine.steps == 4              # stopped before the 5th update


def test_a_finite_window_between_bad_ones_restarts_the_count():
    loop = make_loop(poison={2, 3, 5, 6}, limit=3)
    data = batches()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(7):
            loop._micro_step(data)
            loop.state.step += 1
    assert loop.state.nonfinite_in_a_row == 0


def test_fp32_still_stops_at_the_first_non_finite_loss():
    loop = make_loop(poison={2}, precision="fp32")
    data = batches()
    loop._micro_step(data)
    with pytest.raises(NonFiniteLoss, match="non-finite loss at step 1 on 1 rank"):
        loop._micro_step(data)


def test_max_nonfinite_steps_must_be_positive():
    with pytest.raises(ConfigError, match="optim.max_nonfinite_steps"):
        make_loop(limit=0)


def test_gradients_overflowing_at_deepspeeds_minimum_loss_scale_stop_with_a_clear_error():
    """A finite loss whose gradients overflow fp16: DeepSpeed's own scaler (the real class,
    at its minimum scale) raises a bare Exception from engine.step(); the loop names it."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    scaler = DynamicLossScaler(init_scale=1, scale_window=1000, min_scale=1, delayed_shift=1,
                               consecutive_hysteresis=False)
    loop = make_loop()
    loop.engine.step = lambda: scaler.update_scale(overflow=True)
    with pytest.raises(NonFiniteLoss, match=r"fp16 gradients overflowed at DeepSpeed's "
                       r"minimum loss scale at step 1 .*min_loss_scale.*last checkpoint is "
                       r"intact") as caught:
        loop._micro_step(batches())
    assert "loss scale already at minimum" in str(caught.value.__cause__)


def test_other_errors_of_the_engine_step_pass_through_unchanged():
    loop = make_loop()

    def broken():
        raise RuntimeError("NCCL timeout")
    loop.engine.step = broken
    with pytest.raises(RuntimeError, match="NCCL timeout"):
        loop._micro_step(batches())


@pytest.fixture(scope="module")
def one_rank_group():
    """A 1-rank gloo group for DeepSpeed's comm layer (its fp16 optimizer asks for the rank
    and all-reduces its overflow flag), torn down after the module."""
    import deepspeed
    import torch.distributed as dist
    from train_helpers import child_env, free_port

    from train.deepspeed_setup import use_environments_ninja

    saved = dict(os.environ)
    # The launches' op folder (the checkout's prebuilt one) and ninja, as every run uses:
    # DeepSpeed's default folder would cost this worker a build of its op of its own.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", child_env()["TORCH_EXTENSIONS_DIR"])
    use_environments_ninja()
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                       "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
    try:
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False,
                                   verbose=False)
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)


class ScalingEngine(FakeEngine):
    """FakeEngine with DeepSpeed's own fp16 optimizer behind backward() and step(): dynamic
    loss scaling over fp32 master weights of an fp16 model (FP16_UnfusedOptimizer, the
    wrapper DeepSpeed's engine builds for fp16 without ZeRO; its engine refuses fp16 on the
    CPU accelerator, the optimizer object itself runs). Scale window 2, factor 2."""

    def __init__(self, model, poison=()):
        from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
        super().__init__(model.half(), poison)
        self.optimizer = FP16_UnfusedOptimizer(
            torch.optim.Adam(model.parameters(), lr=1e-3), dynamic_loss_scale=True,
            dynamic_loss_args={"init_scale": 2.0 ** 8, "scale_window": 2, "min_scale": 1,
                               "delayed_shift": 1}, verbose=False)
        self.scales, self.updated = [], []

    def __call__(self, tokens, state, **kw):
        out = super().__call__(tokens, state, **kw)
        if self.calls in self.poison:   # an overflow reaches the gradients, not only the loss
            out.nll = out.nll * float("inf")
        return out

    def backward(self, loss):
        self.optimizer.backward(loss)

    def step(self):
        before = [p.detach().clone() for p in self.module.parameters()]
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.steps += 1
        self.scales.append(self.optimizer.loss_scale)
        self.updated.append(any(not torch.equal(a, p) for a, p in
                                zip(before, self.module.parameters(), strict=True)))


def test_deepspeeds_fp16_optimizer_skips_the_overflowed_step_halves_the_scale_and_the_loop_resets_the_memory(  # noqa: E501
        one_rank_group):
    loop = make_loop(poison={3, 4}, limit=3)
    loop.engine = ScalingEngine(loop.engine.module, poison={3, 4})
    data = batches()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(8):
            loop._micro_step(data)
            loop.state.step += 1
    engine = loop.engine
    # Windows 3 and 4 overflowed: no update, the scale halved each time; after 2 clean
    # steps (the window) it doubles again.
    assert engine.updated == [True, True, False, False, True, True, True, True]
    assert engine.scales[:4] == [256, 256, 128, 64] and engine.scales[-1] > 64, engine.scales
    # The loop carried no memory out of an overflowed window, and its count restarted.
    assert engine.entering[3] is None and engine.entering[4] is None
    assert finite_memory(engine.entering[5]) and loop.state.nonfinite_in_a_row == 0
    # max_nonfinite_steps counts the skipped steps the same way under the real scaler.
    loop = make_loop(poison=set(range(1, 100)), limit=3)
    loop.engine = ScalingEngine(loop.engine.module, poison=set(range(1, 100)))
    with warnings.catch_warnings(), pytest.raises(NonFiniteLoss, match="3 non-finite"):
        warnings.simplefilter("ignore")
        for _ in range(3):
            loop._micro_step(data)
            loop.state.step += 1
    assert loop.engine.updated == [False, False] and loop.engine.scales == [128, 64]
