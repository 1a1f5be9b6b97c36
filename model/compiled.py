"""torch.compile for training: the decoder stack compiled in place, eager numerics kept.
(Around a pretrained model, each decoder layer instead: model/pretrained/regional.py.)

What is compiled is `MemoryLM.core` (the mechanism's layers and its memory bookkeeping):
that is where the elementwise work between the matmuls lives (skew, masks, softmax,
dropout, LayerNorm, residuals) which a compiler can fuse. The embedding and the softmax head
stay eager: the adaptive softmax routes its clusters on the host with numpy (no device sync,
see adaptive.py), which a compiled graph could not keep.

Choices, and why:
- In place (the instance's forward is swapped), so parameter names and state_dict keys
  do not change: checkpoints of compiled and eager runs are interchangeable.
- Dropout draws from torch's own generator (`fallback_random`), in the same order as eager:
  a compiled run draws the same masks as an eager one from the same seed, so its losses
  equal eager's to float tolerance and the RNG state a checkpoint saves is the whole story
  (Inductor's in-kernel RNG would give other masks, and was slower on the CPU; BENCHMARKS.md).
- Shapes: the mechanisms branch in Python on the memory length (an empty memory, the
  distance list, the masks), so each memory length compiles its own graph: a run compiles
  one graph per length the memory passes through, 0, tgt_len, 2 tgt_len, ... up to
  mem_len, i.e. 1 + ceil(mem_len / tgt_len), then none (tests/test_compile.py counts
  them; `compiled_graphs()` reports them).
- With `checkpoint_layers`, each layer call is compiled instead of the stack, inside the
  eager checkpoint. Compiled as one graph, the stack's checkpointed layers lost most of
  their saving: the compiled backward recomputed every layer's activations at once, so a
  window peaked above eager checkpointing (for LaMemo above the compiled stack without
  checkpointing). Per layer, the checkpoint recomputes one layer at a time as in eager,
  each call through the compiled layer. The layers share their graphs (same code,
  parameters as inputs), so the count is still one per memory length whatever n_layer;
  LaMemo's three kinds of layer call (the bottom one, whose memory has no gradient, the
  middle ones, the top one) make up to three per memory length. The whole stack's speed-up
  was bought with the memory checkpointing was asked to save; per layer call is a little
  slower than eager on the CPU. The peaks and speeds measured: BENCHMARKS.md, "Memory
  planner" (the `model.compile` rows and the checkpoint_layers table after them);
  tests/test_compile.py holds the compiled peak to eager's.
"""

from __future__ import annotations

import inspect
import math

import torch
from torch import nn

# Dropout from torch's generator, in eager order (module docstring).
_OPTIONS = {"fallback_random": True}


def _compile(fn, backend: str):
    """torch.compile of `fn`. `backend` is Inductor for training; "aot_eager" traces the
    same graphs (Dynamo, then AOT autograd's forward/backward split) and runs them on eager
    kernels, building no C++: what the graph counts, graph breaks and the graph limit are
    decided by, at a fraction of a cold Inductor build (tests/test_compile.py)."""
    options = _OPTIONS if backend == "inductor" else None
    return torch.compile(fn, backend=backend, dynamic=None, options=options)


def _contiguous(t):
    # A memory sliced out of a longer concatenation has other strides than one built whole;
    # compiled graphs guard on strides, so hand them one layout (a copy only of the tensors
    # that need it) instead of compiling a graph per layout.
    return t.contiguous() if isinstance(t, torch.Tensor) else t


def compile_core(model: nn.Module, backend: str = "inductor") -> None:
    """Compile the training forward of `model.core` (see the module docstring).

    Only calls with gradients enabled go through the compiled code: evaluation and
    generation (no_grad, other batch sizes and memory lengths) stay eager instead of
    compiling a graph per shape, and a segment recomputed by activation checkpointing
    (grad enabled, same shapes) reuses the training graph. The forward (under
    checkpoint_layers: `run_layer`) is replaced on the instance, so parameter names,
    state_dict keys and module hooks are unchanged. `backend`: see `_compile`. Around a
    pretrained model (no `core`), each decoder layer's forward instead
    (model/pretrained/regional.py).
    """
    if not hasattr(model, "core"):
        # A pretrained base model (PretrainedMemoryLM) compiles its decoder layers itself,
        # one at a time (model/pretrained/regional.py), with this module's torch.compile.
        model.compile_regions(backend, _compile)
        return
    core = model.core
    _allow_graphs(core.cfg)
    if core.cfg.checkpoint_layers:
        _compile_layer_calls(core, backend)
        return
    eager = core.forward
    compiled = _compile(eager, backend)

    def forward(h0, state, lengths):
        if not torch.is_grad_enabled():
            return eager(h0, state, lengths)
        return compiled(h0, None if state is None else state.contiguous(), lengths)

    core.forward = forward


def _allow_graphs(cfg) -> None:
    """Raise torch.compile's per-function graph limit (`recompile_limit`, 8) to what this
    model compiles: past the limit a function silently runs eager (a logged warning only).
    A function takes a graph per memory length and per kind of memory it is handed: with or
    without gradient (LaMemo's bottom layer against the others; inside a BPTT window or at
    its start), up to three kinds; plus one for a memory sliced with other strides. The
    setting is torch's, process-wide; it is only ever raised."""
    lengths = 1 + math.ceil(cfg.mem_len / cfg.tgt_len)
    needed = 3 * lengths + 1
    if torch._dynamo.config.recompile_limit < needed:
        torch._dynamo.config.recompile_limit = needed


def _compile_layer_calls(core: nn.Module, backend: str) -> None:
    """Under checkpoint_layers: compile what each `run_layer` call runs (a layer module, or
    a method of the stack taking the layer), and keep the checkpoint around it eager."""
    checkpointed = core.run_layer
    compiled: dict = {}

    def run_layer(fn, *args):
        if not torch.is_grad_enabled():
            return checkpointed(fn, *args)
        # A bound method is a new object at every attribute access: key it by its function.
        key = fn.__func__ if inspect.ismethod(fn) else fn
        if key not in compiled:
            compiled[key] = _compile(fn, backend)
        return checkpointed(compiled[key], *(_contiguous(a) for a in args))

    core.run_layer = run_layer


def compiled_graphs() -> int:
    """How many graphs torch.compile has built in this process so far (each recompile of a
    guard failure, e.g. a new memory length, adds one)."""
    # torch's own compile statistics; imported on use: torch._dynamo takes seconds to load.
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def graph_breaks() -> int:
    """How many times torch.compile had to split a graph (0 for every mechanism today)."""
    from torch._dynamo.utils import counters  # on use, as above

    return int(sum(counters["graph_break"].values()))


# The chunk step of Titans' memory, compiled once per backend (`compiled_chunk_step`).
# model/mechanisms/titans/neural_memory.py hands its step over, so this module imports no mechanism.
_CHUNK_STEPS: dict = {}


def compiled_chunk_step(chunk_step, backend: str):
    """`model.titans.compiled_chunks`: Titans' chunk step (model/mechanisms/titans/neural_memory.py
    passes its `chunk_step`: a chunk's reads and its update, §3.2) compiled by `backend`, the same
    function for every memory. Every full chunk of a segment has the same shapes and the
    weights are inputs, not parameters, so one graph (a forward and a backward) serves every
    chunk of every layer: the loop runs the graph once per chunk instead of the ~500 eager
    ops it was (docs/titans.md, "The compiled chunk"). fullgraph: a graph break would put
    the host back between the pieces, so it is an error, not a fallback. Called only with
    gradients enabled (the training forward and its recomputation), as `compile_core`.

    `chunk_step` itself where it cannot be compiled on its own: inside another compiled
    graph (`model.compile` on the native stack traces the chunk loop into the stack's
    graph) and under a Python dispatch mode (a selective `bptt.recompute` policy's,
    train/recompute.py, which torch.compile does not trace)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return chunk_step
    if (chunk_step, backend) not in _CHUNK_STEPS:
        _CHUNK_STEPS[chunk_step, backend] = torch.compile(chunk_step, backend=backend,
                                                          fullgraph=True, dynamic=None)
    return _CHUNK_STEPS[chunk_step, backend]
