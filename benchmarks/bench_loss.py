"""Peak memory and time of one loss step (the LM head, the cross-entropy, their backward):
the plain path (the whole [N, V] logits, a float32 log-softmax) against memtrain's loss
(model/loss.py: chunks of rows recomputed in backward; only supervised rows reach the head).

Each variant runs in a child process of its own; the peak is the process's resident-set
high-water mark above what it held before the step (as bench_pretrained.py measures), after
one warm-up step. The default shape is GPT-2's head on 4,096 rows:

    .venv/bin/python benchmarks/bench_loss.py                       # N 4096, V 50257, d 768
    .venv/bin/python benchmarks/bench_loss.py --dtype bf16 --answer-share 0.05

What a step holds that neither path can avoid: the hidden rows [N, d], the head's weight and
its gradient [V, d], the hidden rows' gradient. The plain path adds three float32 [N, V]
buffers at its peak (the up-cast logits, the saved log-softmax, its gradient), each
N x V x 4 bytes (786 MiB at the default shape).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks import common  # noqa: E402
from model.loss import chunk_rows, logits_nll, segment_nll  # noqa: E402

VARIANTS = ("plain", "chunked")
SHAPE_FLAGS = ("rows", "vocab", "d_model", "dtype", "answer_share", "threads", "seed")


def loss_step(a, variant: str, head, hidden, targets, mask) -> float:
    """One forward + backward of the loss; returns its CPU seconds."""
    start = time.process_time()
    h = hidden.detach().requires_grad_()
    if variant == "plain":
        nll = logits_nll(head(h.reshape(-1, a.d_model)), targets.reshape(-1)).view(mask.shape)
        loss = (nll * mask).sum() / mask.sum()
    else:
        rows_nll = lambda x, t: logits_nll(head(x), t)   # noqa: E731
        loss = segment_nll(rows_nll, h, targets, mask, chunk_rows(a.vocab)).sum() / mask.sum()
    loss.backward()
    elapsed = time.process_time() - start
    head.zero_grad(set_to_none=True)
    return elapsed


def child(a) -> None:
    spec = json.loads(a._child)
    torch.manual_seed(a.seed)
    dtype = common.model_dtype(a)
    head = torch.nn.Linear(a.d_model, a.vocab, bias=False).to(dtype)
    hidden = torch.randn(1, a.rows, a.d_model, dtype=dtype)
    targets = torch.randint(0, a.vocab, (1, a.rows))
    mask = torch.rand(1, a.rows) < a.answer_share
    loss_step(a, spec["variant"], head, hidden, targets, mask)   # warm-up
    before = common.status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    step_s = loss_step(a, spec["variant"], head, hidden, targets, mask)
    print(json.dumps({"peak_mb": (common.status_kib("VmHWM") - before) / 1024,
                      "step_cpu_s": step_s}))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=4096, help="N: tokens scored in the step")
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--answer-share", type=float, default=1.0,
                   help="share of rows with a loss (1: language modelling; a task's answer "
                        "rows are a few per cent)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--_child", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a._child:
        child(a)
        return 0
    started = time.time()
    nv_mb = a.rows * a.vocab * 4 / 2**20
    print(f"loss step: N {a.rows} x V {a.vocab}, d {a.d_model}, {a.dtype}, "
          f"answer share {a.answer_share}; one float32 [N, V] buffer = {nv_mb:.0f} MiB; "
          f"chunk {chunk_rows(a.vocab)} rows")
    results = {"shape": {k: getattr(a, k) for k in SHAPE_FLAGS}, "nv_fp32_mb": nv_mb}
    for variant in VARIANTS:
        results[variant] = common.run_child(__file__, a, {"variant": variant}, SHAPE_FLAGS)
        r = results[variant]
        print(f"  {variant:<8} peak {r['peak_mb']:7.0f} MiB ({r['peak_mb'] / nv_mb:.2f} x "
              f"[N, V] fp32)   step {r['step_cpu_s']:.2f} CPU s", flush=True)
    results["peak_ratio"] = results["chunked"]["peak_mb"] / results["plain"]["peak_mb"]
    results["time_ratio"] = (results["chunked"]["step_cpu_s"]
                             / results["plain"]["step_cpu_s"])
    print(f"chunked / plain: peak {results['peak_ratio']:.3f}, "
          f"time {results['time_ratio']:.2f}")
    return common.finish(a.json, results, started)


if __name__ == "__main__":
    sys.exit(main())
