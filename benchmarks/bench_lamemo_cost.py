"""LaMemo ÷ Transformer-XL time per token, at the WikiText-103 base shape and the small shape.

    python benchmarks/bench_lamemo_cost.py                       # both shapes, ratios
    python benchmarks/bench_lamemo_cost.py --shape wt103 --rounds 5 --batch 2
    python benchmarks/bench_lamemo_cost.py --profile             # + top ops per model

Shapes (issue 14, item 4):
- wt103: the Transformer-XL WikiText-103 base (configs/wt103-xl-base.yaml): 16 layers,
  d_model 410, 10 heads x 41, d_inner 2100, segment 150, memory 150, adaptive softmax over
  267,735 words (cutoffs 20000/40000/200000, div_val 1, tied weights and tail projections),
  dropout 0.1, fp32. The paper's LaMemo / XL is 191M / 157M FLOPs per prediction = 1.22x
  (LaMemo Table 1).
- small: the byte-level shape of BENCHMARKS.md (4 x 256, 4 heads, d_inner 1024, segment 128,
  memory 128, batch 8, 256 symbols).

Tokens are random. For wt103 they follow a Zipf law (p ∝ 1/rank, ranks = ids, as the
vocabulary is frequency-sorted) by default, so the adaptive softmax's tail clusters see
about as many rows as on real text; `--tokens uniform` sends ~92% of the rows to the tails.

Timing as benchmarks/bench_model.py: the two models live in one process, each round runs one
step of each (order alternating), the time is the process CPU time of the step (the machine
is shared: never wall time), and the reported ratio is the median of the per-round ratios.
One step = forward + backward of one segment with the memory carried (+ an Adam step with
--optimizer).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from common import write_json

from model import ModelConfig, build_model

SHAPES = {
    "wt103": dict(vocab_size=267735, n_layer=16, d_model=410, n_head=10, d_head=41,
                  d_inner=2100, tgt_len=150, mem_len=150, cutoffs=[20000, 40000, 200000],
                  div_val=1, tie_weight=True, tie_projs=[False, True, True, True]),
    "small": dict(vocab_size=256, n_layer=4, d_model=256, n_head=4, d_inner=1024, tgt_len=128,
                  mem_len=128),
}
DEFAULT_BATCH = {"wt103": 4, "small": 8}


def make_tokens(shape: str, vocab: int, batch: int, length: int, kind: str,
                gen: torch.Generator) -> torch.Tensor:
    if shape == "wt103" and kind == "zipf":
        weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
        flat = torch.multinomial(weights, batch * length, replacement=True, generator=gen)
        return flat.view(batch, length)
    return torch.randint(0, vocab, (batch, length), generator=gen)


class Runner:
    """One model, its carried memory and (optionally) its Adam; `step()` times one segment."""

    def __init__(self, shape: str, mechanism: str, args, batch: int):
        torch.manual_seed(0)
        cfg = ModelConfig(mechanism=mechanism, dropout=args.dropout, dropatt=0.0,
                          attn_impl=args.attn_impl, **SHAPES[shape])
        self.model = build_model(cfg).train()
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-4) if args.optimizer else None
        self.seg_len = cfg.tgt_len
        gen = torch.Generator().manual_seed(1)
        self.data = make_tokens(shape, cfg.vocab_size, batch, 16 * cfg.tgt_len + 1, args.tokens,
                                gen)
        self.state, self.pos = None, 0

    def step(self) -> float:
        if self.pos + self.seg_len + 1 > self.data.shape[1]:
            self.pos, self.state = 0, None
        seg = self.data[:, self.pos:self.pos + self.seg_len + 1]
        self.pos += self.seg_len
        start = time.process_time()
        out = self.model(seg[:, :-1], self.state, targets=seg[:, 1:])
        out.loss.backward()
        if self.opt is not None:
            self.opt.step()
        elapsed = time.process_time() - start
        self.model.zero_grad(set_to_none=True)
        self.state = out.state.detach()
        return elapsed


def measure(shape: str, args) -> dict:
    batch = args.batch or DEFAULT_BATCH[shape]
    runners = {m: Runner(shape, m, args, batch) for m in ("xl", "lamemo")}
    for r in runners.values():  # warm-up: the memory fills after one segment (M = L)
        for _ in range(args.warmup):
            r.step()
    times = {m: [] for m in runners}
    for rnd in range(args.rounds):
        order = ["xl", "lamemo"] if rnd % 2 == 0 else ["lamemo", "xl"]
        for m in order:
            times[m].append(runners[m].step())
    ratios = [a / b for a, b in zip(times["lamemo"], times["xl"], strict=True)]
    tokens = batch * runners["xl"].seg_len
    result = {"batch": batch, "tokens_per_step": tokens,
              "cpu_s_per_step": {m: statistics.median(t) for m, t in times.items()},
              "round_ratios": ratios, "lamemo_over_xl": statistics.median(ratios)}
    if args.profile:
        result["profile"] = {m: profile(r, args.profile_steps, args.top)
                             for m, r in runners.items()}
    return result


def profile(runner: Runner, steps: int, top: int) -> list[dict]:
    """Top ops by self CPU time over `steps` steps (torch.profiler; ms per step)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            runner.step()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    return [{"op": e.key, "self_ms_per_step": e.self_cpu_time_total / 1e3 / steps,
             "share": e.self_cpu_time_total / total, "calls_per_step": e.count / steps}
            for e in events[:top]] + [{"op": "TOTAL", "self_ms_per_step": total / 1e3 / steps,
                                       "share": 1.0, "calls_per_step": 0}]


def print_result(shape: str, res: dict) -> None:
    t = res["cpu_s_per_step"]
    print(f"[{shape}] batch {res['batch']} ({res['tokens_per_step']} tokens/step): XL "
          f"{t['xl']:.3f} CPU-s/step, LaMemo {t['lamemo']:.3f}; LaMemo / XL = "
          f"{res['lamemo_over_xl']:.3f} (median of {len(res['round_ratios'])} round ratios: "
          f"{', '.join(f'{r:.2f}' for r in res['round_ratios'])})")
    for m, rows in res.get("profile", {}).items():
        print(f"  profile {m} (self CPU ms per step)")
        for row in rows:
            print(f"    {row['op']:<44}{row['self_ms_per_step']:>10.1f}{row['share']:>8.1%}"
                  f"{row['calls_per_step']:>8.0f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=[*SHAPES, "both"], default="both")
    p.add_argument("--batch", type=int, default=0, help="default: wt103 4, small 8")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--attn-impl", default="fused", choices=["fused", "plain"])
    p.add_argument("--tokens", choices=["zipf", "uniform"], default="zipf")
    p.add_argument("--optimizer", action="store_true", help="include an Adam step")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, fp32, dropout {args.dropout}, "
          f"attn_impl {args.attn_impl}, tokens {args.tokens}, optimizer step "
          f"{'yes' if args.optimizer else 'no'}, {args.rounds} rounds after {args.warmup} "
          f"warm-up steps")
    results = {}
    for shape in (SHAPES if args.shape == "both" else [args.shape]):
        results[shape] = measure(shape, args)
        print_result(shape, results[shape])
        sys.stdout.flush()
    write_json(args.json, {"args": vars(args), "torch": torch.__version__,
                           "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
