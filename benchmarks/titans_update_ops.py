"""Titans' chunk loop, counted: the aten ops one NeuralMemory.update (with its reads) runs
forward and backward, per chunk, and its CPU time; with `--compiled BACKEND` the same
update with `model.titans.compiled_chunks` (model/compiled.py `compiled_chunk_step`): the
kernels of the compiled chunk step, per chunk, counted in the code Inductor generated.

On a GPU each op is at least one kernel launch and a trip through the dispatcher, and the
chunks run one after another, so at the default chunk of 16 the number of ops, not the
arithmetic, sets a segment's time (docs/titans.md, "Speed on the GPU"). The count does not
depend on the device, so this CPU script tracks what the GPU pays.

The state enters with a gradient, as every segment of a BPTT window after its first: then
every full chunk runs the one compiled graph (a segment entering without one compiles a
second graph for its first chunk; docs/titans.md, "The compiled chunk").

    .venv/bin/python benchmarks/titans_update_ops.py --seg-len 1024 --chunk 16
    .venv/bin/python benchmarks/titans_update_ops.py --seg-len 1024 --chunk 16 --compiled inductor
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from model.compiled import compiled_graphs, graph_breaks  # noqa: E402
from model.mechanisms.titans.neural_memory import NeuralMemory, NeuralMemoryState  # noqa: E402

# A launch in the `call` of Inductor's output code: a generated kernel (C++ or Triton) or
# an extern kernel (the matmuls) or an aten fallback.
_LAUNCH = re.compile(r"^\s+(?:(?P<gen>(?:cpp|triton)_\w+)(?:\.run)?\(|"
                     r"(?:extern_kernels\.\w+|torch\.ops\.\w+\.\w+(?:\.\w+)?|aten\.\w+)\()")


def launches(code: str) -> tuple[int, int]:
    """(generated kernels, extern kernels and fallbacks) launched by the `call` of one
    graph's Inductor output code."""
    body = code[code.index("def call("):]
    end = body.find("\n        return ")
    body = body if end < 0 else body[:end]
    gen = ext = 0
    for line in body.splitlines():
        m = _LAUNCH.match(line)
        if m:
            gen, ext = (gen + 1, ext) if m.group("gen") else (gen, ext + 1)
    return gen, ext


def _outside_graphs(events) -> int:
    """aten ops not run inside a compiled graph's call (the eager work around the steps)."""
    n = 0
    for e in events:
        if not e.name.startswith("aten::"):
            continue
        p = e.cpu_parent
        while p is not None and not p.name.startswith("## Call CompiledFxGraph"):
            p = p.cpu_parent
        n += p is None
    return n


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seg-len", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=16)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--d-mem", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5, help="timed updates (median reported)")
    p.add_argument("--top", type=int, default=0, help="also list the N most frequent ops")
    p.add_argument("--compiled", default=None, choices=("inductor", "aot_eager"),
                   help="the chunk step compiled by this backend (model.titans.compiled_chunks)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    mem = NeuralMemory(a.d_model, a.d_mem, depth=2, chunk_size=a.chunk, max_grad_norm=1.0,
                       compile_backend=a.compiled)
    x = torch.randn(a.batch, a.seg_len, a.d_model, requires_grad=True)
    state = NeuralMemoryState.empty(a.batch, 1, mem.shapes)
    for t in state.weights + state.momentum:   # a state carried inside a BPTT window
        t.requires_grad_(True)
    state.fresh.fill_(False)
    with torch.no_grad():
        for t, w0 in zip(state.weights, mem.initial_weights(), strict=True):
            t.copy_(w0)

    def step():
        w, s = state.layer(0, mem.initial_weights())
        new_w, _, reads = mem.update(w, s, x, read=x)
        (reads.square().sum() + new_w[0].sum()).backward()

    chunks = -(-a.seg_len // a.chunk)
    out = {"seg_len": a.seg_len, "chunk": a.chunk, "chunks": chunks,
           "compiled": a.compiled}
    if a.compiled == "inductor":
        from torch._inductor import metrics
        from torch._inductor.utils import run_and_get_code
        metrics.reset()
        t0 = time.perf_counter()
        _, codes = run_and_get_code(step)        # the forward's graph, then the backward's
        out["compile_s"] = time.perf_counter() - t0
        counts = [launches(c) for c in codes]
        out["graphs"] = [{"generated_kernels": g, "extern_kernels": e} for g, e in counts]
        out["inductor_generated_kernel_count"] = metrics.generated_kernel_count
        out["kernels_per_chunk"] = sum(g + e for g, e in counts)
        out["generated_kernels_per_chunk"] = sum(g for g, _ in counts)
    else:
        t0 = time.perf_counter()
        step()
        out["first_step_s"] = time.perf_counter() - t0
    out["unique_graphs"], out["graph_breaks"] = compiled_graphs(), graph_breaks()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    ops = Counter(e.name for e in prof.events() if e.name.startswith("aten::"))
    times, cpu = [], []
    for _ in range(a.rounds):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    # wall time, and the process's CPU time (on a shared machine the time others take is
    # not charged to it; one thread)
    out.update({"aten_ops": sum(ops.values()), "aten_ops_per_chunk": sum(ops.values()) / chunks,
                "median_s": statistics.median(times), "times_s": times,
                "median_cpu_s": statistics.median(cpu)})
    if a.compiled:
        # the eager ops around the steps (projections, gates, splits, their backward)
        out["aten_ops_outside_graphs_per_chunk"] = _outside_graphs(prof.events()) / chunks
    if a.top:
        out["top_ops"] = ops.most_common(a.top)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
