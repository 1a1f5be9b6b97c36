"""model.compile: the compiled training forward is the eager one, faster or not.

Compiled training draws the same dropout masks as eager (torch's generator, in order), so
its losses equal eager's to float tolerance; it compiles one graph per memory length and
then none; evaluation stays eager; and a compiled run resumes exactly. Compiling costs
seconds per graph on this CPU, so the models are tiny and the runs short.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from train_helpers import run_train, step_losses, tiny_config

from model import ConfigError, ModelConfig, build_model
from model.compiled import compile_core, compiled_graphs, graph_breaks
from train.config import load_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_memory_plan  # noqa: E402  (its window measurement: allocator peak)

pytestmark = pytest.mark.slow

TGT, MEM, STEPS = 8, 16, 5


def _tiny(mechanism: str, mem_len: int, compiled: bool, device: str = "cpu", **extra):
    """A tiny model from seed 0 with dropout, its Adam and a seeded data generator."""
    torch.manual_seed(0)
    kw = dict(mechanism=mechanism, vocab_size=32, n_layer=2, d_model=32, n_head=2,
              d_inner=64, dropout=0.1, tgt_len=TGT, mem_len=mem_len, rmt={"num_mem_tokens": 2})
    cfg = ModelConfig(**{**kw, **extra})
    model = build_model(cfg).to(device)   # torch.manual_seed seeded the GPUs' generators too
    if compiled:
        compile_core(model)
    return model, torch.optim.Adam(model.parameters(), 1e-3), torch.Generator().manual_seed(3)


def _train(mechanism: str, compiled: bool, mem_len: int = MEM, steps: int = STEPS,
           device: str = "cpu", **extra):
    """Training steps of a tiny model (dropatt 0.1 unless `extra` says otherwise): (losses,
    graphs compiled by the end of each step, counted from the first, model)."""
    model, opt, data = _tiny(mechanism, mem_len, compiled, device, **{"dropatt": 0.1, **extra})
    state, losses, graphs, before = None, [], [], compiled_graphs()
    for _ in range(steps):
        x, y = torch.randint(0, 32, (2, 4, TGT), generator=data).to(device)
        out = model(x, state, targets=y)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        state = out.state.detach()
        losses.append(out.loss.item())
        graphs.append(compiled_graphs() - before)
    return losses, graphs, model


@pytest.fixture(scope="module")
def runs():
    out = {}
    for mechanism in ("xl", "lamemo", "rmt"):
        eager, _, _ = _train(mechanism, False)
        breaks = graph_breaks()
        losses, graphs, model = _train(mechanism, True)
        out[mechanism] = (eager, losses, graphs, model, graph_breaks() - breaks)
    return out


@pytest.mark.parametrize("mechanism", ["xl", "lamemo", "rmt"])
def test_compiled_training_has_the_eager_losses_dropout_included(runs, mechanism):
    eager, compiled, *_ = runs[mechanism]
    assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-6)
    # Not trivially equal: the losses move (training happens, dropout differs per step).
    assert len(set(eager)) == STEPS


def test_a_memory_growing_to_mem_len_compiles_one_graph_per_length_then_none(runs):
    # XL's memory is 0, 8, 16 long at steps 1-3 and 16 from then on: 1 + MEM / TGT graphs,
    # the last two steps reuse the last one.
    graphs = runs["xl"][2]
    assert graphs == [1, 2, 3, 3, 3]
    # LaMemo's memory grows the same way; RMT's cache too (it ends at the same steps).
    assert runs["lamemo"][2][-1] == runs["lamemo"][2][-3] <= 1 + MEM // TGT
    assert runs["rmt"][2][-1] == runs["rmt"][2][-3] <= 1 + MEM // TGT


@pytest.mark.parametrize("mechanism", ["xl", "lamemo", "rmt"])
def test_each_mechanism_compiles_into_whole_graphs_without_breaks(runs, mechanism):
    # A graph break splits the forward into pieces compiled apart, with eager Python in
    # between: what fusion there is gets lost at the seams, and each piece guards anew.
    assert runs[mechanism][4] == 0


def test_evaluation_without_gradients_stays_eager_and_compiles_nothing(runs):
    model = runs["xl"][3]
    before = compiled_graphs()
    model.eval()
    with torch.no_grad():
        state = None
        for batch in (3, 5):  # other batch sizes and memory lengths than training
            for _ in range(2):
                out = model(torch.randint(0, 32, (batch, 7)), state)
                state = out.state
            state = None
    assert compiled_graphs() == before


def _rmt_windows(compiled: bool) -> list[float]:
    """3 steps of RMT BPTT windows of 2 segments, each segment checkpointed."""
    model, opt, data = _tiny("rmt", TGT, compiled)
    state, losses = None, []
    for _ in range(3):
        loss = 0.0
        for _ in range(2):
            x, y = torch.randint(0, 32, (2, 4, TGT), generator=data)
            out = model(x, state, targets=y, checkpoint_segment=True)
            state, loss = out.state, loss + out.loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        state = state.detach()
        losses.append(loss.item())
    return losses


def test_checkpointed_bptt_windows_recompute_through_the_compiled_graph():
    # The recompute in the backward runs with gradients enabled and the training shapes,
    # so it reuses the compiled graph, with the same dropout masks (RNG state restored).
    assert _rmt_windows(True) == pytest.approx(_rmt_windows(False), rel=1e-5, abs=1e-6)


def test_compile_with_a_selective_recompute_policy_is_refused_naming_the_field(tmp_path):
    cfg = tiny_config(tmp_path, "sel", model={"compile": True},
                      bptt={"checkpoint_segments": True, "recompute": "save-linear"})
    with pytest.raises(ConfigError, match="bptt.recompute.*model.compile"):
        load_config(str(cfg))
    load_config(str(cfg), ["bptt.recompute=full"])  # full recompute compiles: accepted


def test_compiling_keeps_parameter_names_so_checkpoints_are_interchangeable():
    torch.manual_seed(0)
    cfg = ModelConfig(mechanism="xl", vocab_size=32, n_layer=1, d_model=16, n_head=2,
                      d_inner=32, tgt_len=4, mem_len=4)
    eager = build_model(cfg)
    compiled = build_model(cfg)
    compile_core(compiled)
    assert list(compiled.state_dict()) == list(eager.state_dict())
    compiled.load_state_dict(eager.state_dict())


@pytest.mark.parametrize("model,graphs_then_resumed", [
    ({}, (3, 1)),
    # 2 layers: the bottom and the top layer call, per memory length 8 and 16.
    ({"mechanism": "lamemo", "checkpoint_layers": True}, (5, 2)),
], ids=["xl", "lamemo-checkpoint-layers"])
def test_memtrain_train_compiled_matches_eager_and_resumes_exactly(tmp_path, model,
                                                                    graphs_then_resumed):
    # Through the DeepSpeed engine (ZeRO-2), dropout 0.1: the eager run, and a compiled run
    # stopped after 3 steps and resumed to 6. The resumed steps can only match if the
    # checkpoint restored the RNG the compiled dropout draws from. With checkpoint_layers
    # the layer calls are compiled inside the checkpoints, whose recompute draws again.
    sections = dict(max_steps=6, save_every=3, deepspeed={"zero_stage": 2},
                    eval={"max_segments": 2, "every": 0})
    model = {"mem_len": 16, **model}
    eager_cfg = tiny_config(tmp_path, "eager", model=model, **sections)
    run_train(eager_cfg, launcher="single")
    eager = step_losses(tmp_path / "runs" / "eager")

    cfg = tiny_config(tmp_path, "compiled", model={**model, "compile": True}, **sections)
    run_train(cfg, ["max_steps=3"], launcher="single")
    done = run_train(cfg, launcher="single")
    assert "resumed from" in done.stdout
    compiled = step_losses(tmp_path / "runs" / "compiled")
    assert sorted(compiled) == sorted(eager) == list(range(1, 7))
    assert [compiled[s] for s in range(1, 7)] == pytest.approx(
        [eager[s] for s in range(1, 7)], rel=1e-5, abs=1e-6)
    # The resumed process compiled its own graphs: memory 16 from step 4 on, one length.
    graphs = step_losses(tmp_path / "runs" / "compiled", "compiled_graphs")
    assert (graphs[3], graphs[6]) == graphs_then_resumed


def test_compiled_zero3_trains_bptt_windows_with_the_eager_losses_and_warns(tmp_path):
    # ZeRO-3 gathers each module's parameters in hooks on that module, which break the
    # compiled graph at every module (the run says so). What must hold: a BPTT window (every
    # parameter used in 3 segments of one backward) trains exactly as eager. Making the
    # decoder stack a ZeRO-3 leaf (gathered once, 2 graphs) failed here: DeepSpeed's
    # gradient bucket met the same parameter twice.
    sections = dict(max_steps=3, deepspeed={"zero_stage": 3}, bptt={"depth": 2},
                    eval={"max_segments": 2, "every": 0})
    run_train(tiny_config(tmp_path, "eager", model={"mem_len": 16}, **sections),
              launcher="single")
    done = run_train(tiny_config(tmp_path, "compiled", model={"mem_len": 16, "compile": True},
                                 **sections), launcher="single")
    assert "model.compile under ZeRO-3" in done.stderr
    eager = step_losses(tmp_path / "runs" / "eager")
    compiled = step_losses(tmp_path / "runs" / "compiled")
    assert [compiled[s] for s in range(1, 4)] == pytest.approx(
        [eager[s] for s in range(1, 4)], rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("mechanism", ["xl", "lamemo", "rmt"])
def test_a_bf16_model_compiles_and_trains_like_eager_bf16(mechanism):
    # The A100 precision (DeepSpeed casts the model to bf16; memtrain refuses bf16 on a CPU
    # run, so the bare model here). Fused kernels round differently: bf16 tolerance. No
    # dropout: eager bf16 dropout scales by 1/(1-p) rounded to bf16, a fused kernel by the
    # fp32 value (0.2% apart at p = 0.1), a difference of rounding, not of the model.
    models = []
    for compiled in (False, True):
        model, _, data = _tiny(mechanism, TGT, compiled, dropout=0.0)   # 2 graphs each
        models.append((model.to(torch.bfloat16), data))
    losses: list[list[float]] = [[], []]
    states = [None, None]
    for _ in range(3):
        for i, (model, data) in enumerate(models):
            x, y = torch.randint(0, 32, (2, 4, TGT), generator=data)
            out = model(x, states[i], targets=y)
            out.loss.backward()
            states[i] = out.state.detach()
            losses[i].append(out.loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=2e-3)
    grads = [torch.cat([p.grad.float().flatten() for p in m.parameters() if p.grad is not None])
             for m, _ in models]
    assert (grads[1] - grads[0]).norm() < 0.03 * grads[0].norm()


@pytest.mark.parametrize("mechanism", ["xl", "lamemo", "rmt"])
def test_checkpointed_layers_compile_per_layer_call_with_the_eager_losses(mechanism):
    # Each layer call is compiled inside its (eager) checkpoint. The 4 layers share their
    # graphs: one per memory length (0, 8, 16). LaMemo's memory lengths 8 and 16 take three
    # kinds of call each: the bottom layer (its memory, the cached embeddings, has no
    # gradient), the middle ones and the top one. A graph per layer would make 4x as many.
    torch._dynamo.reset()   # graphs compiled by earlier tests for the same code
    eager, _, _ = _train(mechanism, False, checkpoint_layers=True, n_layer=4)
    breaks = graph_breaks()
    compiled, graphs, _ = _train(mechanism, True, checkpoint_layers=True, n_layer=4)
    assert graph_breaks() == breaks   # each layer call is one whole graph
    assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-6)
    assert len(set(eager)) == STEPS
    kinds = 3 if mechanism == "lamemo" else 1
    assert graphs[-1] == graphs[-3] == 1 + kinds * (MEM // TGT)


@pytest.mark.parametrize("mechanism", ["xl", "lamemo"])
def test_compiled_checkpointed_layers_keep_the_memory_saving_of_eager_checkpointing(mechanism):
    # Compiling the whole stack with its checkpointed layers inside one graph made the
    # compiled backward recompute every layer at once: the window's peak was 2.2x eager
    # checkpointing's for LaMemo and 1.16x for XL (allocator peak, as the memory planner's
    # benchmark measures it). Per layer call, it stays at most eager's.
    cfg = ModelConfig(**bench_memory_plan._small(mechanism=mechanism, checkpoint_layers=True))
    torch._dynamo.reset()
    eager = bench_memory_plan.measure(cfg, 4, 1, False)["peak"]
    compiled = bench_memory_plan.measure(cfg, 4, 1, False, compiled=True)
    assert compiled["graphs"] > 0
    assert compiled["peak"] <= 1.02 * eager


def test_a_long_memory_compiles_every_length_instead_of_falling_back_to_eager():
    # torch.compile runs a function eager, with only a logged warning, once it holds 8
    # graphs. LaMemo's middle-layer call needs two per memory length (bottom layer: memory
    # without gradient; the others: with); a memory of 5 segments has 6 lengths, so 12.
    # compile_core raises the limit to what the model needs: all 1 + 3 x 5 graphs compile
    # (at the default limit the count stopped at 14 and later layers ran eager).
    torch._dynamo.reset()
    _, graphs, _ = _train("lamemo", True, mem_len=5 * TGT, steps=7, checkpoint_layers=True,
                          n_layer=3, dropout=0.0, dropatt=0.0)
    assert graphs[-1] == graphs[-2] == 1 + 3 * 5
