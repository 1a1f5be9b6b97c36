"""Evaluation speed: vanilla sliding window vs cached evaluation (Transformer-XL Table 9).

    python benchmarks/bench_eval_speed.py --attn-lens 128,256,512,800 \\
        --json benchmarks/results/eval_speed.json
    python benchmarks/bench_eval_speed.py --quick              # smoke check, < 30 s

For every attention length L (`evaluation.speed.compare_speed`, bare model, fp32,
torch.inference_mode, random tokens):

  vanilla      Al-Rfou et al.: each token scored by one forward over the L tokens before it,
               no memory; the window slides by one (windows stacked into batches).
  cached       Transformer-XL: segments of tgt_len = L/4, memory mem_len = L - tgt_len, so a
               query sees between 3/4 L and L keys (--tgt-len to change).
  same_length  Transformer-XL as its eval scripts run it: mem_len = L with same_length, every
               query sees exactly L keys, as the vanilla query does.

tokens/s = tokens scored per CPU-second of this process (robust to hypervisor steal on a
shared VM), full windows and full memories only. glibc is told to keep freed memory
(`keep_freed_memory`; --default-malloc to not): otherwise vanilla's large score tensors
page-fault on every batch. The three run in interleaved rounds and the
speed-up is the median of the per-round ratios. The paper's figures (Table 9: 1,874x at 3,800
down to 363x at 800, enwik8, one GPU) are for a 24-layer model at far longer lengths; what
carries over is the trend, a speed-up that grows about linearly with L.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import sys
import time

import torch
from common import add_model_size_args, write_json

from evaluation.speed import compare_speed
from model import ModelConfig, build_model


def keep_freed_memory() -> bool:
    """Make glibc keep freed blocks in the heap. By default it maps every block above 32 MB
    afresh and unmaps it on free, so each batch of vanilla windows ([rows, heads, L, L] scores,
    40 MB at L = 800) page-faults its memory anew: measured here, a third of vanilla's CPU
    time at L = 800 was kernel time, which no evaluator needs to pay. Applies to both
    methods. mallopt(M_MMAP_MAX = 0, M_TRIM_THRESHOLD = max); False if libc lacks it."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-4, 0)) and bool(libc.mallopt(-1, 2**31 - 1))
    except (OSError, AttributeError):
        return False


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--attn-lens", default="128,256,512,800", help="attention lengths L")
    p.add_argument("--mechanism", default="xl", choices=("xl", "lamemo"))
    # Default size: the "small" model of bench_model / bench_bptt (BENCHMARKS.md, "Model:
    # forward + backward per mechanism");
    # --quick uses the tiny model of configs/quickstart.yaml.
    add_model_size_args(p)
    p.add_argument("--batch", type=int, default=4, help="rows (streams) evaluated at once")
    p.add_argument("--tgt-len", type=int, default=0, help="cached segment; 0 = L // 4")
    p.add_argument("--vanilla-tokens", type=int, default=16,
                   help="tokens scored per row and round by the vanilla method")
    p.add_argument("--cached-tokens", type=int, default=512,
                   help="tokens scored per row and round by the cached methods")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per L")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--default-malloc", action="store_true",
                   help="leave glibc's allocator as it is (see keep_freed_memory)")
    p.add_argument("--quick", action="store_true", help="tiny model, short lengths (smoke)")
    p.add_argument("--json", help="write every figure to this file")
    a = p.parse_args(argv)
    if a.quick:
        a.n_layer, a.d_model, a.d_inner, a.attn_lens = 2, 64, 256, "64,128"
        a.vanilla_tokens, a.cached_tokens, a.rounds = 4, 64, 2
    torch.set_num_threads(a.threads)
    heap_kept = False if a.default_malloc else keep_freed_memory()
    attn_lens = [int(x) for x in a.attn_lens.split(",")]

    torch.manual_seed(0)
    cfg = ModelConfig(mechanism=a.mechanism, vocab_size=a.vocab, n_layer=a.n_layer,
                      d_model=a.d_model, n_head=a.n_head, d_inner=a.d_inner, dropout=0.0,
                      tgt_len=128, mem_len=128)
    model = build_model(cfg).eval()
    machine = {"cpu": cpu_name(), "cpu_count": os.cpu_count(), "gpu": torch.cuda.is_available(),
               "torch": torch.__version__, "python": platform.python_version(),
               "threads": a.threads, "malloc_keeps_freed_memory": heap_kept}
    print(f"torch {torch.__version__}, {a.threads} thread(s), {machine['cpu']} x "
          f"{machine['cpu_count']}; {a.mechanism} {a.n_layer} layers, d_model {a.d_model}, "
          f"{a.n_head} heads, d_inner {a.d_inner}, vocab {a.vocab}, {model.num_params():,} "
          f"parameters, batch {a.batch}, fp32, inference_mode; freed memory kept in the heap: "
          f"{heap_kept}", flush=True)
    t0 = time.time()
    results = []
    for L in attn_lens:
        res = compare_speed(model, L, batch=a.batch, tgt_len=a.tgt_len or None,
                            vanilla_tokens=a.vanilla_tokens, cached_tokens=a.cached_tokens,
                            rounds=a.rounds, log=lambda s: print(s, flush=True))
        results.append(res.to_dict())
    print(f"\n{'L':>5} {'tgt':>4} {'mem':>4} {'vanilla tok/s':>14} {'cached tok/s':>13} "
          f"{'speed-up':>9} {'same_length tok/s':>18} {'speed-up':>9}")
    for r in results:
        print(f"{r['attn_len']:>5} {r['tgt_len']:>4} {r['mem_len']:>4} "
              f"{r['vanilla_tokens_per_s']:>14.1f} {r['cached_tokens_per_s']:>13.0f} "
              f"{r['speedup']:>8.0f}x {r['same_length_tokens_per_s']:>18.0f} "
              f"{r['speedup_same_length']:>8.0f}x")
    wall = time.time() - t0
    print(f"done in {wall:.0f} s")
    write_json(a.json, {"args": vars(a), "machine": machine, "params": model.num_params(),
                        "results": results, "wall_s": wall})
    return 0


if __name__ == "__main__":
    sys.exit(main())
