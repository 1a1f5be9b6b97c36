"""LaMemo ÷ Transformer-XL time per token, at the WikiText-103 base shape and the small shape.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_lamemo_cost.py     # both shapes
    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_lamemo_cost.py --shape wt103 --batch 2
    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_lamemo_cost.py --profile   # + top ops
    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_lamemo_cost.py --shape wt103 --batch 2 \
        --softmax full      # one 267,735-way softmax: the paper's FLOPs accounting
    python benchmarks/bench_lamemo_cost.py --kernels     # one attention call per kernel
    python benchmarks/bench_lamemo_cost.py --shape wt103 --device cuda --dtype bf16  # a GPU

OMP_WAIT_POLICY=PASSIVE: on a shared machine an OpenMP thread whose partner is descheduled
spins at the barrier and the spin is charged as process CPU time; passive waiting charges
only work (the wall time does not matter here).

Shapes (BENCHMARKS.md, "LaMemo ÷ Transformer-XL time per token"):
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

Timing as benchmarks/bench_model.py: four models live in one process, XL and LaMemo with
the attention kernels from before this change and after it (`VARIANTS`); each round runs one
step of each (order rotating), the time is the process CPU time of the step (the machine is
shared: never wall time), and each reported ratio is the median of the per-round ratios.
One step = forward + backward of one segment with the memory carried (+ an Adam step with
--optimizer).

On a GPU (--device cuda): the two models as the trainer runs them, each layer's kernel the
model's own choice ("fused": XL through SDPA with the head padded, LaMemo through the
one-pass kernel), cast to --dtype; a step is timed in wall time up to the device's end
(benchmarks/common.py `step_clock`). Not run by this project (no GPU here).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from common import add_device_args, interleaved, model_dtype, step_clock, write_json

from model import ModelConfig, build_model

SHAPES = {
    "wt103": dict(vocab_size=267735, n_layer=16, d_model=410, n_head=10, d_head=41,
                  d_inner=2100, tgt_len=150, mem_len=150, cutoffs=[20000, 40000, 200000],
                  div_val=1, tie_weight=True, tie_projs=[False, True, True, True]),
    "small": dict(vocab_size=256, n_layer=4, d_model=256, n_head=4, d_inner=1024, tgt_len=128,
                  mem_len=128),
}
DEFAULT_BATCH = {"wt103": 4, "small": 8}


def shape_config(shape: str, softmax: str) -> dict:
    """SHAPES[shape]; softmax "full": one softmax over the whole vocabulary, no clusters
    (what LaMemo Table 1's FLOPs per prediction count, XL's 157M included)."""
    cfg = dict(SHAPES[shape])
    if softmax == "full":
        cfg.update(cutoffs=[], tie_projs=[])
    return cfg


def make_tokens(shape: str, vocab: int, batch: int, length: int, kind: str,
                gen: torch.Generator) -> torch.Tensor:
    if shape == "wt103" and kind == "zipf":
        weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
        flat = torch.multinomial(weights, batch * length, replacement=True, generator=gen)
        return flat.view(batch, length)
    return torch.randint(0, vocab, (batch, length), generator=gen)


class Runner:
    """One model, its carried memory and (optionally) its Adam; `step()` times one segment.

    kernel: the attention kernel every layer is forced to ("plain", "sdpa", "one_pass"; see
    model/attention_kernels.choose_kernel). Before this change XL's "fused" path was the
    "sdpa" kernel (math fallback on the CPU) and LaMemo's always the "plain" one (it needs
    the log-normaliser); after it both take "one_pass" on the CPU."""

    def __init__(self, shape: str, mechanism: str, kernel: str, args, batch: int):
        torch.manual_seed(0)
        cfg = ModelConfig(mechanism=mechanism, dropout=args.dropout, dropatt=0.0,
                          **shape_config(shape, args.softmax))
        self.device = torch.device(args.device)
        self.model = build_model(cfg).train().to(self.device, model_dtype(args))
        for layer in self.model.core.layers:
            layer.attn.impl = kernel
        self.clock = step_clock(self.device)
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
        start = self.clock()
        # Targets stay on the host, as the training step passes them (train/bptt.py).
        out = self.model(seg[:, :-1].to(self.device, non_blocking=True), self.state,
                         targets=seg[:, 1:])
        out.loss.backward()
        if self.opt is not None:
            self.opt.step()
        elapsed = self.clock() - start
        self.model.zero_grad(set_to_none=True)
        self.state = out.state.detach()
        return elapsed


# (name, mechanism, kernel); ratios are LaMemo over XL within "before" and within "after".
VARIANTS = [("xl-before", "xl", "sdpa"), ("lamemo-before", "lamemo", "plain"),
            ("xl-after", "xl", "one_pass"), ("lamemo-after", "lamemo", "one_pass")]
RATIOS = {"before": ("lamemo-before", "xl-before"), "after": ("lamemo-after", "xl-after"),
          "lamemo after/before": ("lamemo-after", "lamemo-before"),
          "xl after/before": ("xl-after", "xl-before")}


def measure(shape: str, args) -> dict:
    batch = args.batch or DEFAULT_BATCH[shape]
    # With --softmax full only today's kernels run: a step is seconds, not the kernels' story.
    variants = VARIANTS if args.softmax == "adaptive" else VARIANTS[2:]
    if args.device != "cpu":   # the kernels the model chooses there
        variants = [("xl-after", "xl", "fused"), ("lamemo-after", "lamemo", "fused")]
    runners = {name: Runner(shape, mech, kernel, args, batch) for name, mech, kernel in variants}
    for r in runners.values():  # warm-up: the memory fills after one segment (M = L)
        for _ in range(args.warmup):
            r.step()
    times = interleaved({m: r.step for m, r in runners.items()}, args.rounds)
    tokens = batch * runners["xl-after"].seg_len
    ratios = {key: [a / b for a, b in zip(times[num], times[den], strict=True)]
              for key, (num, den) in RATIOS.items() if num in times and den in times}
    result = {"batch": batch, "tokens_per_step": tokens,
              "s_per_step": {m: statistics.median(t) for m, t in times.items()},
              "clock": "process CPU" if args.device == "cpu" else "wall, device synchronised",
              "round_ratios": ratios,
              "median_ratio": {k: statistics.median(v) for k, v in ratios.items()}}
    if args.profile:
        result["profile"] = {m: profile(runners[m], args.profile_steps, args.top)
                             for m in ("xl-after", "lamemo-after", "lamemo-before")}
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


def forward_macs(shape: str, batch: int, softmax: str = "adaptive") -> dict:
    """Analytic multiply-accumulates per token of one training step (memory full, M = L):
    forward, and training = 3x every part that has a gradient + 1x LaMemo's top-layer
    look-ahead (run without one). Matmuls only; Zipf targets for the adaptive softmax.

    Per layer, B rows of L tokens, M memory rows, D = M + L distances, a = H·dh:
      XL:      q B·L·d·a, k/v B·(M+L)·2d·a, R D·d·a, scores + positions + values
               3·B·L·(M+L)·a, W_o B·L·a·d, FFN B·L·2·d·d_inner
      LaMemo adds (LaMemo §3.1-3.2, Eq. 7-11): q for the M memory rows, R for the M
               look-ahead distances, look-ahead attention 3·B·M·min(M, L)·a, and below the
               top layer W_o and FFN for the M refreshed memory rows.
    """
    c = shape_config(shape, softmax)
    d, n_l, n_q, n_m, d_in = c["d_model"], c["n_layer"], c["tgt_len"], c["mem_len"], c["d_inner"]
    a = c["n_head"] * c.get("d_head", d // c["n_head"])
    b = batch
    xl_layer = (b * n_q * d * a + b * (n_m + n_q) * 2 * d * a + (n_m + n_q) * d * a
                + 3 * b * n_q * (n_m + n_q) * a + b * n_q * a * d + b * n_q * 2 * d * d_in)
    look = b * n_m * d * a + n_m * d * a + 3 * b * n_m * min(n_m, n_q) * a
    rows = b * n_m * a * d + b * n_m * 2 * d * d_in
    ends = [0, *c.get("cutoffs", []), c["vocab_size"]]
    if len(ends) > 2:
        w = 1.0 / torch.arange(1, c["vocab_size"] + 1, dtype=torch.float64)
        frac = [float(w[lo:hi].sum() / w.sum()) for lo, hi in zip(ends, ends[1:], strict=False)]
        soft = d * (ends[1] + len(ends) - 2) + sum(
            f * d * (hi - lo) for f, lo, hi in
            zip(frac[1:], ends[1:], ends[2:], strict=False))
    else:
        soft = d * c["vocab_size"]
    tokens = b * n_q
    xl_fwd = n_l * xl_layer / tokens + soft
    la_fwd = xl_fwd + (n_l * look + (n_l - 1) * rows) / tokens
    xl_train = 3 * xl_fwd
    la_train = xl_train + (3 * (n_l - 1) * (look + rows) + look) / tokens
    return {"xl_forward_M": xl_fwd / 1e6, "lamemo_forward_M": la_fwd / 1e6,
            "softmax_forward_M": soft / 1e6, "forward_ratio": la_fwd / xl_fwd,
            "training_ratio": la_train / xl_train,
            "full_softmax_forward_ratio": (la_fwd - soft + d * c["vocab_size"])
            / (xl_fwd - soft + d * c["vocab_size"])}


def measure_kernels(shape: str, args) -> dict:
    """One causal attention call of the shape (batch, heads, d_head, segment, memory), each
    kernel forward+backward ("train") and forward under no_grad ("eval"), kernels
    interleaved per round: median CPU ms. FlexAttention (torch.compile) has no backward on
    the CPU, so it is timed in eval only; a compile failure is reported, not raised."""
    import math

    from torch.nn.attention.flex_attention import flex_attention

    from model.attention import relative_attention
    from model.attention_kernels import flex_relative_attention, sdpa_relative
    from model.backbone import Lengths, causal_allowed
    from model.positional import skew

    cfg = SHAPES[shape]
    bsz = args.batch or DEFAULT_BATCH[shape]
    n_h, n_q, n_m = cfg["n_head"], cfg["tgt_len"], cfg["mem_len"]
    d_h = cfg.get("d_head", cfg["d_model"] // n_h)
    n_k = n_q + n_m
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(bsz, n, n_h, d_h, generator=gen) for n in (n_q, n_k, n_k))
    r = torch.randn(n_k, n_h, d_h, generator=gen)
    u, vb = torch.randn(n_h, d_h, generator=gen), torch.randn(n_h, d_h, generator=gen)
    allowed = causal_allowed(n_q, n_m, torch.full((bsz,), n_m), Lengths(n_m), "cpu")
    scale = 1 / math.sqrt(d_h)
    compiled = torch.compile(flex_attention)

    def sdpa(q, k, v, r, u, vb):
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
        bd = skew(torch.matmul((qh + vb[:, None]) * scale, r.permute(1, 2, 0)), n_k)
        bias = bd.masked_fill(~allowed[:, None], float("-inf"))
        return sdpa_relative(qh + u[:, None], kh, vh, bias, dropatt=0.0, scale=scale)

    def flex(q, k, v, r, u, vb):
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
        bd = torch.matmul((qh + vb[:, None]) * scale, r.permute(1, 2, 0))
        return flex_relative_attention(qh + u[:, None], kh, vh, bd, allowed, scale=scale,
                                       compiled=compiled)

    kernels = {
        "plain": lambda *t: relative_attention(*t, allowed, impl="plain")[0],
        "plain+lse": lambda *t: relative_attention(*t, allowed, impl="plain",
                                                   need_lse=True)[0],
        "one_pass": lambda *t: relative_attention(*t, allowed, impl="one_pass")[0],
        "sdpa(math on CPU)": sdpa,
        "flex": flex,
    }
    inputs = (q, k, v, r, u, vb)
    result, reference = {}, kernels["plain"](*inputs)
    try:
        with torch.no_grad():
            err = (flex(*inputs).transpose(1, 2) - reference).abs().max().item()
        result["flex_eval_max_abs_err_vs_plain"] = err
    except Exception as exc:  # noqa: BLE001 - a compile failure is a finding to report
        result["flex_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        kernels.pop("flex")
    grads = [t.clone().requires_grad_(True) for t in inputs]
    times = {f"{n} {m}": [] for n in kernels for m in ("train", "eval")
             if not (n == "flex" and m == "train")}
    for _ in range(args.rounds):
        for name, fn in kernels.items():
            with torch.no_grad():
                start = time.process_time()
                fn(*inputs)
                times[f"{name} eval"].append(time.process_time() - start)
            if name != "flex":
                start = time.process_time()
                fn(*grads).sum().backward()
                times[f"{name} train"].append(time.process_time() - start)
    result["shape"] = dict(batch=bsz, heads=n_h, d_head=d_h, queries=n_q, keys=n_k)
    result["median_cpu_ms"] = {n: 1e3 * statistics.median(t[1:] or t) for n, t in times.items()}
    return result


def print_result(shape: str, res: dict) -> None:
    t = res["s_per_step"]
    print(f"[{shape}] batch {res['batch']} ({res['tokens_per_step']} tokens/step), median "
          f"s/step ({res['clock']}): " + ", ".join(f"{m} {v:.3f}" for m, v in t.items()))
    for key, value in res["median_ratio"].items():
        rounds = ", ".join(f"{r:.2f}" for r in res["round_ratios"][key])
        print(f"  {key:<22}{value:>7.3f}   (rounds: {rounds})")
    for m, rows in res.get("profile", {}).items():
        print(f"  profile {m} (self CPU ms per step, share, calls per step)")
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
    p.add_argument("--tokens", choices=["zipf", "uniform"], default="zipf")
    p.add_argument("--optimizer", action="store_true", help="include an Adam step")
    p.add_argument("--softmax", choices=["adaptive", "full"], default="adaptive",
                   help="full: no cutoffs, one softmax over the vocabulary (the paper's "
                        "FLOPs accounting); times today's kernels only")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--kernels", action="store_true",
                   help="time one attention call per kernel (incl. FlexAttention) instead")
    add_device_args(p)
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    if args.device != "cpu" and (args.kernels or args.profile):
        p.error("--kernels and --profile time CPU work only; leave them out with --device")
    torch.set_num_threads(args.threads)
    wait = os.environ.get("OMP_WAIT_POLICY", "unset")
    print(f"torch {torch.__version__}, {args.device}, {args.threads} threads, {args.dtype}, "
          f"dropout {args.dropout}, "
          f"OMP_WAIT_POLICY {wait}, tokens {args.tokens}, optimizer step "
          f"{'yes' if args.optimizer else 'no'}, softmax {args.softmax}, {args.rounds} rounds "
          f"after {args.warmup} warm-up steps")
    results = {}
    for shape in (SHAPES if args.shape == "both" else [args.shape]):
        if args.kernels:
            results[shape] = measure_kernels(shape, args)
            print(f"[{shape}] {json.dumps(results[shape], indent=1)}")
        else:
            results[shape] = measure(shape, args)
            results[shape]["macs_per_token"] = forward_macs(shape, results[shape]["batch"],
                                                            args.softmax)
            print_result(shape, results[shape])
            print(f"  analytic MACs per token: {json.dumps(results[shape]['macs_per_token'])}")
        sys.stdout.flush()
    write_json(args.json, {"args": vars(args), "torch": torch.__version__,
                           "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
