"""BPTT depth: peak memory and throughput of RMT windows; XL / LaMemo memory vs mem_len.

    python benchmarks/bench_bptt.py --parts memory,lm-memory \
        --json benchmarks/results/bptt_memory.json
    python benchmarks/bench_bptt.py --parts speed --rounds 5 \
        --json benchmarks/results/bptt_speed.json
    python benchmarks/bench_bptt.py --quick                     # smoke check, < 60 s

Selective recompute policies (time and memory per `bptt.recompute`): bench_recompute.py,
which steps the same RMTRunner and measures memory in the same children.

Parts (single process, bare model, no DeepSpeed; `train.bptt.run_window` as the engine runs
it, the model called directly):

  memory     peak memory of one RMT training step (run_window + backward) vs depth k, in
             window mode (k+1 segments, all counted) and sliding mode (k re-run segments + 1
             new, only the last counted), with and without checkpoint_segments.
  speed      tokens/s (NEW tokens per CPU-second) of window mode at k = 0,1,2,4 with and
             without checkpointing, and of sliding mode; all variants interleaved round by
             round in one process. The checkpointing overhead at k=4 is the median of the
             per-round ratios time(ckpt) / time(plain). A step here includes the Adam update.
  lm-memory  XL and LaMemo peak memory of one segment's forward + backward with a full memory
             of mem_len, with and without per-layer checkpointing (checkpoint_layers).

Memory: every variant runs in a fresh subprocess with MALLOC_MMAP_THRESHOLD_=65536 (freed
blocks leave the RSS); it makes one warm-up step (first-call allocations, allocator pools),
reads VmRSS, resets VmHWM (/proc/self/clear_refs), makes ONE measured step, and reports
VmHWM - VmRSS_before (on CUDA: torch.cuda.max_memory_allocated above the memory allocated
before). The step is forward + backward + zero_grad(set_to_none); no optimizer update
(Adam's state and its temporaries would add a constant that is not BPTT's), so the figure is
activations + gradients. Time: process CPU time (robust to hypervisor steal); on CUDA wall
time up to the device's end (common.step_clock).
"""


from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time

import common
import torch
from common import (
    add_device_args,
    add_model_size_args,
    finish,
    interleaved,
    model_dtype,
    status_kib,
    step_clock,
    timed_step,
)

from data_pipeline.streams import SegmentBatch
from model import ModelConfig, build_model
from train.bptt import run_window


def model_config(a, mechanism: str, mem_len: int, ckpt_layers: bool = False) -> ModelConfig:
    return ModelConfig(mechanism=mechanism, vocab_size=a.vocab, n_layer=a.n_layer,
                       d_model=a.d_model, n_head=a.n_head, d_inner=a.d_inner,
                       dropout=a.dropout, tgt_len=a.seg_len, mem_len=mem_len,
                       checkpoint_layers=ckpt_layers,
                       rmt={"num_mem_tokens": a.num_mem_tokens})


class RMTRunner:
    """An RMT model stepping over random segments: one window per step, memory carried."""

    def __init__(self, a, mode: str, k: int, ckpt: bool, optimizer: bool, seed: int = 0,
                 recompute: str = "full", keep_last: int = 0):
        torch.manual_seed(seed)
        self.device = torch.device(a.device)
        self.model = build_model(model_config(a, "rmt", 0)).train().to(
            self.device, model_dtype(a))
        self.clock = step_clock(self.device)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-4) if optimizer else None
        self.a, self.mode, self.k, self.ckpt = a, mode, k, ckpt
        self.recompute, self.keep_last = recompute, keep_last
        self.data = torch.randint(0, a.vocab, (a.batch, 40 * a.seg_len + 1))
        self.pos, self.state = 0, None
        self.sys_s: list[float] = []   # kernel CPU time of each step (page faults mostly)

    def _segments(self) -> list[SegmentBatch]:
        a, n = self.a, self.k + 1
        if self.pos + n * a.seg_len + 1 > self.data.shape[1]:
            self.pos = 0
        segs = [SegmentBatch(self.data[:, self.pos + j * a.seg_len:
                                       self.pos + (j + 1) * a.seg_len + 1],
                             torch.zeros(a.batch, dtype=torch.bool), None, 0, j)
                for j in range(n)]
        # window: k+1 new segments; sliding: the stream moves on by one segment per step.
        self.pos += a.seg_len * (n if self.mode == "window" else 1)
        return segs

    def step(self) -> float:
        segs = self._segments()
        counted = None if self.mode == "window" else [False] * self.k + [True]
        start, kernel = self.clock(), resource.getrusage(resource.RUSAGE_SELF).ru_stime
        res = run_window(self.model, self.state, segs, self.device, counted=counted,
                         checkpoint_segments=self.ckpt, recompute=self.recompute,
                         keep_last_segments=self.keep_last)
        res.loss.backward()
        if self.opt is not None:
            self.opt.step()
        elapsed = self.clock() - start
        self.sys_s.append(resource.getrusage(resource.RUSAGE_SELF).ru_stime - kernel)
        self.model.zero_grad(set_to_none=True)
        # Sliding mode would restart from the memory saved k steps ago; any detached memory
        # of the same shape costs the same, so both modes carry the window's final memory.
        self.state = res.state
        return elapsed

    def new_tokens(self) -> int:
        n = self.k + 1 if self.mode == "window" else 1
        return n * self.a.seg_len * self.a.batch


class LMRunner:
    """XL / LaMemo with a full memory: one step = one segment's forward + backward."""

    def __init__(self, a, mechanism: str, mem_len: int, ckpt: bool, seed: int = 0):
        torch.manual_seed(seed)
        self.model = build_model(model_config(a, mechanism, mem_len, ckpt)).train()
        self.a = a
        self.data = torch.randint(0, a.vocab, (a.lm_batch, 4 * a.seg_len + 1))
        self.state = None
        with torch.no_grad():  # fill the memory to mem_len; the model returns it detached
            for _ in range(-(-mem_len // a.seg_len)):
                self.state = self.model(self.data[:, :a.seg_len], self.state).state

    def step(self) -> float:
        elapsed, self.state = timed_step(self.model, self.data[:, :self.a.seg_len + 1],
                                         self.state)
        return elapsed


# ----------------------------------------------------------------------------- memory
def memory_child(a) -> None:
    spec = json.loads(a._child)
    if spec["kind"] == "rmt":
        runner = RMTRunner(a, spec["mode"], spec["k"], spec["ckpt"], optimizer=False,
                           recompute=spec.get("recompute", "full"),
                           keep_last=spec.get("keep_last", 0))
    else:
        runner = LMRunner(a, spec["mech"], spec["mem_len"], spec["ckpt"])
    runner.step()  # warm-up: first-call allocations are not the step's
    if a.device != "cpu":
        torch.cuda.synchronize(a.device)
        torch.cuda.reset_peak_memory_stats(a.device)
        before = torch.cuda.memory_allocated(a.device)
        step_s = runner.step()
        peak = torch.cuda.max_memory_allocated(a.device) - before
        print(json.dumps({"peak_mb": peak / 2**20, "base_mb": before / 2**20,
                          "step_s": step_s}))
        return
    before = status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    cpu_s = runner.step()
    print(json.dumps({"peak_mb": (status_kib("VmHWM") - before) / 1024,
                      "base_rss_mb": before / 1024, "step_cpu_s": cpu_s}))


SIZE_FLAGS = ("n_layer", "d_model", "n_head", "d_inner", "seg_len", "num_mem_tokens", "batch",
              "lm_batch", "vocab", "dropout", "threads", "device", "dtype")


def run_child(a, spec: dict) -> dict:
    return common.run_child(__file__, a, spec, SIZE_FLAGS)


def measure_rmt_memory(a) -> dict:
    out = {}
    for mode in ("window", "sliding"):
        for ckpt in (False, True):
            name = f"{mode}-{'ckpt' if ckpt else 'plain'}"
            series = {k: run_child(a, {"kind": "rmt", "mode": mode, "k": k, "ckpt": ckpt})
                      for k in a.depths}
            k1 = series[a.depths[0]]["peak_mb"]
            for r in series.values():
                r["ratio_vs_first_k"] = r["peak_mb"] / k1
            out[name] = series
            print(f"  {name:<16}" + "  ".join(f"k={k}: {r['peak_mb']:.0f} MB "
                                              f"({r['ratio_vs_first_k']:.2f}x)"
                                              for k, r in series.items()), flush=True)
    return out


def measure_lm_memory(a) -> dict:
    out = {}
    for mech in ("xl", "lamemo"):
        for ckpt in (False, True):
            name = f"{mech}-{'ckpt_layers' if ckpt else 'plain'}"
            out[name] = {m: run_child(a, {"kind": "lm", "mech": mech, "mem_len": m,
                                          "ckpt": ckpt}) for m in a.mem_lens}
            print(f"  {name:<20}" + "  ".join(f"M={m}: {r['peak_mb']:.0f} MB"
                                              for m, r in out[name].items()), flush=True)
    return out


# ----------------------------------------------------------------------------- speed
def measure_speed(a) -> dict:
    variants = {}
    for k in a.speed_depths:
        for ckpt in (False, True):
            variants[f"window-k{k}-{'ckpt' if ckpt else 'plain'}"] = ("window", k, ckpt)
        if k > 0:
            variants[f"sliding-k{k}-plain"] = ("sliding", k, False)
    runners = {n: RMTRunner(a, *v, optimizer=True) for n, v in variants.items()}
    for r in runners.values():
        r.step()  # warm-up
    times = interleaved({n: r.step for n, r in runners.items()}, a.rounds,
                        lambda rnd: print(f"  round {rnd + 1}/{a.rounds} done", flush=True))
    base = times["window-k0-plain"]
    out = {"variants": {}}
    for n, ts in times.items():
        out["variants"][n] = {
            "median_cpu_s_per_step": statistics.median(ts), "cpu_s": ts,
            "tokens_per_s": runners[n].new_tokens() / statistics.median(ts),
            # per-round ratio of new-token rates against window k=0 without checkpointing
            "tps_ratio_vs_k0_plain": statistics.median(
                (runners[n].new_tokens() / t) / (runners["window-k0-plain"].new_tokens() / b)
                for t, b in zip(ts, base, strict=True))}
    kmax = max(a.speed_depths)
    for k in a.speed_depths:
        p, c = times[f"window-k{k}-plain"], times[f"window-k{k}-ckpt"]
        out[f"ckpt_overhead_k{k}"] = statistics.median(x / y for x, y in zip(c, p, strict=True))
    out["ckpt_overhead_kmax"] = out[f"ckpt_overhead_k{kmax}"]
    return out


def print_shape(a) -> None:
    print(f"torch {torch.__version__}, {a.device}, {a.threads} thread(s); {a.n_layer} layers, "
          f"d_model {a.d_model}, {a.n_head} heads, d_inner {a.d_inner}, segment {a.seg_len}, "
          f"RMT {a.num_mem_tokens} memory tokens, batch {a.batch} (XL/LaMemo: {a.lm_batch}), "
          f"vocab {a.vocab}, dropout {a.dropout}, {a.dtype}", flush=True)


def add_rmt_args(p) -> None:
    """The shape and machine flags of this script and bench_recompute.py (and of the
    children both start)."""
    add_model_size_args(p)
    p.add_argument("--seg-len", type=int, default=128)
    p.add_argument("--num-mem-tokens", type=int, default=16)
    p.add_argument("--batch", type=int, default=8, help="rows of the RMT parts")
    p.add_argument("--lm-batch", type=int, default=4, help="rows of the XL/LaMemo part")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--threads", type=int, default=1)
    add_device_args(p)
    p.add_argument("--json", help="write every figure to this file")
    p.add_argument("--_child", help=argparse.SUPPRESS)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_rmt_args(p)
    p.add_argument("--depths", default="1,2,4,8,16", help="k of the memory part")
    p.add_argument("--speed-depths", default="0,1,2,4", help="k of the speed part")
    p.add_argument("--mem-lens", default="128,256,512,1024,2048", help="lm-memory part")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (speed)")
    p.add_argument("--parts", default="memory,speed,lm-memory",
                   help="of memory, speed, lm-memory")
    p.add_argument("--quick", action="store_true", help="tiny sizes, few variants (smoke)")
    a = p.parse_args(argv)
    if a.quick and not a._child:
        a.n_layer, a.d_model, a.d_inner, a.seg_len, a.batch, a.lm_batch = 2, 64, 256, 32, 2, 2
        a.depths, a.speed_depths, a.mem_lens, a.rounds = "1,4", "0,2", "64", 2
    torch.set_num_threads(a.threads)
    a.depths = [int(x) for x in str(a.depths).split(",")]
    a.speed_depths = [int(x) for x in str(a.speed_depths).split(",")]
    a.mem_lens = [int(x) for x in str(a.mem_lens).split(",")]
    if a._child:
        memory_child(a)
        return 0
    parts = a.parts.split(",")
    if a.device != "cpu" and "lm-memory" in parts:
        p.error("the lm-memory part measures the CPU only (process RSS)")
    t0 = time.time()
    print_shape(a)
    results = {"args": {k: v for k, v in vars(a).items() if k != "_child"}}
    if "memory" in parts:
        print("RMT peak MB of one step (ratio to the first k):", flush=True)
        results["rmt_memory"] = measure_rmt_memory(a)
        kmax, k1 = max(a.depths), a.depths[0]
        for mode in ("window", "sliding"):
            r = results["rmt_memory"][f"{mode}-ckpt"][kmax]["ratio_vs_first_k"]
            print(f"GOAL {mode}, checkpointed: peak(k={kmax}) / peak(k={k1}) = {r:.2f}x "
                  f"(<= 1.5x: {'met' if r <= 1.5 else 'NOT met'})")
    if "speed" in parts:
        print(f"RMT tokens/s, {a.rounds} interleaved rounds:", flush=True)
        sp = results["speed"] = measure_speed(a)
        for n, r in sp["variants"].items():
            print(f"  {n:<22}{r['tokens_per_s']:>8.0f} new tokens/CPU-s  "
                  f"{r['tps_ratio_vs_k0_plain']:.2f}x of window-k0-plain")
        kmax = max(a.speed_depths)
        for ck in ("plain", "ckpt"):
            r = sp["variants"][f"window-k{kmax}-{ck}"]["tps_ratio_vs_k0_plain"]
            print(f"GOAL window k={kmax} {ck} vs k=0 plain: {r:.2f}x "
                  f"(>= 0.6x: {'met' if r >= 0.6 else 'NOT met'})")
        r = sp["ckpt_overhead_kmax"]
        print(f"GOAL checkpoint overhead, window k={kmax}: {r:.2f}x "
              f"(<= 1.4x: {'met' if r <= 1.4 else 'NOT met'})")
    if "lm-memory" in parts:
        print(f"XL / LaMemo peak MB of one step with a full memory (batch {a.lm_batch}):",
              flush=True)
        results["lm_memory"] = measure_lm_memory(a)
    return finish(a.json, results, t0)


if __name__ == "__main__":
    sys.exit(main())
