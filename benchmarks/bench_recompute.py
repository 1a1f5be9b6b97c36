"""Selective recompute for BPTT windows: step time and peak memory per `bptt.recompute`.

    python benchmarks/bench_recompute.py --parts profile,recompute --keep-last 0,1 \
        --json benchmarks/results/selective_recompute.json   # (exact commands: BENCHMARKS.md)
    python benchmarks/bench_recompute.py --quick                 # smoke check, < 2 min
    python benchmarks/bench_recompute.py --parts recompute --device cuda --dtype bf16 \
        --policies full,save-ffn-out:2,save-linear --keep-last 1   # on a GPU (not run here)

The RMT of bench_bptt.py (its RMTRunner: `train.bptt.run_window` over k+1 segments, one
backward, the bare model, no DeepSpeed). Until 2026-11-24 these parts were
`bench_bptt.py --parts profile,recompute`, with the same flags.

Parts:
  profile    where a checkpointed step's extra time goes: per-op CPU time (a dispatch mode)
             of window k=1 steps under each --policies value minus the plain step's (CPU).
  recompute  per bptt.recompute x bptt.keep_last_segments variant: step time / plain step
             time at --recompute-time-depths (variants interleaved step by step, rotated each
             round, with Adam; medians of per-round ratios; on the CPU also in user CPU time,
             without the kernel's page faults) and peak memory at --recompute-memory-depths
             (a fresh child process per variant, as bench_bptt.py's memory part).

On CUDA (--device cuda) dropout is one fused kernel (`native_dropout`): save-masks has no
draws to keep there and re-draws them like `full` (README, "Selective recompute").
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time

import torch
from bench_bptt import RMTRunner, add_rmt_args, print_shape, run_child
from common import finish, interleaved
from torch.utils._python_dispatch import TorchDispatchMode


def recompute_variants(a) -> dict:
    """name -> (checkpoint_segments, bptt.recompute, bptt.keep_last_segments)."""
    out = {"plain": (False, "full", 0)}
    for pol in a.policies:
        for keep in a.keep_last:
            out[pol + (f"+last{keep}" if keep else "")] = (True, pol, keep)
    return out


class OpTimer(TorchDispatchMode):
    """Process CPU time per aten op (what a checkpoint's cache skips never reaches it)."""

    def __init__(self):
        super().__init__()
        self.cpu_s: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = time.process_time()
        out = func(*args, **(kwargs or {}))
        self.cpu_s[func.overloadpacket.__name__] += time.process_time() - start
        return out


def profile_recompute(a) -> dict:
    """Where a checkpointed step's extra time goes: per-op CPU time of window k=1 steps
    (no optimizer) minus the plain step's, variants interleaved over the rounds."""
    variants = {n: v for n, v in recompute_variants(a).items() if not v[2]}
    runners = {n: RMTRunner(a, "window", 1, ck, optimizer=False, recompute=pol)
               for n, (ck, pol, _) in variants.items()}
    for r in runners.values():
        r.step()
    per_op = {n: collections.Counter() for n in runners}
    for _ in range(a.rounds):
        for n, r in runners.items():
            timer = OpTimer()
            with timer:
                r.step()
            per_op[n].update(timer.cpu_s)
    base = per_op["plain"]
    out = {}
    for n, ops in per_op.items():
        extra = {op: (ops[op] - base[op]) / a.rounds for op in set(ops) | set(base)}
        total = sum(extra.values())
        out[n] = {"step_cpu_s": sum(ops.values()) / a.rounds, "extra_cpu_s": total,
                  "extra_by_op": dict(sorted(extra.items(), key=lambda kv: -kv[1])[:12])}
        if n != "plain":
            top = ", ".join(f"{op} {v / total:.0%}" for op, v in
                            list(out[n]["extra_by_op"].items())[:6])
            print(f"  {n:<19} step {out[n]['step_cpu_s']:.2f} s, extra {total:.2f} s "
                  f"({total / out['plain']['step_cpu_s']:.0%} of plain): {top}", flush=True)
    return out


def measure_recompute(a) -> dict:
    """Per variant: time / plain time at each depth (interleaved, medians of per-round
    ratios; a step includes Adam) and peak memory at each memory depth (fresh process)."""
    variants = recompute_variants(a)
    out = {"time": {}, "memory": {}}
    for k in a.recompute_time_depths:
        runners = {n: RMTRunner(a, "window", k, ck, optimizer=True, recompute=pol,
                                keep_last=keep) for n, (ck, pol, keep) in variants.items()}
        for r in runners.values():
            r.step()
        times = interleaved({n: r.step for n, r in runners.items()}, a.rounds,
                            lambda rnd, k=k: print(f"  k={k}: round {rnd + 1}/{a.rounds} "
                                                   "done", flush=True))
        # user CPU time leaves out the kernel's page faults, which glibc's freeing of large
        # blocks makes a CPU-only cost of the step that holds the most memory (plain). On
        # CUDA the times are wall times: nothing to split.
        user = {n: [t - s for t, s in zip(ts, runners[n].sys_s[1:], strict=True)]
                for n, ts in times.items()} if a.device == "cpu" else times
        del runners
        clock = "cpu_s" if a.device == "cpu" else "wall_s"
        out["time"][k] = {n: {clock: ts, "user_cpu_s": user[n], "ratio_vs_plain":
                              statistics.median(t / b for t, b in zip(ts, times["plain"],
                                                                      strict=True)),
                              "user_ratio_vs_plain": statistics.median(
                                  t / b for t, b in zip(user[n], user["plain"], strict=True))}
                          for n, ts in times.items()}
    if not a.recompute_memory_depths:   # --recompute-memory-depths "": the times alone
        return out
    for n, (ck, pol, keep) in variants.items():
        out["memory"][n] = {k: run_child(a, {"kind": "rmt", "mode": "window", "k": k,
                                             "ckpt": ck, "recompute": pol, "keep_last": keep})
                            for k in a.recompute_memory_depths}
    k1, kn = a.recompute_memory_depths[0], a.recompute_memory_depths[-1]
    for n in variants:
        mem = out["memory"][n]
        mem["ratio"] = mem[kn]["peak_mb"] / mem[k1]["peak_mb"]
        times = "  ".join(f"time k={k}: {out['time'][k][n]['ratio_vs_plain']:.2f}x (user "
                          f"{out['time'][k][n]['user_ratio_vs_plain']:.2f}x)"
                          for k in a.recompute_time_depths)
        print(f"  {n:<25}{times}  peak k={k1}: {mem[k1]['peak_mb']:.0f} MB, k={kn}: "
              f"{mem[kn]['peak_mb']:.0f} MB ({mem['ratio']:.2f}x)", flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_rmt_args(p)
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    p.add_argument("--policies", default="full,save-ffn-out,save-linear,save-matmul",
                   help="bptt.recompute values")
    p.add_argument("--keep-last", default="0,1", help="bptt.keep_last_segments values")
    p.add_argument("--recompute-time-depths", default="4", help="k of the step times")
    p.add_argument("--recompute-memory-depths", default="1,16",
                   help='k of the peaks ("": no memory part)')
    p.add_argument("--parts", default="recompute", help="of profile, recompute")
    p.add_argument("--quick", action="store_true", help="tiny sizes, few variants (smoke)")
    a = p.parse_args(argv)
    if a.quick:
        a.n_layer, a.d_model, a.d_inner, a.seg_len, a.batch, a.rounds = 2, 64, 256, 32, 2, 2
        a.policies, a.recompute_time_depths, a.recompute_memory_depths = (
            "full,save-masks+ffn-out:1", "2", "1,4")
    parts = a.parts.split(",")
    if a.device != "cpu" and "profile" in parts:
        p.error("the profile part times CPU work only; leave it out with --device")
    torch.set_num_threads(a.threads)
    a.policies = str(a.policies).split(",")
    a.keep_last, a.recompute_time_depths, a.recompute_memory_depths = (
        [int(x) for x in str(v).split(",") if x] for v in
        (a.keep_last, a.recompute_time_depths, a.recompute_memory_depths))
    t0 = time.time()
    print_shape(a)
    results = {"args": {k: v for k, v in vars(a).items() if k != "_child"}}
    if "profile" in parts:
        print(f"extra CPU time of a checkpointed window k=1 step over the plain one, by op "
              f"({a.rounds} rounds):", flush=True)
        results["profile"] = profile_recompute(a)
    if "recompute" in parts:
        print("selective recompute: step time / plain step time, peak MB:", flush=True)
        rc = results["recompute"] = measure_recompute(a)
        if not rc["memory"]:
            return finish(a.json, results, t0)
        kt, k1, kn = (max(a.recompute_time_depths), a.recompute_memory_depths[0],
                      a.recompute_memory_depths[-1])
        for n in list(rc["memory"])[1:]:   # the checkpointed ones
            t, m = rc["time"][kt][n]["ratio_vs_plain"], rc["memory"][n]["ratio"]
            ok = t <= 1.25 and m <= 1.5
            print(f"GOAL {n}: time k={kt} {t:.2f}x (<= 1.25x), peak k={kn} / k={k1} {m:.2f}x "
                  f"(<= 1.5x): {'met' if ok else 'NOT met'}")
    return finish(a.json, results, t0)


if __name__ == "__main__":
    sys.exit(main())
