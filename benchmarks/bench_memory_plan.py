"""The memory planner's activation model (planner/activations.py) against measured bytes.

    .venv/bin/python benchmarks/bench_memory_plan.py            # the table of BENCHMARKS.md
    .venv/bin/python benchmarks/bench_memory_plan.py --quick    # three small rows
    .venv/bin/python benchmarks/bench_memory_plan.py --compile  # + the compiled model's peak

Each row runs one BPTT window exactly as the trainer does (`train.bptt.run_window` over k+1
segments, the bare model as the engine, one backward) on the CPU, with a full memory carried
in (filled under no_grad first) and parameter gradients already allocated (a warm-up window),
so that what grows is the window's own memory. Two exact byte counts, no RSS:

- saved: the storages of every tensor autograd saves during the forward
  (`torch.autograd.graph.saved_tensors_hooks`), each storage once, parameters and storages
  that existed before the window (the carried memory) excluded. Checkpointed segments and
  layers save through their own hooks, so this column is only shown without checkpointing.
- peak: the high-water mark of the bytes allocated by torch's CPU allocator between the
  start of the forward and the end of the backward, from the profiler's allocation events
  (`torch.profiler.profile(profile_memory=True)`, each event's size summed in time order).

Predicted: `window_memory(...)` with kernel "cpu" (dropout noise in the model dtype, SDPA's
math path), the same config, rows and window. Error = (predicted - measured) / measured.

--compile also measures the peak of the same window with the decoder stack compiled as
`model.compile: true` compiles it (model/compiled.py), for the rows that can compile (not
the selective recompute policies, which the config refuses with compile). The planner
counts eager's activations; this column says how far a compiled step is from them.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import sys
import time
import warnings

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from data_pipeline.streams import SegmentBatch  # noqa: E402
from model import ModelConfig, build_model  # noqa: E402
from model.compiled import compile_core, compiled_graphs  # noqa: E402
from planner.activations import Dims, count_params  # noqa: E402
from planner.window import window_memory  # noqa: E402
from train.bptt import run_window  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _segment(cfg: ModelConfig, rows: int, gen: torch.Generator) -> SegmentBatch:
    if cfg.cutoffs:   # the planner's assumption: Zipf-distributed word ranks
        zipf = 1.0 / torch.arange(1, cfg.vocab_size + 1, dtype=torch.float64)
        tokens = torch.multinomial(zipf, rows * (cfg.tgt_len + 1), replacement=True,
                                   generator=gen).view(rows, -1)
    else:
        tokens = torch.randint(0, cfg.vocab_size, (rows, cfg.tgt_len + 1), generator=gen)
    return SegmentBatch(tokens, torch.zeros(rows, dtype=torch.bool), None, 0, 0)


def _peak_growth(prof) -> int:
    events, todo = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        e = todo.pop()
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            events.append((e.start_time_ns, e.extra_fields.alloc_size))
        todo.extend(e.children)
    now = peak = 0
    for _, size in sorted(events):
        now += size
        peak = max(peak, now)
    return peak


def _data_ptr(t: torch.Tensor) -> int | None:
    """The storage address of a live tensor; None for tensors without data (the fake
    tensors a torch.compile earlier in the process may leave behind)."""
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:
        return None


def measure(cfg: ModelConfig, rows: int, depth: int, checkpoint_segments: bool,
            precision: str = "fp32", seed: int = 0, recompute: str = "full",
            keep_last: int = 0, compiled: bool = False) -> dict:
    """Saved-tensor bytes and peak allocation growth of one window of depth+1 segments
    (compiled: with the decoder stack compiled as `model.compile` does)."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = build_model(cfg).to(DTYPES[precision]).train()
    if compiled:
        # A fresh compile cache per row: every model's core shares its code, so graphs of
        # earlier rows would be reused (or count against torch.compile's graph limit).
        torch._dynamo.reset()
        compile_core(model)
        graphs_before = compiled_graphs()

    def forward(*args, **kwargs):
        return model(*args, **kwargs)

    state = None
    with torch.no_grad():   # a full memory, as in the middle of a stream
        for _ in range(max(1, math.ceil(cfg.mem_len / cfg.tgt_len))):
            state = run_window(forward, state, [_segment(cfg, rows, gen)], "cpu").state
    window = {"checkpoint_segments": checkpoint_segments, "recompute": recompute,
              "keep_last_segments": keep_last}
    warm = run_window(forward, state, [_segment(cfg, rows, gen) for _ in range(depth + 1)],
                      "cpu", **window)
    warm.loss.backward()
    state = warm.state
    for p in model.parameters():
        p.grad.zero_()
    del warm
    gc.collect()

    segments = [_segment(cfg, rows, gen) for _ in range(depth + 1)]
    with warnings.catch_warnings():   # isinstance() on deprecated torch.distributed aliases
        warnings.simplefilter("ignore", FutureWarning)
        before = {_data_ptr(t) for t in gc.get_objects() if isinstance(t, torch.Tensor)}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in before:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            res = run_window(forward, state, segments, "cpu", **window)
        res.loss.backward()
        del res
    out = {"saved": sum(saved.values()), "peak": _peak_growth(prof)}
    if compiled:
        out["graphs"] = compiled_graphs() - graphs_before
        if not out["graphs"]:
            raise RuntimeError("--compile: nothing was compiled")
    return out


def predict(cfg: ModelConfig, rows: int, depth: int, checkpoint_segments: bool,
            precision: str = "fp32", recompute: str = "full", keep_last: int = 0) -> dict:
    dims = Dims(cfg, rows, cfg.mem_len, precision, kernel="cpu")
    w = window_memory(dims, count_params(cfg), depth + 1, checkpoint_segments, recompute,
                      keep_last)
    return {"saved": w.saved, "peak": w.peak}


def _small(**kw) -> dict:
    base = dict(vocab_size=256, n_layer=4, d_model=128, n_head=4, d_inner=512, tgt_len=64,
                mem_len=64, dropout=0.1)
    base.update(kw)
    return base


# (label, model config, rows, depth k, segment checkpointing, precision)
CASES = [
    ("xl M=64 k=0", _small(mechanism="xl"), 4, 0, False, "fp32"),
    ("xl M=64 k=2", _small(mechanism="xl"), 4, 2, False, "fp32"),
    ("xl M=64 k=2 ckpt-seg", _small(mechanism="xl"), 4, 2, True, "fp32"),
    ("xl M=192 k=1", _small(mechanism="xl", mem_len=192), 4, 1, False, "fp32"),
    ("xl M=128 k=3 ckpt-seg", _small(mechanism="xl", mem_len=128), 4, 3, True, "fp32"),
    ("xl M=64 k=1 ckpt-layers", _small(mechanism="xl", checkpoint_layers=True), 4, 1, False,
     "fp32"),
    ("xl M=64 k=1 bf16", _small(mechanism="xl"), 4, 1, False, "bf16"),
    ("xl adaptive V=2000 k=1", _small(mechanism="xl", vocab_size=2000,
                                      cutoffs=[200, 600, 1200],
                                      tie_projs=[False, True, True, True]), 4, 1, False, "fp32"),
    ("lamemo M=64 k=0", _small(mechanism="lamemo"), 4, 0, False, "fp32"),
    ("lamemo M=128 k=1", _small(mechanism="lamemo", mem_len=128), 4, 1, False, "fp32"),
    ("lamemo M=64 k=2 ckpt-seg", _small(mechanism="lamemo"), 4, 2, True, "fp32"),
    ("lamemo M=64 k=0 ckpt-layers", _small(mechanism="lamemo", checkpoint_layers=True), 4, 0,
     False, "fp32"),
    ("rmt m=16 k=0", _small(mechanism="rmt", mem_len=0, rmt={"num_mem_tokens": 16}), 4, 0,
     False, "fp32"),
    ("rmt m=16 k=3", _small(mechanism="rmt", mem_len=0, rmt={"num_mem_tokens": 16}), 4, 3,
     False, "fp32"),
    ("rmt m=16 k=3 ckpt-seg", _small(mechanism="rmt", mem_len=0, rmt={"num_mem_tokens": 16}),
     4, 3, True, "fp32"),
    ("rmt pre-LN m=16 M=64 k=2", _small(mechanism="rmt", mem_len=64, pre_lnorm=True,
                                        rmt={"num_mem_tokens": 16}), 4, 2, False, "fp32"),
]
# WikiText-103 shapes (configs/wt103-*.yaml) with 4 of the 16 layers and 2 rows per rank
# (data.global_batch 64 on 32 ranks): the full 267,735-word adaptive softmax and embedding.
WT103 = dict(vocab_size=267735, n_layer=4, d_model=410, n_head=10, d_head=41, d_inner=2100,
             tgt_len=150, mem_len=150, dropout=0.1, cutoffs=[20000, 40000, 200000],
             tie_projs=[False, True, True, True])
CASES += [
    ("wt103-shape xl k=1", dict(WT103, mechanism="xl"), 2, 1, False, "fp32"),
    ("wt103-shape rmt k=2 ckpt-seg", dict(WT103, mechanism="rmt", mem_len=0,
                                          rmt={"num_mem_tokens": 10}), 2, 2, True, "fp32"),
]
# Selective recompute (bptt.recompute, keep_last_segments; planner/recompute.py): the
# checkpointed segments keep op outputs too. (label, ..., {recompute, keep_last}).
RMT16 = _small(mechanism="rmt", mem_len=0, rmt={"num_mem_tokens": 16})
CASES += [
    ("rmt k=3 save-masks", RMT16, 4, 3, True, "fp32", {"recompute": "save-masks"}),
    ("rmt k=3 masks+ffn-out:2 last1", RMT16, 4, 3, True, "fp32",
     {"recompute": "save-masks+ffn-out:2", "keep_last": 1}),
    ("rmt k=3 save-linear", RMT16, 4, 3, True, "fp32", {"recompute": "save-linear"}),
    ("rmt k=3 save-matmul last1", RMT16, 4, 3, True, "fp32",
     {"recompute": "save-matmul", "keep_last": 1}),
    ("xl M=128 k=3 ffn-out last2", _small(mechanism="xl", mem_len=128), 4, 3, True, "fp32",
     {"recompute": "save-ffn-out", "keep_last": 2}),
    ("xl adaptive k=2 save-linear", _small(mechanism="xl", vocab_size=2000, div_val=2,
                                           cutoffs=[200, 600, 1200]), 4, 2, True, "fp32",
     {"recompute": "save-linear"}),
    ("lamemo M=64 k=2 save-matmul", _small(mechanism="lamemo"), 4, 2, True, "fp32",
     {"recompute": "save-matmul"}),
    ("lamemo M=64 k=2 masks+ffn-out", _small(mechanism="lamemo", dropatt=0.1), 4, 2, True,
     "fp32", {"recompute": "save-masks+ffn-out"}),
]
QUICK = ("xl M=64 k=0", "lamemo M=64 k=0", "rmt m=16 k=0")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="three small rows only")
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--only", help="only the rows whose label contains this text")
    ap.add_argument("--compile", action="store_true",
                    help="also measure each row's peak with the decoder stack compiled")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows_out = []
    print(f"{'config':<28} {'pred saved MB':>13} {'meas saved MB':>13} {'err':>7} "
          f"{'pred peak MB':>12} {'meas peak MB':>12} {'err':>7}"
          + (f" {'compiled MB':>12} {'vs eager':>7}" if args.compile else ""), flush=True)
    for label, kw, rows, depth, ckpt, prec, *window in CASES:
        if (args.quick and label not in QUICK) or (args.only and args.only not in label):
            continue
        window = window[0] if window else {}
        cfg = ModelConfig(**kw)
        t0 = time.process_time()
        got = measure(cfg, rows, depth, ckpt, prec, **window)
        want = predict(cfg, rows, depth, ckpt, prec, **window)
        r = {"config": label, "rows": rows, "depth": depth, "checkpoint_segments": ckpt,
             "precision": prec, **window, **{f"pred_{k}": v for k, v in want.items()},
             **{f"meas_{k}": v for k, v in got.items()}, "cpu_s": time.process_time() - t0}
        r["err_peak"] = (want["peak"] - got["peak"]) / got["peak"]
        compiled = ""
        if args.compile and window.get("recompute", "full") == "full":
            comp = measure(cfg, rows, depth, ckpt, prec, **window, compiled=True)
            r["meas_peak_compiled"], r["compiled_graphs"] = comp["peak"], comp["graphs"]
            r["compiled_vs_eager"] = r["meas_peak_compiled"] / got["peak"]
            compiled = (f" {r['meas_peak_compiled'] / 1e6:>12.2f} "
                        f"{100 * (r['compiled_vs_eager'] - 1):>+6.1f}%")
        # Checkpointed regions save through their own hooks: the saved column would not
        # see them (the kept inputs are not saved tensors), so it is left empty.
        hidden = ckpt or cfg.checkpoint_layers
        r["err_saved"] = None if hidden else (want["saved"] - got["saved"]) / got["saved"]
        rows_out.append(r)
        saved = ("" if hidden else
                 f"{want['saved'] / 1e6:>13.2f} {got['saved'] / 1e6:>13.2f} "
                 f"{100 * r['err_saved']:>+6.1f}%")
        print(f"{label:<28} {saved:<35} {want['peak'] / 1e6:>12.2f} "
              f"{got['peak'] / 1e6:>12.2f} {100 * r['err_peak']:>+6.1f}%{compiled}",
              flush=True)
    worst = max(abs(r["err_peak"]) for r in rows_out)
    print(f"worst peak error {100 * worst:.1f}% over {len(rows_out)} configurations "
          f"(goal: within 15%)")
    ratios = [r["compiled_vs_eager"] for r in rows_out if "compiled_vs_eager" in r]
    if ratios:
        print(f"compiled peak / eager peak: {min(ratios):.2f}-{max(ratios):.2f} over "
              f"{len(ratios)} configurations (the plan counts eager's)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": datetime.date.today().isoformat(),
                       "torch": torch.__version__, "rows": rows_out}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
