"""Why does an RMT learn (or not)? Train a small RMT on a memory task in plain PyTorch and
measure, every few steps, the three quantities that decide whether the memory is used:

- grad_mem / grad_tok: gradient norm of the loss reaching the memory path (the memory tokens
  that leave each segment) against the token path (the token embeddings of the scored
  segments). A memory path whose gradient vanishes cannot learn to write.
- write_change: relative change of the first segment's write outputs when that segment's
  tokens are replaced by another sample's. Near 0, the memory carries nothing of the segment.
- read_mass: attention mass the tokens of the second segment put on the read block (mean over
  layers, heads and token rows). Near 0, the tokens ignore the memory.

It is the measurement behind the RMT defaults of configs/*-rmt-cpu.yaml (docs/rmt.md): one
variant per run, e.g.

    .venv/bin/python benchmarks/rmt_diagnostics.py --variant authors      # post-LN, N(0,1)
    .venv/bin/python benchmarks/rmt_diagnostics.py --variant pre_lnorm

Variants change one thing at a time against the authors' setting (post-LN, initial memory
N(0, 1) with all rows equal; RMT code) unless named otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np
import torch

from data_pipeline import tasks
from model import ModelConfig, build_model

# name -> (pre_lnorm, initial memory std (None: init_std * sqrt(d)), equal rows, lr, warmup)
VARIANTS = {
    "authors": (False, 1.0, True, 1e-3, 0),
    "post_small_init": (False, None, False, 1e-3, 0),
    "post_warmup_lr1e-4": (False, 1.0, True, 1e-4, 200),
    "pre_lnorm_authors_init": (True, 1.0, True, 1e-3, 0),
    "pre_lnorm": (True, None, False, 1e-3, 0),
    "pre_lnorm_lr1e-4": (True, None, False, 1e-4, 0),
}


def build(args, variant: str, spec):
    pre, init_std, equal_rows, _, _ = VARIANTS[variant]
    cfg = ModelConfig(mechanism="rmt", vocab_size=spec.vocab_size, n_layer=args.n_layer,
                      d_model=args.d_model, n_head=4, d_inner=2 * args.d_model,
                      dropout=0.1, tgt_len=spec.segment_len, mem_len=0, pre_lnorm=pre,
                      rmt={"num_mem_tokens": args.mem_tokens})
    model = build_model(cfg)
    init = model.core.memory_init.value
    with torch.no_grad():
        if init_std is not None:
            init.normal_(0.0, init_std)
        if equal_rows:  # the authors' `[randn(1, d)] * m`: one vector repeated
            init.copy_(init[:1].expand_as(init))
    return model


def run_sample(model, tokens, loss_mask, spec, record=False):
    """Full BPTT through the sample; returns (mean loss, outgoing memories, embeddings)."""
    L, state, nll, n = spec.segment_len, None, 0.0, 0
    mems, embs = [], []

    def keep(_module, _inputs, out):
        if record and out.requires_grad:
            out.retain_grad()
            embs.append(out)

    hook = model.embedding.register_forward_hook(keep)
    try:
        for s in range(spec.n_segments):
            x = tokens[:, s * L:(s + 1) * L]
            y = tokens[:, s * L + 1:(s + 1) * L + 1]
            out = model(x, state, targets=y, loss_mask=loss_mask[:, s * L:(s + 1) * L])
            state = out.state
            if record and state.tokens.requires_grad:
                state.tokens.retain_grad()
            mems.append(state.tokens)
            nll, n = nll + out.nll.sum(), n + int(out.n_tokens)
    finally:
        hook.remove()
    return nll / max(n, 1), mems, embs


@torch.no_grad()
def write_change(model, tokens, spec) -> float:
    L = spec.segment_len
    a = model(tokens[:, :L], None).state.tokens
    b = model(tokens.roll(1, dims=0)[:, :L], None).state.tokens
    return float((a - b).norm() / a.norm())


@torch.no_grad()
def read_mass(model, tokens, spec) -> float:
    """Mean attention of segment-2 token rows on the read block."""
    L = spec.segment_len
    state = model(tokens[:, :L], None).state
    logs = []
    for layer in model.core.layers:
        layer.attn.attn_log = logs
    try:
        model(tokens[:, L:2 * L], state)
    finally:
        for layer in model.core.layers:
            layer.attn.attn_log = None
    masses = []
    for rec in logs:
        spans, start = {}, 0
        for name, length in rec.layout.blocks:
            spans[name] = (start, start + length)
            start += length
        q0, q1 = spans["segment"]
        k0, k1 = spans["read"]
        masses.append(float(rec.prob[:, :, q0:q1, k0:k1].sum(-1).mean()))
    return float(np.mean(masses))


@torch.no_grad()
def accuracy(model, data, spec) -> float:
    L, state, hits, total = spec.segment_len, None, 0, 0
    tokens = torch.as_tensor(data.tokens)
    answer = torch.as_tensor(data.answer_mask)
    for s in range(spec.n_segments):
        x = tokens[:, s * L:(s + 1) * L]
        y = tokens[:, s * L + 1:(s + 1) * L + 1]
        out = model(x, state, return_log_probs=True)
        state = out.state
        mask = answer[:, s * L:(s + 1) * L]
        hits += int(((out.log_probs.argmax(-1) == y) & mask).sum())
        total += int(mask.sum())
    return hits / max(total, 1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", choices=sorted(VARIANTS), default="authors")
    p.add_argument("--task", default="copy", choices=["copy", "reverse"])
    p.add_argument("--src-len", type=int, default=8)
    p.add_argument("--n-segments", type=int, default=3)
    p.add_argument("--mem-tokens", type=int, default=8)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", help="write the measurements here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    spec = tasks.make_task(args.task, src_len=args.src_len, n_segments=args.n_segments)
    train = tasks.generate(spec, 20_000, tasks.split_seed(args.seed, "train"))
    test = tasks.generate(spec, 500, tasks.split_seed(args.seed, "test"))
    model = build(args, args.variant, spec)
    _, _, _, lr, warmup = VARIANTS[args.variant]
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    rng = np.random.default_rng(args.seed)
    probe = torch.as_tensor(test.tokens[:64])
    rows, start = [], time.perf_counter()
    print(f"variant {args.variant}: {args.task} src {args.src_len}, {args.n_segments} segments"
          f" of {spec.segment_len}, m={args.mem_tokens}; chance accuracy ~1/8")
    for step in range(1, args.steps + 1):
        model.train()
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, step / warmup) if warmup else lr
        idx = rng.integers(0, len(train.tokens), args.batch)
        record = step % args.every == 0
        loss, mems, embs = run_sample(model, torch.as_tensor(train.tokens[idx]),
                                      torch.as_tensor(train.loss_mask[idx]), spec, record)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if record:
            # Memory path: the memories that feed a later segment. Token path: embeddings of
            # the segments that carry loss (all but the first, for copy and reverse).
            g_mem = math.sqrt(sum(float(m.grad.norm()) ** 2 for m in mems[:-1]
                                  if m.grad is not None))
            g_tok = math.sqrt(sum(float(e.grad.norm()) ** 2 for e in embs[1:]
                                  if e.grad is not None))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        opt.step()
        if record:
            model.eval()
            row = {"step": step, "loss": float(loss.detach()), "grad_mem": g_mem, "grad_tok": g_tok,
                   "write_change": write_change(model, probe, spec),
                   "read_mass": read_mass(model, probe, spec),
                   "accuracy": accuracy(model, test, spec),
                   "seconds": time.perf_counter() - start}
            rows.append(row)
            print(" ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                           for k, v in row.items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"variant": args.variant, "args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
