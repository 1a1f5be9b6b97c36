"""Gradient sums in bf16 vs fp32: why `deepspeed.grad_dtype` defaults to fp32.

A data-parallel step sums one gradient per rank (all-reduce / reduce-scatter) and, with
gradient accumulation, one per micro-step. A ring reduction adds the ranks' shards one after
another, each partial sum rounded to the wire dtype: in bf16 (8 bits of mantissa) every
addition rounds to ~0.4% of the running sum. This script takes the real gradients of N
micro-batches of an XL model (the "small" model of BENCHMARKS.md on random tokens, each
gradient rounded to bf16 as a bf16 rank holds it), sums them in rank order in bf16 and in
fp32, and reports the error of each sum against the exact (fp64) sum of the same bf16
gradients: relative L2 error, and the share of entries off by more than 1%.

    .venv/bin/python benchmarks/bench_grad_sums.py --ranks 8,32,128
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import add_model_size_args  # noqa: E402
from model import ModelConfig, build_model  # noqa: E402


def gradients(args, n: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    cfg = ModelConfig(mechanism="xl", vocab_size=args.vocab, n_layer=args.n_layer,
                      d_model=args.d_model, n_head=args.n_head, d_inner=args.d_inner,
                      tgt_len=args.seg, mem_len=args.seg, dropout=0.1)
    model = build_model(cfg).train()
    out = []
    for _ in range(n):
        model.zero_grad(set_to_none=True)
        tokens = torch.randint(0, args.vocab, (args.batch, args.seg + 1))
        res = model(tokens[:, :-1], None, targets=tokens[:, 1:])
        res.loss.backward()
        flat = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        out.append(flat.bfloat16())   # what a bf16 rank holds
    return out


def ring_sum(grads: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    total = grads[0].to(dtype)
    for g in grads[1:]:
        total = total + g.to(dtype)      # each partial sum rounded to `dtype`
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_size_args(p)
    p.add_argument("--seg", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--ranks", default="8,32,128")
    p.add_argument("--json")
    args = p.parse_args()
    counts = [int(x) for x in args.ranks.split(",")]
    grads = gradients(args, max(counts))
    rows = []
    for n in counts:
        exact = ring_sum(grads[:n], torch.float64)
        row = {"ranks": n, "parameters": exact.numel()}
        for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            s = ring_sum(grads[:n], dtype).double()
            err = (s - exact).abs()
            row[f"{name}_rel_l2"] = float(err.norm() / exact.norm())
            big = exact.abs() > 1e-12
            row[f"{name}_over_1pct"] = float((err[big] > 0.01 * exact.abs()[big]).double()
                                             .mean())
        # fp32 sums rounded once to bf16 at the end (what the bf16 weights then see)
        once = ring_sum(grads[:n], torch.float32).bfloat16().double()
        row["fp32_then_bf16_rel_l2"] = float((once - exact).norm() / exact.norm())
        rows.append(row)
        print(f"{n:4d} gradients summed: relative L2 error bf16 {row['bf16_rel_l2']:.2e}, "
              f"fp32 {row['fp32_rel_l2']:.2e} (fp32 then rounded to bf16 once "
              f"{row['fp32_then_bf16_rel_l2']:.2e}); entries off by > 1%: bf16 "
              f"{100 * row['bf16_over_1pct']:.1f}%, fp32 {100 * row['fp32_over_1pct']:.3f}%",
              flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
