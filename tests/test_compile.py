"""model.compile: the compiled training forward is the eager one, faster or not.

Compiled training draws the same dropout masks as eager (torch's generator, in order), so
its losses equal eager's to float tolerance; it compiles one graph per memory length and
then none, even where that is more than torch's per-function graph limit; evaluation stays
eager; and a compiled run resumes exactly.

What this file costs is Inductor writing and g++ building C++ kernels, seconds per graph on
a cold cache (a fresh machine: CI, a new contributor). So every property is compiled once,
at one shape: the tiny model of tests/train_helpers.py (2 layers, d_model 32, 2 heads,
batch 4, segments of 8 and a memory of 8, i.e. the two memory lengths 0 and 8), which the
`memtrain train` runs below use too, so that their graphs are the ones the in-process runs
already put in the Inductor cache. Each test says what breaking its mechanism does to it.

Inductor builds what only Inductor decides: the dropout masks (`fallback_random`), for the
mechanism each `memtrain train` run below compiles (XL; LaMemo per layer call), whose
graphs that run then finds in the cache. The other mechanisms go through the same Dynamo
trace and AOT autograd split on the `aot_eager` backend, which builds no C++: their graph
counts, graph breaks, graph limit and eager losses are decided there, in seconds instead
of a cold build's minute. Every mechanism's Inductor lowering is still built, once, by the
bf16 test (tests/test_compile_bf16_zero3.py).
(bf16 and ZeRO-3 compile graphs of their own: tests/test_compile_bf16_zero3.py, a second
file so that the suite's two workers share the compile tests.)
"""

from __future__ import annotations

import pytest
import torch
from compile_helpers import (
    BATCH,
    MEM,
    RUN_MODEL,
    SHAPE,
    STEPS,
    TGT,
    batch,
    graph_limit,
    tiny,
)
from train_helpers import V, run_train, step_losses, tiny_config

from model import ConfigError, ModelConfig, build_model
from model.compiled import compile_core, compiled_graphs, graph_breaks
from train.config import load_config
from train.memory_probe import measure
from train.segment_checkpoint import SegmentCheckpoint

pytestmark = pytest.mark.slow

def _train(mechanism: str, compiled: bool, mem_len: int = MEM, steps: int = STEPS,
           device: str = "cpu", backend: str = "inductor", **extra):
    """Training steps of a tiny model: (losses, graphs compiled by the end of each step,
    counted from the first, model)."""
    model, opt, data = tiny(mechanism, mem_len, compiled, device, backend, **extra)
    state, losses, graphs, before = None, [], [], compiled_graphs()
    for _ in range(steps):
        x, y = batch(data, device)
        out = model(x, state, targets=y)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        state = out.state.detach()
        losses.append(out.loss.item())
        graphs.append(compiled_graphs() - before)
    return losses, graphs, model


def _eager_and_compiled(inductor: str, **extra) -> dict:
    """Each mechanism trained eager and compiled (by Inductor for `inductor`, on aot_eager
    for the others: module docstring), the compiled run under a graph limit of 1 (its two
    memory lengths need at least two graphs of one function): {mechanism: (eager losses,
    compiled losses, graphs per step, compiled model, graph breaks)}."""
    torch._dynamo.reset()   # count these runs' graphs only, not earlier tests' for the same code
    out = {}
    for mechanism in ("xl", "lamemo", "rmt", "armt"):
        eager, _, _ = _train(mechanism, False, **extra)
        breaks = graph_breaks()
        backend = "inductor" if mechanism == inductor else "aot_eager"
        with graph_limit(1):
            losses, graphs, model = _train(mechanism, True, backend=backend, **extra)
        out[mechanism] = (eager, losses, graphs, model, graph_breaks() - breaks)
    return out


@pytest.fixture(scope="module")
def runs():
    return _eager_and_compiled(inductor="xl")


@pytest.mark.parametrize("mechanism", ["xl", "lamemo", "rmt", "armt"])
def test_compiled_training_has_the_eager_losses_dropout_included(runs, mechanism):
    # Inductor's own RNG (fallback_random off) draws other masks: every step differs by ~1e-2
    # (XL here, built by Inductor; the others' traced graphs must keep eager's draw order).
    eager, compiled, *_ = runs[mechanism]
    assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-6)
    # Not trivially equal: the losses move (training happens, dropout differs per step).
    assert len(set(eager)) == STEPS


@pytest.mark.parametrize("mechanism", ["xl", "lamemo", "rmt", "armt"])
def test_each_memory_length_compiles_one_graph_then_none_even_past_torchs_graph_limit(
        runs, mechanism):
    # The memory is 0 long at step 1 and 8 from step 2 on: two graphs, then the full memory
    # reuses the second. The run had torch's limit at 1 graph per function: without
    # compile_core raising it to the model's need, step 2 on would run eager ([1, 1, 1, 1],
    # with eager's losses, so only this count sees it).
    assert runs[mechanism][2] == [1, 2, 2, 2]


@pytest.mark.parametrize("mechanism", ["xl", "lamemo", "rmt", "armt"])
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
                out = model(torch.randint(0, V, (batch, 7)), state)
                state = out.state
            state = None
    assert compiled_graphs() == before


def test_the_raised_graph_limit_covers_a_long_lamemo_memory_with_checkpointed_layers():
    # The most graphs one function takes: LaMemo's layer call under checkpoint_layers, three
    # kinds of call (bottom layer: memory without gradient; middle; top) per non-empty memory
    # length, so 1 + 3 x 5 for a memory of 5 segments (torch's default limit is 8; at it the
    # count stopped at 14 and later layers ran eager). The per-layer test below compiles the
    # three kinds at the small shape under a limit of 1; this holds the formula at length.
    cfg = ModelConfig(**{**SHAPE, "mechanism": "lamemo", "n_layer": 3, "mem_len": 5 * TGT,
                         "checkpoint_layers": True})
    with graph_limit(1):
        compile_core(build_model(cfg))   # compiles nothing until the first call
        assert torch._dynamo.config.recompile_limit >= 1 + 3 * 5


def _rmt_windows(compiled: bool) -> list[float]:
    """3 steps of RMT BPTT windows of 2 segments, each segment checkpointed (traced on
    aot_eager, as the `runs` fixture's RMT: the recompute under Inductor's RNG is LaMemo's
    per-layer checkpoint below)."""
    model, opt, data = tiny("rmt", MEM, compiled, backend="aot_eager")
    state, losses = None, []
    for _ in range(3):
        loss = 0.0
        for _ in range(2):
            x, y = batch(data)
            out = model(x, state, targets=y, run_decode=SegmentCheckpoint())
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
    cfg = ModelConfig(**{**SHAPE, "mem_len": MEM})
    eager = build_model(cfg)
    compiled = build_model(cfg)
    compile_core(compiled)
    assert list(compiled.state_dict()) == list(eager.state_dict())
    compiled.load_state_dict(eager.state_dict())


# Three layers: LaMemo's bottom, middle and top layer calls are its three kinds of call.
LAYERS = {"checkpoint_layers": True, "n_layer": 3}


@pytest.fixture(scope="module")
def layer_runs():
    """The same with checkpoint_layers: compiled per layer call."""
    return _eager_and_compiled(inductor="lamemo", **LAYERS)


@pytest.mark.parametrize("mechanism", ["xl", "lamemo", "rmt", "armt"])
def test_checkpointed_layers_compile_per_layer_call_with_the_eager_losses(layer_runs,
                                                                         mechanism):
    # Each layer call is compiled inside its (eager) checkpoint. The 3 layers share their
    # graphs: one per memory length (0, 8). LaMemo's memory length 8 takes three kinds of
    # call: the bottom layer (its memory, the cached embeddings, has no gradient), the
    # middle one and the top one. A graph per layer would make 3x as many. The run's limit
    # is 1: without compile_core raising it every count stops at 1; raised by one graph per
    # length only (no room for the kinds of call), RMT's stops short (measured).
    eager, compiled, graphs, _, breaks = layer_runs[mechanism]
    assert breaks == 0   # each layer call is one whole graph
    assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-6)
    assert len(set(eager)) == STEPS
    kinds = 3 if mechanism == "lamemo" else 1
    assert graphs == [1] + [1 + kinds] * (STEPS - 1)


@pytest.mark.parametrize("mechanism", ["xl", "lamemo"])
def test_compiled_checkpointed_layers_keep_the_memory_saving_of_eager_checkpointing(mechanism):
    # Compiling the whole stack with its checkpointed layers inside one graph made the
    # compiled backward recompute every layer at once: the window's peak was 2.2x eager
    # checkpointing's for LaMemo and 1.16x for XL at bench_memory_plan's small shape
    # (allocator peak, as the memory planner's benchmark measures it). Per layer call, it
    # stays at most eager's. At this file's shape (3 layers, memory 8) the whole-stack graph
    # still measures 1.24x (XL) and 1.53x (LaMemo) eager's peak, per layer call 0.93x.
    cfg = ModelConfig(**{**SHAPE, "mechanism": mechanism, "mem_len": MEM, **LAYERS})
    torch._dynamo.reset()
    eager = measure(cfg, BATCH, 1, False)["peak"]
    compiled = measure(cfg, BATCH, 1, False, compiled=True)
    assert compiled["graphs"] > 0
    assert compiled["peak"] <= 1.02 * eager


# Through `memtrain train`, last: their graphs are the in-process runs' above, which the
# Inductor cache then holds. XL's run is built by Inductor, the one Inductor build through
# the engine; LaMemo's per-layer calls inside checkpoints run on eager kernels
# (model.compile_backend: aot_eager): what it checks, the layer graphs and the recompute
# drawing dropout again from the restored RNG, is decided before any kernel is generated,
# and Inductor's per-layer kernels are the `layer_runs` fixture's.
@pytest.mark.parametrize("model,graphs_then_resumed", [
    ({}, (2, 1)),
    # 2 layers: the bottom and the top layer call at memory length 8, one call at length 0.
    ({"mechanism": "lamemo", "checkpoint_layers": True, "compile_backend": "aot_eager"},
     (3, 2)),
], ids=["xl", "lamemo-checkpoint-layers"])
def test_memtrain_train_compiled_matches_eager_and_resumes_exactly(tmp_path, model,
                                                                    graphs_then_resumed):
    # Through the DeepSpeed engine (ZeRO-2), dropout 0.1: the eager run, and a compiled run
    # stopped after 3 steps and resumed to 6. The resumed steps can only match if the
    # checkpoint restored the RNG the compiled dropout draws from (measured: restarting the
    # generator instead moves step 4 by ~1e-2). With checkpoint_layers the layer calls are
    # compiled inside the checkpoints, whose recompute draws again.
    sections = dict(max_steps=6, save_every=3, deepspeed={"zero_stage": 2},
                    eval={"max_segments": 2, "every": 0})
    model = {**RUN_MODEL, **model}
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
    # The resumed process compiled its own graphs: the full memory from step 4 on, one
    # length (with checkpoint_layers, its two kinds of layer call).
    graphs = step_losses(tmp_path / "runs" / "compiled", "compiled_graphs")
    assert (graphs[3], graphs[6]) == graphs_then_resumed
