"""model.compile in bf16 and under ZeRO-3 (the rest of the compile tests, and why they
compile one shape: tests/test_compile.py). A file of its own so that the suite's two workers
(`--dist loadfile`, docs/testing.md) share the compile tests: these compile graphs of their
own (bf16 kernels; ZeRO-3's graph pieces between its per-module hooks), none of which
tests/test_compile.py's runs put in the Inductor cache, so the split compiles nothing twice."""

from __future__ import annotations

import pytest
import torch
from compile_helpers import MEM, RUN_MODEL, batch, tiny
from train_helpers import run_train, step_losses, tiny_config

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("mechanism", ["xl", "lamemo", "rmt", "armt"])
def test_a_bf16_model_compiles_and_trains_like_eager_bf16(mechanism):
    # The A100 precision (DeepSpeed casts the model to bf16; the bare model here, the engine
    # in bf16 is tests/test_bf16_engine.py). Fused kernels round differently: bf16 tolerance. No
    # dropout: eager bf16 dropout scales by 1/(1-p) rounded to bf16, a fused kernel by the
    # fp32 value (0.2% apart at p = 0.1), a difference of rounding, not of the model. One
    # graph: a segment without gradient (eager) fills the memory, so every training step
    # reads a full one, the path where the mechanisms differ. Inductor builds LaMemo and
    # ARMT, whose ops hold XL's and RMT's (relative attention; memory rows); XL and RMT run
    # their traced bf16 graphs on eager kernels (XL's fp32 Inductor build is
    # tests/test_compile.py's), two cold Inductor builds fewer.
    backend = "inductor" if mechanism in ("lamemo", "armt") else "aot_eager"
    models = []
    for compiled in (False, True):
        model, _, data = tiny(mechanism, MEM, compiled, backend=backend, dropout=0.0,
                              dropatt=0.0)
        models.append((model.to(torch.bfloat16), data))
    losses: list[list[float]] = [[], []]
    states = []
    for model, data in models:
        with torch.no_grad():
            states.append(model(batch(data)[0], None).state)
    for _ in range(3):
        for i, (model, data) in enumerate(models):
            x, y = batch(data)
            out = model(x, states[i], targets=y)
            out.loss.backward()
            states[i] = out.state.detach()
            losses[i].append(out.loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=2e-3)
    # A parameter outside the loss's graph (ARMT's write of a window's last segment only
    # reaches the next window) keeps grad None in eager and gets zeros from a compiled
    # graph: both are a zero gradient.
    grads = [torch.cat([torch.zeros(p.numel()) if p.grad is None else p.grad.float().flatten()
                        for p in m.parameters()]) for m, _ in models]
    assert (grads[1] - grads[0]).norm() < 0.03 * grads[0].norm()


def test_compiled_zero3_trains_bptt_windows_with_the_eager_losses_and_warns(tmp_path):
    # ZeRO-3 gathers each module's parameters in hooks on that module, which break the
    # compiled graph at every module (the run says so). What must hold: a BPTT window (every
    # parameter used in 3 segments of one backward) trains exactly as eager. Making the
    # decoder stack a ZeRO-3 leaf (gathered once, 2 graphs) failed here: DeepSpeed's
    # gradient bucket met the same parameter twice. What ZeRO-3 changes is where the graphs
    # break and what runs between them, decided before any kernel is generated: the graphs
    # run on eager kernels (model.compile_backend: aot_eager), as Inductor would build ~30
    # graph pieces of its own for this test alone; Inductor's kernels train each mechanism
    # like eager in tests/test_compile.py.
    sections = dict(max_steps=3, deepspeed={"zero_stage": 3}, bptt={"depth": 2},
                    eval={"max_segments": 2, "every": 0})
    run_train(tiny_config(tmp_path, "eager", model=RUN_MODEL, **sections), launcher="single")
    compiled_model = {**RUN_MODEL, "compile": True, "compile_backend": "aot_eager"}
    done = run_train(tiny_config(tmp_path, "compiled", model=compiled_model, **sections),
                     launcher="single")
    assert "model.compile under ZeRO-3" in done.stderr
    eager = step_losses(tmp_path / "runs" / "eager")
    compiled = step_losses(tmp_path / "runs" / "compiled")
    assert [compiled[s] for s in range(1, 4)] == pytest.approx(
        [eager[s] for s in range(1, 4)], rel=1e-5, abs=1e-6)
