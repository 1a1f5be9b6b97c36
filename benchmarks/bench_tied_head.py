"""The tied adaptive softmax's weight gradient: one split vs a slice per cluster.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_tied_head.py [--batch 2] [--rounds 7]

At the WikiText-103 base shape (benchmarks/bench_lamemo_cost.py SHAPES["wt103"]: 267,735
words, cutoffs 20000/40000/200000, div_val 1, tied weights) the softmax's clusters are row
blocks of the embedding matrix [267735, 410]. Cut with one slice per cluster, each slice's
backward makes a zero-filled [267735, 410] gradient (440 MB, fresh pages every step on the
CPU) and the four are summed into the parameter's gradient; cut with one `split`
(model/adaptive.py `_cluster_params`), one backward writes the whole gradient once.

Variants per mechanism (XL, LaMemo): "slices" (the previous code, patched in here) and
"split" (the code as it is), four models in one process, one training step each per round
in rotating order (benchmarks/common.py `interleaved`), CPU time per step, ratios = medians
of per-round ratios. A step = forward + backward of one 150-token segment per row with the
memory carried (+ Adam with --optimizer).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import types

import torch
from bench_lamemo_cost import Runner
from common import interleaved, write_json


def _slices_per_cluster(self):
    """The code before: a separate row slice of the one matrix per cluster."""
    return [(self.out_weights[0][lo:hi], self.out_biases[0][lo:hi])
            for lo, hi in zip(self.ends[:-1], self.ends[1:], strict=True)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--optimizer", action="store_true", help="include an Adam step")
    p.add_argument("--json", help="also write the results to this file")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    # What Runner reads from the bench_lamemo_cost arguments.
    a.dropout, a.tokens = 0.1, "zipf"
    runners = {}
    for mech in ("xl", "lamemo"):
        for variant in ("slices", "split"):
            r = Runner("wt103", mech, "one_pass", a, a.batch)
            if variant == "slices":
                sm = r.model.softmax
                sm._cluster_params = types.MethodType(_slices_per_cluster, sm)
            runners[f"{mech}-{variant}"] = r
    for r in runners.values():
        for _ in range(a.warmup):
            r.step()
    times = interleaved({n: r.step for n, r in runners.items()}, a.rounds,
                        lambda rnd: print(f"round {rnd + 1}/{a.rounds}", flush=True))
    pairs = {"xl split/slices": ("xl-split", "xl-slices"),
             "lamemo split/slices": ("lamemo-split", "lamemo-slices"),
             "lamemo/xl, slices": ("lamemo-slices", "xl-slices"),
             "lamemo/xl, split": ("lamemo-split", "xl-split")}
    ratios = {k: [x / y for x, y in zip(times[n], times[d], strict=True)]
              for k, (n, d) in pairs.items()}
    print(f"torch {torch.__version__}, {a.threads} threads, WikiText-103 base shape, batch "
          f"{a.batch}, optimizer {'yes' if a.optimizer else 'no'}, {a.rounds} rounds")
    for n, t in times.items():
        print(f"  {n:<16} median CPU s/step {statistics.median(t):.3f}")
    for k, v in ratios.items():
        print(f"  {k:<22} {statistics.median(v):.3f}  (rounds {min(v):.3f}-{max(v):.3f})")
    write_json(a.json, {"args": vars(a), "cpu_s": times, "round_ratios": ratios,
                        "median_ratio": {k: statistics.median(v) for k, v in ratios.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
