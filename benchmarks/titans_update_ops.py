"""Titans' chunk loop, counted: the aten ops one NeuralMemory.update (with its reads) runs
forward and backward, per chunk, and its CPU time.

On a GPU each op is at least one kernel launch and a trip through the dispatcher, and the
chunks run one after another, so at the default chunk of 16 the number of ops, not the
arithmetic, sets a segment's time (docs/titans.md, "Speed on the GPU"). The count does not
depend on the device, so this CPU script tracks what the GPU pays.

    .venv/bin/python benchmarks/titans_update_ops.py --seg-len 1024 --chunk 16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from model.neural_memory import NeuralMemory, NeuralMemoryState  # noqa: E402


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
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    mem = NeuralMemory(a.d_model, a.d_mem, depth=2, chunk_size=a.chunk, max_grad_norm=1.0)
    x = torch.randn(a.batch, a.seg_len, a.d_model, requires_grad=True)
    state = NeuralMemoryState.empty(a.batch, 1, mem.shapes)

    def step():
        w, s = state.layer(0, mem.initial_weights())
        new_w, _, reads = mem.update(w, s, x, read=x)
        (reads.square().sum() + new_w[0].sum()).backward()

    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    ops = Counter(e.name for e in prof.events() if e.name.startswith("aten::"))
    times = []
    for _ in range(a.rounds):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    chunks = -(-a.seg_len // a.chunk)
    out = {"seg_len": a.seg_len, "chunk": a.chunk, "chunks": chunks,
           "aten_ops": sum(ops.values()), "aten_ops_per_chunk": sum(ops.values()) / chunks,
           "median_s": statistics.median(times), "times_s": times}
    if a.top:
        out["top_ops"] = ops.most_common(a.top)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
