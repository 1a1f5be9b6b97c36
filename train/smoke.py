"""Model smoke run: train tiny models briefly on a long-range stream and show memory helps.

Plain PyTorch (one process, AdamW), no DeepSpeed: it checks that every mechanism trains and
carries its memory, in about a minute on two CPU cores. The full engine is `memtrain train`.

The stream is [A | filler | A] blocks (data_pipeline/synthetic.py), shrunk so that a tiny
model learns it in seconds: A is 12 symbols, the filler 4, so every repeated token sits
exactly one segment (16 tokens) back and only a memory can see it. The metric is the loss on
the repeated tokens of a held-out stream, read with the memory carried; the no-memory
baseline (Transformer-XL with mem_len 0, "Transformer + RPE") is printed beside it. Chance
is ln(16) = 2.77 nats.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from data_pipeline.synthetic import contiguous_streams, repeat_block_stream
from model import ModelConfig, build_model
from model.registry import get, names

SEG_LEN = 16
N_STREAMS = 16
BLOCK, FILLER, N_SYMBOLS = 12, 4, 16


def _config(mechanism: str, mem_len: int) -> ModelConfig:
    # RMT runs pre-LN: post-LN write rows echo their own input and the memory path gets
    # almost no gradient, so it stays at chance (docs/rmt.md).
    return ModelConfig(mechanism=mechanism, vocab_size=N_SYMBOLS, n_layer=2, d_model=64,
                       n_head=4, d_inner=256, dropout=0.0, tgt_len=SEG_LEN, mem_len=mem_len,
                       pre_lnorm=get(mechanism).memory_tokens, rmt={"num_mem_tokens": 16},
                       armt={"d_key": 16})


def _stream(n_blocks: int, seed: int):
    return repeat_block_stream(n_blocks, block=BLOCK, filler=FILLER, n_symbols=N_SYMBOLS,
                               seed=seed)


def _segments(tokens: torch.Tensor, repeat: torch.Tensor):
    """Yield (input [B, L], target [B, L], target-is-repeat [B, L]) in stream order."""
    toks, rep = contiguous_streams(tokens, N_STREAMS), contiguous_streams(repeat, N_STREAMS)
    for start in range(0, toks.shape[1] - SEG_LEN - 1, SEG_LEN):
        sl = slice(start, start + SEG_LEN)
        nxt = slice(start + 1, start + SEG_LEN + 1)
        yield toks[:, sl], toks[:, nxt], rep[:, nxt]


def train_one(mechanism: str, mem_len: int, steps: int, seed: int, bptt_depth: int):
    torch.manual_seed(seed)
    model = build_model(_config(mechanism, mem_len))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    n_tokens = steps * (bptt_depth + 1) * SEG_LEN * N_STREAMS
    tokens, repeat = _stream(n_tokens // (2 * BLOCK + FILLER) + 2 * N_STREAMS, seed)
    segs = list(_segments(tokens, repeat))
    state, window_loss, step, start = None, 0.0, 0, time.perf_counter()
    model.train()
    # Truncated BPTT over windows of bptt_depth+1 segments, one backward per window
    # (only RMT's memory carries gradient; XL/LaMemo states are detached by construction).
    for i, (x, y, _) in enumerate(segs):
        out = model(x, state, targets=y)
        window_loss = window_loss + out.loss
        state = out.state
        if (i + 1) % (bptt_depth + 1) == 0:
            opt.zero_grad(set_to_none=True)
            window_loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
            opt.step()
            state, window_loss, step = state.detach(), 0.0, step + 1
            if step >= steps:
                break
    seconds = time.perf_counter() - start
    return model, seconds


@torch.no_grad()
def evaluate(model, seed: int) -> float:
    """Mean NLL (nats) on the repeated tokens of a held-out stream, memory carried."""
    model.eval()
    tokens, repeat = _stream(400, seed=seed + 1000)
    state, total, count = None, 0.0, 0
    for x, y, rep in _segments(tokens, repeat):
        out = model(x, state, targets=y, loss_mask=rep)
        state = out.state
        total += out.nll.sum().item()
        count += int(out.n_tokens)
    return total / max(count, 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="memtrain smoke", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mechanism", choices=["all", *names()], default="all")
    parser.add_argument("--steps", type=int, default=500, help="optimizer steps per model")
    parser.add_argument("--seed", type=int, default=0)
    # Tiny tensors: one intra-op thread is fastest (a second one mostly waits).
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args(argv)
    if args.steps <= 0:
        parser.error(f"--steps must be > 0, got {args.steps}")
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    # (label, mechanism, mem_len, BPTT depth): RMT's (and ARMT's) memory tokens learn to
    # write only if the next segment's loss reaches them, so they train on windows of 2.
    runs = [("baseline (xl, mem_len 0)", "xl", 0, 0)]
    # "all": those in the smoke set (ARMT only by name: on this stream it stays at chance to
    # 1000 steps, docs/armt.md, so it would not show what the smoke run is for).
    mechs = ([m for m in names() if get(m).in_smoke] if args.mechanism == "all"
             else [args.mechanism])
    runs += [(m, m, 0, 1) if get(m).memory_tokens else (m, m, SEG_LEN, 0) for m in mechs]
    print(f"repeat-block stream, segment {SEG_LEN}, {N_STREAMS} streams, {args.steps} steps; "
          f"chance = ln 16 = {math.log(16):.3f} nats")
    print(f"{'model':<26}{'params':>9}{'repeat NLL':>12}{'train s':>9}")
    results = {}
    for label, mech, mem_len, depth in runs:
        model, secs = train_one(mech, mem_len, args.steps, args.seed, depth)
        results[label] = evaluate(model, args.seed)
        print(f"{label:<26}{model.num_params():>9}{results[label]:>12.3f}{secs:>9.1f}")
    return 0
