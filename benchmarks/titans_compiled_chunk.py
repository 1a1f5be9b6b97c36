"""Titans' chunk loop eager against `model.titans.compiled_chunks` (the chunk step compiled
once and reused by every full chunk, model/compiled.py `compiled_chunk_step`), in tokens/s
at a realistic shape (docs/titans.md, "The compiled chunk").

Two parts:
- `update`: n_layer neural memories (model/mechanisms/titans/neural_memory.py) written and read with
one
  segment, forward and backward, the state entering with a gradient (inside a BPTT window).
  Defaults: GPT-2-124M's width and depth (d_model 768, 12 layers), d_mem 64, depth 2,
  segment 1,024, chunk 16 (the default), batch 32: the shape of docs/titans.md's GPU table.
- `model`: the native MAC model (model/mechanisms/titans/core.py) at that width and depth, one
training
  step (forward and backward) of a segment, batch `--model-batch`.

Each timed by `benchmarks/common.py` `step_clock` (on CUDA the wall time after the device
has finished), the median of `--rounds` after a first, compiling, step (its time reported
as compile_s). The compiled and the eager run start from the same weights; their outputs'
largest relative difference is reported.

    python benchmarks/titans_compiled_chunk.py --device cuda --dtype bf16     # on a GPU
    .venv/bin/python benchmarks/titans_compiled_chunk.py --quick                  # CPU rehearsal
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import add_device_args, finish, model_dtype, step_clock  # noqa: E402
from model import ModelConfig, build_model  # noqa: E402
from model.compiled import compiled_graphs, graph_breaks  # noqa: E402
from model.mechanisms.titans.neural_memory import NeuralMemory, NeuralMemoryState  # noqa: E402


def _time(step, clock, rounds: int) -> tuple[float, float, object]:
    """(seconds of the first call, median seconds of the next `rounds`, its last output)."""
    t0 = clock()
    out = step()
    first = clock() - t0
    times = []
    for _ in range(rounds):
        t0 = clock()
        out = step()
        times.append(clock() - t0)
    return first, statistics.median(times), out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def part_update(a, device, dtype, clock) -> dict:
    torch.manual_seed(0)
    eager = [NeuralMemory(a.d_model, a.d_mem, depth=2, chunk_size=a.chunk, max_grad_norm=1.0)
             .to(device=device, dtype=dtype) for _ in range(a.n_layer)]
    x = torch.randn(a.batch, a.seg_len, a.d_model, device=device, dtype=dtype,
                    requires_grad=True)
    state = NeuralMemoryState.empty(a.batch, a.n_layer, eager[0].shapes, device=device)
    state.fresh.fill_(False)
    with torch.no_grad():
        for t, w0 in zip(state.weights, eager[0].initial_weights(), strict=True):
            t.copy_(w0.float())
    for t in state.weights + state.momentum:   # carried inside a BPTT window
        t.requires_grad_(True)
    out = {}
    results = {}
    for name, backend in (("eager", None), ("compiled", a.backend)):
        mems = copy.deepcopy(eager)
        for m in mems:
            m.compile_backend = backend

        def step(mems=mems):
            loss, reads = 0.0, []
            for i, m in enumerate(mems):
                w, s = state.layer(i, m.initial_weights())
                new_w, new_s, r = m.update(w, s, x, read=x)
                loss = loss + r.float().square().mean() + new_w[0].square().mean()
                reads.append(r.detach())
            loss.backward()
            return reads
        graphs = compiled_graphs()
        first, median, reads = _time(step, clock, a.rounds)
        results[name] = reads
        out[name] = {"first_step_s": first, "median_s": median,
                     "tokens_per_s": a.batch * a.seg_len / median,
                     "graphs": compiled_graphs() - graphs}
    out["compiled"]["graph_breaks"] = graph_breaks()
    out["speedup"] = out["eager"]["median_s"] / out["compiled"]["median_s"]
    out["reads_max_rel_diff"] = max(_rel(c, e) for c, e in zip(results["compiled"],
                                                                results["eager"], strict=True))
    return out


def part_model(a, device, dtype, clock) -> dict:
    out, losses = {}, {}
    for name, compiled in (("eager", False), ("compiled", True)):
        torch.manual_seed(0)
        cfg = ModelConfig(mechanism="titans", vocab_size=a.vocab, n_layer=a.n_layer,
                          d_model=a.d_model, n_head=max(a.d_model // 64, 1),
                          d_inner=4 * a.d_model, dropout=0.0, tgt_len=a.seg_len, mem_len=0,
                          pre_lnorm=True, compile_backend=a.backend,
                          titans={"d_mem": a.d_mem, "chunk_size": a.chunk,
                                  "compiled_chunks": compiled})
        model = build_model(cfg).to(device=device, dtype=dtype).train()
        g = torch.Generator().manual_seed(1)
        x = torch.randint(0, a.vocab, (a.model_batch, a.seg_len + 1), generator=g).to(device)

        def step(model=model, x=x):
            model.zero_grad(set_to_none=True)
            loss = model(x[:, :-1], None, targets=x[:, 1:]).loss
            loss.backward()
            return loss.detach()
        graphs = compiled_graphs()
        first, median, loss = _time(step, clock, a.rounds)
        losses[name] = float(loss)
        out[name] = {"first_step_s": first, "median_s": median,
                     "tokens_per_s": a.model_batch * a.seg_len / median,
                     "graphs": compiled_graphs() - graphs, "loss": losses[name]}
    out["speedup"] = out["eager"]["median_s"] / out["compiled"]["median_s"]
    out["loss_rel_diff"] = abs(losses["compiled"] - losses["eager"]) / abs(losses["eager"])
    return out


def main(argv=None) -> int:
    started = time.time()
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device_args(p)
    p.add_argument("--parts", default="update,model")
    p.add_argument("--backend", default=None, help="inductor (default), aot_eager "
                   "(default with --quick)")
    p.add_argument("--seg-len", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=16)
    p.add_argument("--batch", type=int, default=32, help="rows of the update part")
    p.add_argument("--model-batch", type=int, default=8, help="rows of the model part")
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--d-mem", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes on the CPU (a rehearsal of the GPU call)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.quick:
        a.seg_len, a.batch, a.model_batch, a.d_model, a.d_mem = 64, 2, 2, 64, 16
        a.n_layer, a.vocab, a.rounds = 2, 64, 2
        a.backend = a.backend or "aot_eager"
    a.backend = a.backend or "inductor"
    device, dtype = torch.device(a.device), model_dtype(a)
    clock = step_clock(device)
    results = {"args": vars(a), "torch": torch.__version__,
               "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                               else "cpu")}
    for part in a.parts.split(","):
        fn = {"update": part_update, "model": part_model}[part]
        # each part's graphs static, as in a run of one shape (another part's batch would
        # make torch.compile recompile them dynamic)
        torch._dynamo.reset()
        results[part] = fn(a, device, dtype, clock)
        print(part, {k: v for k, v in results[part].items()}, flush=True)
    return finish(a.json, results, started)


if __name__ == "__main__":
    sys.exit(main())
