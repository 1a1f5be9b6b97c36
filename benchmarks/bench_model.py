"""Forward+backward speed and peak memory of each mechanism, fused vs plain attention.

    python benchmarks/bench_model.py                 # the "small" model, all variants
    python benchmarks/bench_model.py --rounds 3      # quicker, noisier

Speed: every variant lives in one process and the rounds interleave them (A B C ... A B C),
so a slow patch of a shared machine hits all variants alike; the ratios against XL-fused are
taken round by round and their median is reported. Memory: each variant runs again in a
fresh subprocess, and the growth of peak RSS over the RSS measured just before the first
step is the activation + gradient footprint of one training step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

import torch
from common import add_model_size_args, interleaved, status_kib, timed_step

from model import ModelConfig, build_model

MECHANISMS = ("xl", "lamemo", "rmt", "armt", "titans")
# Memory without an XL cache: memory tokens, or (Titans) a neural memory per layer.
NO_CACHE = ("rmt", "armt", "titans")


def make_config(args, mechanism: str, impl: str) -> ModelConfig:
    # RMT / ARMT / Titans alone: no XL cache beside their memory.
    mem_len = 0 if mechanism in NO_CACHE else args.mem_len
    return ModelConfig(mechanism=mechanism, vocab_size=args.vocab, n_layer=args.n_layer,
                       d_model=args.d_model, n_head=args.n_head, d_inner=args.d_inner,
                       dropout=args.dropout, tgt_len=args.seg_len, mem_len=mem_len,
                       attn_impl=impl, rmt={"num_mem_tokens": args.num_mem_tokens},
                       armt={"d_key": args.d_key}, titans={"d_mem": args.d_mem})


class Runner:
    """One model and its carried memory; `step()` is one segment's forward + backward."""

    def __init__(self, args, mechanism: str, impl: str, seed: int = 0):
        torch.manual_seed(seed)
        cfg = make_config(args, mechanism, impl)
        self.model = build_model(cfg).train()
        self.args = args
        self.data = torch.randint(0, args.vocab, (args.batch, 64 * (args.seg_len + 1)))
        self.state, self.pos = None, 0

    def step(self) -> float:
        a = self.args
        if self.pos + a.seg_len + 1 > self.data.shape[1]:
            self.pos, self.state = 0, None
        seg = self.data[:, self.pos:self.pos + a.seg_len + 1]
        self.pos += a.seg_len
        elapsed, self.state = timed_step(self.model, seg, self.state)
        return elapsed


def variants(args) -> list[tuple[str, str]]:
    return [(m, i) for m in args.mechanisms for i in ("fused", "plain")]


def measure_speed(args) -> dict:
    runners = {f"{m}-{i}": Runner(args, m, i) for m, i in variants(args)}
    for r in runners.values():  # warm-up: fills the memory to mem_len, first-call costs
        for _ in range(max(2, -(-args.mem_len // args.seg_len) + 1)):
            r.step()
    times = interleaved({k: r.step for k, r in runners.items()}, args.rounds)
    tokens = args.batch * args.seg_len
    base = times["xl-fused"]
    out = {}
    for name, ts in times.items():
        ratios = [t / b for t, b in zip(ts, base, strict=True)]
        out[name] = {"median_s_per_step": statistics.median(ts),
                     "tokens_per_s": tokens / statistics.median(ts),
                     "time_ratio_vs_xl_fused": statistics.median(ratios),
                     "params": runners[name].model.num_params()}
    return out


def measure_memory(args, mechanism: str, impl: str) -> float:
    """MB of peak-RSS growth during training steps, in a fresh process."""
    cmd = [sys.executable, __file__, "--_memory-child", f"{mechanism},{impl}",
           *[f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
             if k not in ("json", "rounds", "memory", "_memory_child", "only", "steps",
                          "mechanisms")]]
    # Large blocks through mmap: freed memory leaves the RSS at once, so the RSS between
    # steps is the true baseline and the high-water mark is the step's own peak.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    res = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    return float(res.stdout.strip().splitlines()[-1])


def memory_child(args) -> None:
    """Peak RSS growth over a few steps. Not ru_maxrss: Linux carries that high-water mark
    across fork + exec, so a child of a large parent starts at the parent's peak. VmHWM
    belongs to this address space and clear_refs resets it."""
    mechanism, impl = args._memory_child.split(",")
    runner = Runner(args, mechanism, impl)
    runner.step()  # first-call allocations (thread pools, caches) are not the step's
    before = status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    for _ in range(3):
        runner.step()
    print((status_kib("VmHWM") - before) / 1024)


def ratio_line(speed: dict, new: str, old: str, memory: bool) -> str:
    """'NEW / OLD, best of each: time per token ...x[, peak memory ...x]'."""
    def best(m, key):
        return min(speed[f"{m}-{i}"][key] for i in ("fused", "plain"))
    names = {"armt": "ARMT", "rmt": "RMT", "titans": "Titans"}
    time = best(new, "median_s_per_step") / best(old, "median_s_per_step")
    line = f"{names[new]} / {names[old]}, best of each: time per token {time:.2f}x"
    if memory:
        line += f", peak memory {best(new, 'peak_mb') / best(old, 'peak_mb'):.2f}x"
    return line


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_size_args(p)
    p.add_argument("--seg-len", type=int, default=128)
    p.add_argument("--mem-len", type=int, default=128)
    p.add_argument("--num-mem-tokens", type=int, default=16)
    p.add_argument("--d-key", type=int, default=64, help="ARMT's key width (model.armt.d_key)")
    p.add_argument("--d-mem", type=int, default=64,
                   help="Titans' memory width (model.titans.d_mem)")
    p.add_argument("--mechanisms", default=",".join(MECHANISMS),
                   help="which to run, comma-separated (xl is the ratios' base: always run)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument("--only", metavar="MECH-IMPL",
                   help="run just this variant for --steps steps and exit (for timing whole "
                        "processes from outside, e.g. with /usr/bin/time)")
    p.add_argument("--steps", type=int, default=10, help="steps of --only")
    p.add_argument("--_memory-child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.mechanisms = ["xl", *(m for m in args.mechanisms.split(",") if m and m != "xl")]
    unknown = sorted(set(args.mechanisms) - set(MECHANISMS))
    if unknown:
        p.error(f"--mechanisms: unknown {', '.join(unknown)}; choose from {MECHANISMS}")
    torch.set_num_threads(args.threads)
    if args._memory_child:
        memory_child(args)
        return 0
    if args.only:
        runner = Runner(args, *args.only.split("-"))
        for _ in range(args.steps):
            runner.step()
        return 0

    speed = measure_speed(args)
    print(f"torch {torch.__version__}, {args.threads} threads; {args.n_layer} layers, d_model "
          f"{args.d_model}, {args.n_head} heads, d_inner {args.d_inner}, segment "
          f"{args.seg_len}, memory {args.mem_len} (RMT, ARMT: {args.num_mem_tokens} tokens, "
          f"ARMT d_key {args.d_key}), batch "
          f"{args.batch}, dropout {args.dropout}, fp32; {args.rounds} interleaved rounds")
    print(f"{'variant':<15}{'tokens/s':>10}{'s/step':>9}{'time vs xl-fused':>18}"
          f"{'peak MB':>9}")
    print("(s/step = CPU seconds of the process per step, summed over its threads)")
    for name, r in speed.items():
        if args.memory:
            r["peak_mb"] = measure_memory(args, *name.split("-"))
        mem = f"{r['peak_mb']:>9.0f}" if args.memory else ""
        print(f"{name:<15}{r['tokens_per_s']:>10.0f}{r['median_s_per_step']:>9.3f}"
              f"{r['time_ratio_vs_xl_fused']:>18.2f}{mem}")
    def best(m):
        return min(speed[f"{m}-{i}"]["median_s_per_step"] for i in ("fused", "plain"))
    if "lamemo" in args.mechanisms:
        print(f"LaMemo (fused) time per token / best XL: "
              f"{speed['lamemo-fused']['median_s_per_step'] / best('xl'):.2f}x (goal <= 1.25x)")
    for new, old in (("armt", "rmt"), ("titans", "armt")):
        if {new, old} <= set(args.mechanisms):
            print(ratio_line(speed, new, old, args.memory))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": speed}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
