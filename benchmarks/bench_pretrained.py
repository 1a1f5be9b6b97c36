"""Pretrained backbone: segment checkpointing vs a full unroll, and the memory tokens' cost.

    python benchmarks/bench_pretrained.py --json benchmarks/results/pretrained_ckpt_unroll.json
    python benchmarks/bench_pretrained.py --quick                # smoke check, < 2 min

A tiny random causal LM is built from a config (Llama by default: RoPE, grouped-query
attention, RMSNorm, SwiGLU; or --arch gpt2), written with `save_pretrained` to a temporary
directory and loaded back through `model.hf.path` as `PretrainedMemoryLM` with
--num-mem-tokens m (model/pretrained/wrapper.py). Random tokens; every window starts from
a fresh memory (full BPTT over its n segments, one backward per window, as
`train.bptt.run_window` runs it for the engine). Variants:

  ckpt     run_window(..., checkpoint_segments=True): each segment keeps only its inputs
           (tokens and the incoming memory rows) and is recomputed in the backward.
  unroll   run_window(..., checkpoint_segments=False): every segment's graph is kept until
           the one backward, the way the RMT authors' code trains (it unrolls the segments
           through the model and backpropagates once through all of them).
  base     the same checkpoint with num_mem_tokens 0 (exactly the base model, no mask, no
           memory): the same n segments of L tokens, each an independent forward + backward
           (gradients accumulated, loss / n), one optimizer update per n segments.
  --recompute POLICY[+lastN],...   more checkpointed variants, what a run config sets with
           `bptt.recompute: POLICY` and `bptt.keep_last_segments: N` (run_window's
           recompute= and keep_last_segments=; train/recompute.py): e.g. full+last1 (only
           the last segment not checkpointed), save-ffn-out:1, save-linear+last1. Measured
           in both parts at the same n as ckpt and unroll.

Parts:
  memory   peak memory of one step (n segments forward + one backward + zero_grad, no
           optimizer update) vs n, for ckpt and unroll; a fresh subprocess per (variant, n)
           with MALLOC_MMAP_THRESHOLD_=65536 (freed blocks leave the RSS). The child makes a
           warm-up step of min(n, 2) segments (first-call allocations; same shapes), reads
           VmRSS, resets VmHWM (/proc/self/clear_refs) and reports VmHWM - VmRSS over one
           step: activations + gradients, as benchmarks/bench_bptt.py measures (CUDA:
           max_memory_allocated above what was allocated before).
  speed    text tokens (n * L * batch per step; memory tokens not counted) per CPU-second
           of ckpt and unroll at every --speed-segments n and of base at --base-segments,
           a step including the Adam update; all variants in one process, interleaved round
           by round in rotated order (common.interleaved); medians of per-round ratios.
           Also the forward passes' share of each step (why checkpointing costs what it
           does: its backward runs every segment's forward again).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time

import torch

# Run as a script, the checkout's root: `benchmarks` is a package the tests import too.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402
from benchmarks.common import (  # noqa: E402
    add_device_args,
    finish,
    interleaved,
    model_dtype,
    status_kib,
    step_clock,
)
from data_pipeline.streams import SegmentBatch  # noqa: E402
from model import ModelConfig, build_model  # noqa: E402
from train.bptt import run_window  # noqa: E402
from train.recompute import parse_policy  # noqa: E402

MODES = ("ckpt", "unroll", "base")


def parse_variant(name: str) -> tuple[str, str, int]:
    """A variant's name -> (mode, bptt.recompute, bptt.keep_last_segments): one of MODES, or
    a checkpointed one named "POLICY" or "POLICY+lastN" (ckpt is "full")."""
    if name in MODES:
        return name, "full", 0
    match = re.fullmatch(r"(.+?)(?:\+last(\d+))?", name)
    policy, keep_last = match.group(1), int(match.group(2) or 0)
    parse_policy(policy)   # a clear error for an unknown policy, before any child starts
    return "ckpt", policy, keep_last


def save_backbone(a, path: str) -> str:
    """A random causal LM of the requested shape, written as a pretrained checkpoint."""
    torch.manual_seed(a.seed)
    if a.arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=a.vocab, hidden_size=a.d_model, intermediate_size=a.d_inner,
            num_hidden_layers=a.n_layer, num_attention_heads=a.n_head,
            num_key_value_heads=a.n_kv_head, max_position_embeddings=4 * a.seg_len,
            bos_token_id=0, eos_token_id=0, tie_word_embeddings=a.tie_embeddings))
    else:
        from transformers import GPT2Config, GPT2LMHeadModel
        model = GPT2LMHeadModel(GPT2Config(
            vocab_size=a.vocab, n_positions=4 * a.seg_len, n_embd=a.d_model,
            n_layer=a.n_layer, n_head=a.n_head, n_inner=a.d_inner, resid_pdrop=a.dropout,
            embd_pdrop=a.dropout, attn_pdrop=a.dropout, bos_token_id=0, eos_token_id=0))
    model.save_pretrained(path)
    return path


def model_config(a, path: str, num_mem_tokens: int) -> ModelConfig:
    # ARMT (--mechanism armt) only with memory: its 0-token model would be the base anyway.
    # Titans (--mechanism titans): m persistent tokens (Eq. 19) and a neural memory of
    # width --d-mem, the rest model.titans' defaults (docs/titans.md).
    mechanism = a.mechanism if num_mem_tokens else "rmt"
    titans = ({"titans": {"num_persistent": num_mem_tokens, "d_mem": a.d_mem,
                          "chunk_size": a.chunk_size}}
              if mechanism == "titans" else {})
    return ModelConfig.from_dict({
        "mechanism": mechanism, "backbone": "hf", "tgt_len": a.seg_len, "mem_len": 0,
        "rmt": {"num_mem_tokens": num_mem_tokens, "pattern": a.pattern},
        "hf": {"path": path, "attn_implementation": a.attn}, **titans})


class Runner:
    """One variant stepping over random segments of L tokens: step() runs one window of n
    segments (forward, one backward; `base`: n independent forward + backward) and returns
    its clock seconds."""

    def __init__(self, a, path: str, variant: str, n: int, optimizer: bool):
        torch.manual_seed(a.seed)
        self.device = torch.device(a.device)
        mode, self.recompute, self.keep_last = parse_variant(variant)
        m = 0 if mode == "base" else a.num_mem_tokens
        self.model = build_model(model_config(a, path, m)).train().to(
            self.device, model_dtype(a))
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-4) if optimizer else None
        self.clock = step_clock(self.device)
        self.a, self.mode, self.n = a, mode, n
        # Its own generator: the memory's initial draw must not change the tokens, so that
        # every variant sees the same ones.
        self.fwd_s: list[float] = []   # clock seconds of each step's forward passes
        self.data = torch.randint(0, a.vocab, (a.batch, (n + 2) * a.seg_len + 1),
                                  generator=torch.Generator().manual_seed(a.seed))

    def segments(self, n: int) -> list[SegmentBatch]:
        L = self.a.seg_len
        return [SegmentBatch(self.data[:, j * L:(j + 1) * L + 1],
                             torch.zeros(self.a.batch, dtype=torch.bool), None, 0, j)
                for j in range(n)]

    def step(self, n: int | None = None) -> float:
        segs = self.segments(self.n if n is None else n)
        start = self.clock()
        fwd = 0.0
        if self.mode == "base":
            for seg in segs:
                tokens = seg.tokens.to(self.device)
                t = self.clock()
                out = self.model(tokens[:, :-1], None, targets=seg.tokens[:, 1:])
                fwd += self.clock() - t
                (out.loss / len(segs)).backward()
        else:
            res = run_window(self.model, None, segs, self.device,
                             checkpoint_segments=self.mode == "ckpt",
                             recompute=self.recompute, keep_last_segments=self.keep_last)
            fwd = self.clock() - start
            res.loss.backward()
        if self.opt is not None:
            self.opt.step()
        elapsed = self.clock() - start
        self.fwd_s.append(fwd)
        self.model.zero_grad(set_to_none=True)
        return elapsed

    def text_tokens(self) -> int:
        return self.n * self.a.seg_len * self.a.batch


def peak_of_step(runner: Runner) -> dict:
    """Peak memory of one step above the memory in use before it (MB = 2^20 bytes), after
    a warm-up step of min(n, 2) segments (the same segment shapes, so the same kernels and
    first-call allocations; a carried memory included)."""
    runner.step(min(runner.n, 2))
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
        torch.cuda.reset_peak_memory_stats(runner.device)
        before = torch.cuda.memory_allocated(runner.device)
        step_s = runner.step()
        peak = torch.cuda.max_memory_allocated(runner.device) - before
        return {"peak_mb": peak / 2**20, "base_mb": before / 2**20, "step_s": step_s}
    before = status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    step_s = runner.step()
    return {"peak_mb": (status_kib("VmHWM") - before) / 1024, "base_mb": before / 1024,
            "step_s": step_s}


def memory_child(a) -> None:
    spec = json.loads(a._child)
    runner = Runner(a, spec["path"], spec["mode"], spec["n"], optimizer=False)
    print(json.dumps(peak_of_step(runner)))


SHAPE_FLAGS = ("arch", "n_layer", "d_model", "n_head", "n_kv_head", "d_inner", "vocab",
               "dropout", "attn", "mechanism", "pattern", "seg_len", "num_mem_tokens", "batch",
               "threads", "device", "dtype", "seed")


def run_child(a, spec: dict) -> dict:
    return common.run_child(__file__, a, spec, SHAPE_FLAGS)


def measure_memory(a, path: str) -> dict:
    names = [*MODES[:2], *a.recompute]
    out: dict = {name: {} for name in names}
    for n in a.segments:
        for name in names:
            out[name][n] = run_child(a, {"path": path, "mode": name, "n": n})
        print(f"  n={n:<3} " + "   ".join(f"{name} {out[name][n]['peak_mb']:.0f} MB"
                                          for name in names), flush=True)
    for series in out.values():
        first = series[a.segments[0]]["peak_mb"]
        for r in series.values():
            r["ratio_vs_first_n"] = r["peak_mb"] / first
    return out


def measure_speed(a, path: str) -> dict:
    variants = {f"{mode}-n{n}": (mode, n) for n in a.speed_segments
                for mode in (*MODES[:2], *a.recompute)}
    variants[f"base-n{a.base_segments}"] = ("base", a.base_segments)
    runners = {name: Runner(a, path, mode, n, optimizer=True)
               for name, (mode, n) in variants.items()}
    for r in runners.values():
        r.step(min(r.n, 2))  # warm-up: the same kernels, Adam's state allocated
    times = interleaved({name: r.step for name, r in runners.items()}, a.rounds,
                        lambda rnd: print(f"  round {rnd + 1}/{a.rounds} done", flush=True))
    base_name = f"base-n{a.base_segments}"
    base_tps = [runners[base_name].text_tokens() / t for t in times[base_name]]
    out = {"variants": {}}
    for name, ts in times.items():
        tps = [runners[name].text_tokens() / t for t in ts]
        out["variants"][name] = {
            "cpu_s": ts, "median_s_per_step": statistics.median(ts),
            "tokens_per_s": statistics.median(tps),
            # The forward passes' share of the step (a checkpointed segment runs its forward
            # twice, so time(ckpt) / time(unroll) is about 1 + this share of `unroll`).
            "forward_share": statistics.median(
                f / t for f, t in zip(runners[name].fwd_s[-len(ts):], ts, strict=True)),
            # per-round ratio of text-token rates against the base model without memory
            "ratio_vs_base": statistics.median(x / b for x, b in zip(tps, base_tps,
                                                                       strict=True)),
            "ratio_vs_base_rounds": [x / b for x, b in zip(tps, base_tps, strict=True)]}
    for (mode, n) in variants.values():
        if mode not in ("unroll", "base"):
            c, u = times[f"{mode}-n{n}"], times[f"unroll-n{n}"]
            out["variants"][f"{mode}-n{n}"]["time_vs_unroll"] = statistics.median(
                x / y for x, y in zip(c, u, strict=True))
    return out


def print_shape(a) -> None:
    heads = f"{a.n_head} heads" + (f" ({a.n_kv_head} KV)" if a.arch == "llama" else "")
    print(f"torch {torch.__version__}, {a.device}, {a.threads} thread(s); {a.arch}: "
          f"{a.n_layer} layers, d {a.d_model}, {heads}, d_inner {a.d_inner}, vocab {a.vocab}"
          + (f", dropout {a.dropout}" if a.arch == "gpt2" else "")
          + f"; L {a.seg_len}, m {a.num_mem_tokens}, batch {a.batch}, {a.attn}, {a.dtype}",
          flush=True)


def report(a, results: dict) -> None:
    L, m, n = a.seg_len, a.num_mem_tokens, a.base_segments
    if "speed" in results:
        for name, v in results["speed"]["variants"].items():
            extra = (f"  time vs unroll {v['time_vs_unroll']:.2f}x"
                     if "time_vs_unroll" in v else "")
            print(f"  {name:<24}{v['tokens_per_s']:>8.0f} tokens/s  "
                  f"{v['ratio_vs_base']:.2f}x of base  forward {v['forward_share']:.0%} of "
                  f"the step{extra}")
        print(f"memory tokens' share of the decoder's work: (L+2m)/L = {(L + 2 * m) / L:.3f}")
    mem = results.get("memory", {})
    speed = results.get("speed", {}).get("variants", {})
    lo, hi = a.segments[0], a.segments[-1]
    print(f"GOALS: (a) peak(n={hi}) / peak(n={lo}) <= 1.5x; (b) n={n} tokens/s >= 0.6x base")
    print(f"{'variant':<24}{'peak(' + str(lo) + ')':>10}{'peak(' + str(hi) + ')':>10}"
          f"{'ratio':>8}{'vs base':>9}{'vs unroll':>11}  goals")
    for name in (*MODES[:2], *a.recompute):
        row, met = f"{name:<24}", []
        if name in mem:
            r = mem[name][hi]["peak_mb"] / mem[name][lo]["peak_mb"]
            row += f"{mem[name][lo]['peak_mb']:>8.1f}MB{mem[name][hi]['peak_mb']:>8.1f}MB"
            row += f"{r:>7.2f}x"
            met.append(f"(a) {'met' if r <= 1.5 else 'NOT met'}")
        else:
            row += " " * 28
        if f"{name}-n{n}" in speed:
            v = speed[f"{name}-n{n}"]
            row += f"{v['ratio_vs_base']:>8.2f}x"
            row += f"{v['time_vs_unroll']:>10.2f}x" if "time_vs_unroll" in v else " " * 11
            met.append(f"(b) {'met' if v['ratio_vs_base'] >= 0.6 else 'NOT met'}")
        print(row + "  " + ", ".join(met))


def ints(text: str) -> list[int]:
    return [int(x) for x in str(text).split(",")]


def parse_args(argv=None) -> argparse.Namespace:
    """The flags, with --quick's sizes applied and the lists of n parsed."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=["llama", "gpt2"], default="llama")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-kv-head", type=int, default=2, help="llama: key/value heads")
    p.add_argument("--d-inner", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--dropout", type=float, default=0.1, help="gpt2 only (Llama has none)")
    p.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa")
    p.add_argument("--tie-embeddings", action="store_true", help="llama: tied head (SmolLM2)")
    p.add_argument("--mechanism", choices=["rmt", "armt", "titans"], default="rmt",
                   help="the memory variants' mechanism (base: always the plain model)")
    p.add_argument("--d-mem", type=int, default=64, help="titans: model.titans.d_mem")
    p.add_argument("--chunk-size", type=int, default=16, help="titans: model.titans.chunk_size")
    p.add_argument("--pattern", choices=["paper", "causal"], default="paper",
                   help="model.rmt.pattern of RMT's memory variants")
    p.add_argument("--seg-len", type=int, default=128)
    p.add_argument("--num-mem-tokens", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    add_device_args(p)
    p.add_argument("--segments", default="1,2,4,8,16,32", help="n of the memory part")
    p.add_argument("--speed-segments", default="1,2,4,8,16,32", help="n of the speed part")
    p.add_argument("--base-segments", type=int, default=8, help="n of the base variant")
    p.add_argument("--recompute", default="",
                   help="more checkpointed variants, POLICY[+lastN],... (module docstring)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (speed)")
    p.add_argument("--parts", default="memory,speed", help="of memory, speed")
    p.add_argument("--quick", action="store_true", help="tiny sizes, few variants (smoke)")
    p.add_argument("--json", help="write every figure to this file")
    p.add_argument("--_child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.quick and not a._child:
        a.n_layer, a.d_model, a.d_inner, a.vocab, a.seg_len, a.num_mem_tokens = \
            2, 64, 128, 256, 32, 4
        a.batch, a.segments, a.speed_segments, a.base_segments, a.rounds = 2, "1,4", "4", 4, 2
    a.segments, a.speed_segments = ints(a.segments), ints(a.speed_segments)
    a.recompute = [v for v in str(a.recompute).split(",") if v]
    for v in a.recompute:
        try:
            if parse_variant(v)[0] != "ckpt" or v == "ckpt":
                raise ValueError(f"{v!r} is one of {MODES}, measured anyway")
        except ValueError as e:
            p.error(f"--recompute: {e}")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    if a._child:
        memory_child(a)
        return 0
    t0 = time.time()
    print_shape(a)
    results = {"args": {k: v for k, v in vars(a).items() if k != "_child"}}
    with tempfile.TemporaryDirectory() as tmp:
        path = save_backbone(a, os.path.join(tmp, a.arch))
        results["n_params"] = Runner(a, path, "ckpt", 1, optimizer=False).model.num_params()
        parts = a.parts.split(",")
        if "memory" in parts:
            print("peak MB of one step (n segments, one backward, no optimizer):", flush=True)
            results["memory"] = measure_memory(a, path)
        if "speed" in parts:
            print(f"text tokens/s ({'wall' if a.device != 'cpu' else 'CPU'} s), {a.rounds} "
                  "interleaved rounds (Adam included):", flush=True)
            results["speed"] = measure_speed(a, path)
    report(a, results)
    return finish(a.json, results, t0)


if __name__ == "__main__":
    sys.exit(main())
