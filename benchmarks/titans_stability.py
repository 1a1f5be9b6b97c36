"""Titans' numerical stability in training: the quickstart stream and associative retrieval,
several seeds each, every step checked for a non-finite loss, gradient norm or memory
state (the NaNs users of other implementations report after a few or a few thousand
steps). docs/titans.md reports the figures.

    .venv/bin/python benchmarks/titans_stability.py --task quickstart --seeds 0,1,2,3,4 \
        --steps 2000 --json benchmarks/results/titans_stability_quickstart.json
    .venv/bin/python benchmarks/titans_stability.py --task ar --seeds 0,1,2,3,4 \
        --steps 2000 --json benchmarks/results/titans_stability_ar.json

quickstart: the repeat-block stream of configs/quickstart.yaml (`memtrain smoke`'s
generator), its backbone (2 layers, d_model 64) with mem_len 0 and pre-LN, BPTT windows of
2 segments of 16, 16 streams. ar: associative retrieval with 4 pairs, one pair per segment
of 2 positions (configs/ar-armt-cpu.yaml's task and backbone: 6 layers, d_model 64), full
BPTT over the 5 segments, `--batch` samples a step (128 in the config; the figures in
docs/titans.md used 32 to fit five seeds in the time there was); the loss is the answer's
and the accuracy the argmax at the answer, over the training batches. Both: the Titans
defaults of `model.titans` (d_mem 32, depth 2, chunk 16, 4 persistent, max_lr 0.5,
max_momentum 0.9, max_forget 1, max_grad_norm 1), Adam at lr 1e-3, gradient clip 0.25.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from data_pipeline.tasks import generate, make_task
from model import ModelConfig, build_model
from train.smoke import _segments, _stream


def model_config(task: str, **titans) -> ModelConfig:
    if task == "quickstart":
        size = dict(vocab_size=16, n_layer=2, d_model=64, n_head=4, d_inner=256, tgt_len=16)
    else:
        size = dict(vocab_size=38, n_layer=6, d_model=64, n_head=4, d_head=32, d_inner=128,
                    tgt_len=2)
    return ModelConfig(mechanism="titans", mem_len=0, dropout=0.0, pre_lnorm=True,
                       titans=titans, **size)


def windows(task: str, steps: int, seed: int, batch: int):
    """(inputs, targets, loss_mask) per segment, a list per window (one optimizer step)."""
    if task == "quickstart":
        n_tokens = steps * 2 * 16 * 16
        tokens, repeat = _stream(n_tokens // 28 + 32, seed)
        segs = [(x, y, None) for x, y, _ in _segments(tokens, repeat)]
        for i in range(0, 2 * steps, 2):
            yield segs[i:i + 2]
        return
    spec = make_task("associative_retrieval", n_pairs=4, n_segments=5)
    seg = spec.segment_len
    for step in range(steps):
        data = generate(spec, batch, seed * 1_000_003 + step)
        x, y = torch.from_numpy(data.inputs), torch.from_numpy(data.targets)
        mask = torch.from_numpy(data.loss_mask)
        yield [(x[:, s * seg:(s + 1) * seg], y[:, s * seg:(s + 1) * seg],
                mask[:, s * seg:(s + 1) * seg]) for s in range(spec.n_segments)]


def finite_state(state) -> tuple[bool, float]:
    tensors = state.weights + state.momentum
    top = max(float(t.abs().max()) for t in tensors)
    return math.isfinite(top), top


def run(task: str, seed: int, steps: int, batch: int, log_every: int) -> dict:
    torch.manual_seed(seed)
    model = build_model(model_config(task)).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses, accuracy, first_bad, largest = [], [], None, 0.0
    start = time.process_time()
    for step, window in enumerate(windows(task, steps, seed, batch)):
        state, total, counted, hits, answers = None, 0.0, 0, 0, 0
        for x, y, mask in window:
            scored = mask is None or bool(mask.any())
            out = model(x, state, targets=y, loss_mask=mask, return_log_probs=mask is not None)
            if scored:
                total, counted = total + out.loss, counted + 1
            if mask is not None and scored:   # answer accuracy (argmax), teacher-forced
                hits += int((out.log_probs.argmax(-1) == y)[mask].sum())
                answers += int(mask.sum())
            state = out.state
        opt.zero_grad(set_to_none=True)
        total.backward()
        grad = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25))
        ok, top = finite_state(state)
        largest = max(largest, top) if ok else largest
        loss = float(total) / counted
        if first_bad is None and not (ok and math.isfinite(loss) and math.isfinite(grad)):
            first_bad = step
        opt.step()
        losses.append(loss)
        if answers:
            accuracy.append(hits / answers)
        if log_every and step % log_every == 0:
            print(f"  {task} seed {seed} step {step}: loss {loss:.4f} |grad| {grad:.3f} "
                  f"max|M,S| {top:.3g}", flush=True)
    tail = losses[-100:]
    return {"task": task, "seed": seed, "steps": len(losses), "first_non_finite_step": first_bad,
            "final_loss_mean_last_100": sum(tail) / len(tail), "first_loss": losses[0],
            "answer_accuracy_last_100": (sum(accuracy[-100:]) / len(accuracy[-100:])
                                         if accuracy else None),
            "largest_state_entry": largest, "cpu_seconds": time.process_time() - start}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=["quickstart", "ar"], required=True)
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch", type=int, default=128, help="ar: samples a step")
    p.add_argument("--log-every", type=int, default=500)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = []
    for seed in (int(s) for s in args.seeds.split(",")):
        r = run(args.task, seed, args.steps, args.batch, args.log_every)
        print(json.dumps(r), flush=True)
        results.append(r)
        if args.json:   # after every seed: a run cut short keeps what it measured
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "runs": results}, f, indent=1)
    bad = [r["seed"] for r in results if r["first_non_finite_step"] is not None]
    print(f"{args.task}: {len(results)} seeds x {args.steps} steps, non-finite in seeds {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
