"""RMT's "paper" pattern around a pretrained decoder: one attention call with the pattern's
boolean mask against the split into three maskless calls (model/pretrained/paper_attention.py).

Per variant, forward + backward of one attention layer's kernel(s) over [read | tokens |
write] rows (N = 2m + L), timed in interleaved rounds (median); and, device-independent,
the score tiles a block-sparse kernel visits at a tile size (default 128): every tile for
the mask, the causal call's lower triangle plus the two dense calls' tiles for the split.

    .venv/bin/python benchmarks/bench_paper_attention.py            # CPU, GPT-2's shape
    .venv/bin/python benchmarks/bench_paper_attention.py --device cuda --dtype bf16 --batch 32
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import add_device_args, model_dtype, step_clock  # noqa: E402
from model.mechanisms.rmt.core import rmt_allowed  # noqa: E402
from model.pretrained.paper_attention import split_paper_attention  # noqa: E402


def tiles(m: int, n_tok: int, tile: int) -> dict[str, int]:
    """Score tiles of `tile` x `tile` each variant's kernels visit."""
    blocks = lambda rows: math.ceil(rows / tile)  # noqa: E731
    n, first = 2 * m + n_tok, m + n_tok
    causal = sum(min(i + 1, blocks(first)) for i in range(blocks(first)))
    return {"mask": blocks(n) ** 2,
            "split": causal + blocks(m) ** 2 + blocks(m) * blocks(n)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_device_args(p)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--seg", type=int, default=1024, help="tokens L of a segment")
    p.add_argument("--mem", type=int, default=16, help="memory tokens m")
    p.add_argument("--tile", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    device, dtype = torch.device(args.device), model_dtype(args)
    m, n_tok = args.mem, args.seg
    n = 2 * m + n_tok
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(args.batch, args.heads, n, args.head_dim, generator=g)
               .to(device, dtype).requires_grad_() for _ in range(3))
    allowed = rmt_allowed(m, n_tok, 0, None, False, device)[:, None]
    w = torch.randn(q.shape, generator=g).to(device, dtype)
    runs = {"mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=allowed),
            "split": lambda: split_paper_attention(q, k, v, m)}
    with torch.no_grad():
        diff = (runs["split"]().float() - runs["mask"]().float()).abs().max().item()
    clock, times = step_clock(device), {name: [] for name in runs}
    for r in range(args.rounds + 1):                       # round 0: warm-up
        for name, run in runs.items():
            start = clock()
            (run() * w).sum().backward()
            elapsed = clock() - start
            q.grad = k.grad = v.grad = None
            if r:
                times[name].append(elapsed)
    median = {name: statistics.median(t) for name, t in times.items()}
    counted = tiles(m, n_tok, args.tile)
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": args.dtype, "batch": args.batch, "heads": args.heads,
        "head_dim": args.head_dim, "m": m, "L": n_tok, "rows": n, "rounds": args.rounds,
        "step_s": median, "split_over_mask": median["split"] / median["mask"],
        "tiles": counted, "tile": args.tile,
        "tiles_split_over_mask": counted["split"] / counted["mask"],
        "max_abs_diff_forward": diff,
        "torch": torch.__version__,
    }
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
