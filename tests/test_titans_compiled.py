"""`model.titans.compiled_chunks`: Titans' chunk step (model/mechanisms/titans/neural_memory.py
`chunk_step`, a chunk's reads and its update, §3.2) compiled once by torch.compile
(model/compiled.py `compiled_chunk_step`) and reused by every full chunk. Pinned against the same
token-by-token float64 loop of Eq. 12-14 as the eager update (tests/test_neural_memory.py), and its
gradients against eager's. Compiled on aot_eager (Dynamo's graph, fullgraph, and AOT
autograd's forward/backward split on eager kernels): the graph counts and breaks are
decided there, at a fraction of a cold Inductor build (about 45-60 s for this step on the
2-core CI machine, over the suite's budget; docs/titans.md, "The compiled chunk")."""

from __future__ import annotations

import pytest
import torch
from bptt_reach import random_segments
from test_neural_memory import D_MODEL, _naive_inputs, _setup, naive
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

from model import ModelConfig, build_model
from model.compiled import compiled_graphs, graph_breaks
from model.mechanisms.titans.neural_memory import (
    NeuralMemory,
    NeuralMemoryState,
    chunk_step,
    chunks_weights,
)
from train.bptt import run_window

BACKEND = "aot_eager"


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test counts its own graphs (and shapes of other tests do not use up torch's
    per-function graph limit)."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _both(depth: int, chunk: int, n: int, clip=None, seed: int = 0):
    """The eager and the compiled update (grad enabled: training) of the same float64
    memory, reads included, and each one's gradient of the memory's parameters."""
    runs = []
    for backend in (None, BACKEND):
        mem, x, weights, momentum = _setup(depth, chunk, n, seed=seed, clip=clip)
        mem.compile_backend = backend
        new_w, new_s, reads = mem.update(weights, momentum, x, read=x)
        sum(t.square().sum() for t in [*new_w, *new_s, reads]).backward()
        runs.append((mem, x, weights, momentum, new_w, new_s, reads,
                     [p.grad for p in mem.parameters()]))
    return runs


@pytest.mark.parametrize("depth,chunk,n,clip", [(1, 1, 7, None), (3, 5, 10, None),
                                                (2, 16, 5, None), (2, 4, 11, 0.5)])
def test_the_compiled_chunk_step_equals_the_token_by_token_float64_recurrence(depth, chunk,
                                                                             n, clip):
    """The compiled update equals Eq. 13-14 run token by token (the eager update's test and
    tolerance), for a linear and deep memories, a ragged last chunk, a sequence shorter than
    a chunk and the clip; its reads and its gradients equal the eager update's."""
    (*_, e_w, e_s, e_reads, e_grads), (mem, x, w0, s0, c_w, c_s, c_reads, c_grads) = \
        _both(depth, chunk, n, clip)
    with torch.no_grad():
        want_w, want_s = naive(w0, s0, *_naive_inputs(mem, x), chunk, clip)
    for got, want in zip(c_w + c_s, want_w + want_s, strict=True):
        torch.testing.assert_close(got.detach(), want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(c_reads, e_reads, rtol=1e-12, atol=1e-14)
    for got, want in zip(c_grads, e_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    # the first chunk (the state entering without a gradient) and the others; none for a
    # sequence shorter than a chunk (its one chunk runs eager)
    assert (compiled_graphs(), graph_breaks()) == (2 if n >= 2 * chunk else 0, 0)


def test_every_full_chunk_of_every_layer_reuses_one_graph_without_breaks():
    """Two layers' memories over two segments of 3 chunks and a ragged one, the state
    entering with a gradient (inside a BPTT window): one graph for all 12 full chunks, 0
    breaks (fullgraph). A state entering without one (the first segment of a window:
    momentum 0, or detached at the cut) gives its first chunk a second graph, and no more."""
    torch.manual_seed(0)
    mems = [NeuralMemory(D_MODEL, 6, depth=2, chunk_size=4, max_grad_norm=1.0,
                         compile_backend=BACKEND) for _ in range(2)]
    x = torch.randn(2, 14, D_MODEL)
    state = NeuralMemoryState.empty(2, 2, mems[0].shapes)
    carried = NeuralMemoryState(weights=state.weights, fresh=state.fresh,
                                momentum=[t.clone().requires_grad_(True) for t in state.momentum])
    for _segment in range(2):
        for i, mem in enumerate(mems):
            w, s, r = mem.update(*carried.layer(i, mem.initial_weights()), x, read=x)
            (r.sum() + w[0].sum() + s[0].sum()).backward()
    assert (compiled_graphs(), graph_breaks()) == (1, 0)
    w, s = state.layer(0, mems[0].initial_weights())      # S = 0: no gradient
    mems[0].update(w, s, x, read=x)[2].sum().backward()
    assert (compiled_graphs(), graph_breaks()) == (2, 0)


def test_the_chunk_step_is_one_graph_by_dynamos_explain():
    mem, x, weights, momentum = _setup(2, 4, 8, clip=1.0)
    k, v, theta, eta, alpha = _naive_inputs(mem, x)
    coeffs = chunks_weights(theta, eta.log(), (1 - alpha).log(), 4)[0]
    q = k[:, :4]
    explained = torch._dynamo.explain(chunk_step)(weights, momentum, q, k[:, :4], v[:, :4],
                                                  coeffs, 1.0)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)


def test_without_gradients_the_update_stays_eager_and_compiles_nothing():
    mem, x, weights, momentum = _setup(2, 4, 11)
    mem.compile_backend = BACKEND
    with torch.no_grad():
        mem.update(weights, momentum, x, read=x)
    assert compiled_graphs() == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_memory_keeps_its_compiled_state_float32_close_to_float32(dtype):
    """The module in bf16 or fp16 (its projections and gates), the memory's weights and
    momentum float32 through the compiled step, within 2% of the float32 module's (the
    eager test's bound, tests/test_neural_memory.py)."""
    torch.manual_seed(0)
    mem = NeuralMemory(D_MODEL, 6, depth=2, chunk_size=4, compile_backend=BACKEND)
    state = NeuralMemoryState.empty(2, 1, mem.shapes)
    x = torch.randn(2, 8, D_MODEL)
    w, s = state.layer(0, mem.initial_weights())
    w32, s32, _ = mem.update(w, s, x)
    w16, s16, _ = mem.to(dtype).update(w, s, x.to(dtype))
    assert all(t.dtype == torch.float32 for t in w16 + s16)
    for a, b in zip(w16, w32, strict=True):
        assert (a - b).norm() / b.norm() < 0.02
    assert graph_breaks() == 0


def _titans_window(compiled: bool, checkpoint_segments: bool, recompute: str):
    """A 3-segment BPTT window of the native MAC model through the trainer's `run_window`:
    (loss, every parameter's gradient)."""
    torch.manual_seed(0)
    cfg = ModelConfig(mechanism="titans", vocab_size=13, n_layer=2, d_model=16, n_head=2,
                      d_inner=32, dropout=0.0, tgt_len=8, mem_len=0, compile_backend=BACKEND,
                      titans={"d_mem": 8, "chunk_size": 4, "num_persistent": 2,
                              "compiled_chunks": compiled})
    model = build_model(cfg).train()
    result = run_window(model, None, random_segments(3, 13, 8, seed=1), torch.device("cpu"),
                        checkpoint_segments=checkpoint_segments, recompute=recompute)
    result.loss.backward()
    return result.loss.item(), [p.grad for p in model.parameters()]


@pytest.mark.parametrize("checkpoint_segments,recompute", [
    (False, "full"), (True, "full"), (True, "save-linear")])
def test_model_titans_compiled_chunks_trains_as_eager(checkpoint_segments, recompute):
    """`model.titans.compiled_chunks` on the native MAC stack: a BPTT window of 3 segments
    (the memory and its gradient crossing them), plain, with checkpointed segments (their
    re-run through the same graph) and with a selective recompute policy (its dispatch
    modes: eager), gives eager's loss and gradients."""
    eager, eager_grads = _titans_window(False, checkpoint_segments, recompute)
    compiled, compiled_grads = _titans_window(True, checkpoint_segments, recompute)
    assert compiled_graphs() == (0 if recompute != "full" else 2) and graph_breaks() == 0
    assert compiled == pytest.approx(eager, rel=1e-6)
    for a, b in zip(compiled_grads, eager_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

class _Counting(TorchDispatchMode):
    """A Python dispatch mode as a selective recompute policy's (train/recompute.py)."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def test_under_a_python_dispatch_mode_the_chunk_step_runs_eager_and_equal():
    """torch.compile does not trace under a non-infra dispatch mode (fullgraph would raise):
    there the step runs eager, every op seen by the mode (a selective recompute policy
    keeps and matches them), with the compiled run's result."""
    (*_, want_reads, _), (mem, x, w0, s0, *_rest) = _both(2, 4, 11, clip=1.0)
    mode = _Counting()
    with mode:
        _, _, reads = mem.update(w0, s0, x, read=x)
    assert mode.ops > 200              # the chunks' ops, seen one by one (403 measured)
    torch.testing.assert_close(reads, want_reads, rtol=1e-12, atol=1e-14)
