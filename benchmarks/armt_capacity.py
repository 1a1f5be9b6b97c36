"""Associative-retrieval capacity of trained runs: answer accuracy against the number of
key-value pairs stored (the capacity curve of the ARMT paper, Rodkin et al. 2024).

    .venv/bin/python benchmarks/armt_capacity.py runs/ar-armt-cpu runs/ar-armt-as-rmt-cpu \
        --pairs 1,2,3,4,6,8,12,16,20,26 --samples 500 --json benchmarks/results/armt_capacity.json

Each run's exported model (model.safetensors) reads n pairs, one per segment of 2 positions
(`k v`), then the segment `q START`, with its memory carried; the score is the argmax at the
answer position, teacher-forced, as `memtrain train` scores the task. Samples are
`associative_rewrite` with n_rewrites 0 (data_pipeline/tasks.py): n distinct keys up to 26,
values drawn with replacement (associative_retrieval's distinct values stop at 10 pairs).
A run trained on 4 pairs meets every larger n here for the first time: the curve says how
far its memory holds bindings beyond what it was trained on. Capacity = the largest n
such that every n' <= n measured is answered at >= the threshold (0.9).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from data_pipeline.tasks import generate, make_task
from model import load_model


def accuracy(model, n_pairs: int, samples: int, seed: int, batch: int = 250) -> float:
    spec = make_task("associative_rewrite", n_pairs=n_pairs, n_rewrites=0,
                     n_segments=n_pairs + 1)
    data = generate(spec, samples, seed)
    seg = spec.segment_len
    tokens = torch.from_numpy(data.inputs)
    answers = torch.from_numpy(data.targets[:, -1])
    correct = 0
    with torch.no_grad():
        for start in range(0, samples, batch):
            rows, state = tokens[start:start + batch], None
            for s in range(spec.n_segments):
                out = model(rows[:, s * seg:(s + 1) * seg], state, return_log_probs=True)
                state = out.state
            guess = out.log_probs[:, -1].argmax(-1)
            correct += int((guess == answers[start:start + batch]).sum())
    return correct / samples


def capacity(curve: dict[int, float], threshold: float) -> int:
    best = 0
    for n in sorted(curve):
        if curve[n] < threshold:
            break
        best = n
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run directories (their model.safetensors)")
    p.add_argument("--pairs", default="1,2,3,4,6,8,12,16,20,26")
    p.add_argument("--samples", type=int, default=500)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", help="also write the results to this file")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    pairs = [int(x) for x in a.pairs.split(",")]
    if any(not 1 <= n <= 26 for n in pairs):
        p.error("--pairs: each n must be in [1, 26] (26 distinct keys)")
    results = {}
    for run in a.runs:
        path = Path(run) / "model.safetensors"
        if not path.is_file():
            p.error(f"{path} not found: train the run to its end (or `memtrain export`)")
        model = load_model(path).eval()
        curve = {n: accuracy(model, n, a.samples, a.seed) for n in pairs}
        results[run] = {"mechanism": model.cfg.mechanism, "curve": curve,
                        "capacity": capacity(curve, a.threshold)}
    print(f"accuracy by pairs stored ({a.samples} samples each, seed {a.seed}); capacity = "
          f"largest n with every n' <= n at >= {a.threshold}")
    print(f"{'pairs':>6}" + "".join(f"{Path(r).name:>22}" for r in results))
    for n in pairs:
        print(f"{n:>6}" + "".join(f"{r['curve'][n]:>22.3f}" for r in results.values()))
    print(f"{'cap.':>6}" + "".join(f"{r['capacity']:>22}" for r in results.values()))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"args": vars(a), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
