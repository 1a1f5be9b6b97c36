"""Evaluation cost: the vanilla sliding window against cached (Transformer-XL) evaluation.

Transformer-XL §3.1, §3.2 and Table 9: the vanilla model of Al-Rfou et al. scores
a token by running the whole window of the `context` tokens before it, with no memory, and
keeps only the last prediction; the window then moves right by ONE token and everything is
recomputed. Transformer-XL scores `tgt_len` tokens per forward and reuses the cached hidden
states of the previous `mem_len` positions instead of recomputing them.

Alignment, the same for both functions: `tokens` is [B, N]; the result is [B, N - 1] and
column t - 1 is the NLL (nats) of tokens[:, t] given what came before it (as with
`model(tokens[:, :-1], targets=tokens[:, 1:]).nll`).

When the two agree (tests/test_eval_speed.py): a Transformer-XL memory entry of layer n holds
the input of layer n+1 as it was computed in its own segment. While nothing has left the
memory (segment start s*tgt_len <= mem_len) every cached state is the full-prefix state, so
cached NLL = vanilla NLL with a context covering the whole prefix. After eviction they differ
in a multi-layer model (the recurrence reaches further back than the keys a query sees); a
1-layer model only reads cached embeddings, so it agrees wherever the key windows coincide.
LaMemo refreshes its memory with look-ahead attention (memory rows see tokens to their
right), which no causal recomputation produces: it agrees with vanilla only in its first
segment and, with one layer, wherever the windows coincide (the top layer's memory rows are
never read). RMT runs too, but its vanilla windows still read the initial memory tokens and
no equality is claimed for it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch

from model.backbone import Lengths
from model.lm import MemoryLM

# Positions (window rows x window length) per vanilla forward: enough rows for large
# matmuls, few enough that the [rows, heads, context, context] scores stay ~100 MB at 800.
_WINDOW_POSITIONS = 8192


@contextmanager
def _evaluation_mode(model: MemoryLM, **lengths) -> Iterator[None]:
    """Eval mode (no dropout) and, if given, other memory lengths; both restored after."""
    was_training = model.training
    model.eval()
    try:
        with model.using_lengths(**lengths):
            yield
    finally:
        model.train(was_training)


def _last_token_nll(model: MemoryLM, windows: torch.Tensor, lengths: Lengths) -> torch.Tensor:
    """windows [R, C+1]: inputs windows[:, :-1], target windows[:, -1] -> NLL [R].

    `model(windows[:, :-1], None, targets=...)` from an empty memory, except that only the last
    position goes through the softmax: the vanilla evaluator scores one token per window, and a
    267k-word adaptive softmax on every row would bill it for work it never needs.
    tests/test_eval_speed.py checks this against the plain forward."""
    h0 = model.drop(model.embedding(windows[:, :-1]))
    hidden, _ = model.core(h0, None, lengths)
    return model.softmax(hidden[:, -1], windows[:, -1])


@torch.inference_mode()
def vanilla_sliding_nll(model: MemoryLM, tokens: torch.Tensor, context: int, *,
                        first: int = 1, windows_per_forward: int | None = None
                        ) -> torch.Tensor:
    """Vanilla evaluation (Al-Rfou et al. 2018; XL §3.1): one full forward per scored token.

    Token t is scored by a forward over tokens[:, max(0, t-context) : t] with an EMPTY memory
    (every window starts from nothing, as `carry_memory=False` in evaluation/evaluate.py),
    keeping only the last position's prediction; the window then slides by one. Tokens with
    less than `context` history get the shorter prefix, one forward per length. Full-length
    windows are stacked `windows_per_forward` per row into one batch for speed; each is still
    computed from scratch. same_length is off (with no memory it would cut the window to mem_len).

    Returns [B, N - first]: column i is the NLL of tokens[:, first + i]. With first = 1 (the
    default) that is [B, N - 1], aligned with `cached_nll`.
    """
    if context < 1:
        raise ValueError(f"context must be >= 1, got {context}")
    bsz, n = tokens.shape
    if not 1 <= first < n:
        raise ValueError(f"first must be in [1, {n - 1}], got {first}")
    lengths = Lengths(mem_len=0, clamp_len=model.lengths.clamp_len, same_length=False)
    per = windows_per_forward or max(1, _WINDOW_POSITIONS // (bsz * context))
    parts = []
    with _evaluation_mode(model):
        for t in range(first, min(context, n)):  # short prefixes: one forward per length
            parts.append(_last_token_nll(model, tokens[:, :t + 1], lengths)[:, None])
        start = max(first, context)
        if start < n:
            # windows[:, i] = tokens[:, start - context + i : start + i + 1], a strided view
            windows = tokens[:, start - context:].unfold(1, context + 1, 1)
            for i in range(0, windows.shape[1], per):
                chunk = windows[:, i:i + per]
                rows = chunk.reshape(-1, context + 1)
                parts.append(_last_token_nll(model, rows, lengths).view(bsz, -1))
    return torch.cat(parts, dim=1)


def _cached_segments(model: MemoryLM, tokens: torch.Tensor, tgt_len: int, state=None):
    """Score tokens[:, 1:] segment by segment with the memory carried: (nll [B, N-1], state).
    The caller sets the lengths and eval mode."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    parts = []
    for s in range(0, inputs.shape[1], tgt_len):
        out = model(inputs[:, s:s + tgt_len], state, targets=targets[:, s:s + tgt_len])
        state = out.state
        parts.append(out.nll)
    return torch.cat(parts, dim=1), state


@torch.inference_mode()
def cached_nll(model: MemoryLM, tokens: torch.Tensor, tgt_len: int, mem_len: int, *,
               same_length: bool = False) -> torch.Tensor:
    """Transformer-XL evaluation (XL §3.2): segments of tgt_len from an empty memory,
    the memory (mem_len per layer) carried from segment to segment. The last segment may be
    shorter. same_length: every query sees exactly mem_len keys (the XL eval scripts).

    Returns [B, N - 1], aligned with `vanilla_sliding_nll`."""
    if tgt_len < 1:
        raise ValueError(f"tgt_len must be >= 1, got {tgt_len}")
    with _evaluation_mode(model, mem_len=mem_len, same_length=same_length):
        return _cached_segments(model, tokens, tgt_len)[0]


# ----------------------------------------------------------------------------- timing
@dataclass
class SpeedResult:
    """Tokens scored per CPU-second of each method at one attention length L."""

    attn_len: int  # L: the vanilla context, and mem_len + tgt_len of the cached run
    tgt_len: int
    mem_len: int
    batch: int
    # medians over the rounds
    vanilla_tokens_per_s: float
    cached_tokens_per_s: float
    # XL's own evaluation setting: mem_len = L with same_length, so that every query sees
    # exactly the L keys a vanilla query sees (at the price of L + tgt_len keys per segment)
    same_length_tokens_per_s: float
    # medians over the rounds of the per-round ratios to vanilla's tokens/s
    speedup: float
    speedup_same_length: float
    rounds: list[dict]

    def to_dict(self) -> dict:
        return asdict(self)


def default_tgt_len(attn_len: int) -> int:
    """attn_len // 4. The cached queries of a segment see mem_len + 1 .. mem_len + tgt_len
    keys, so this keeps every query within 3/4 .. 1 of the vanilla window (7/8 on average).
    A shorter segment narrows that gap but costs more per token: XL caches hidden states,
    not keys, so each segment projects keys and values for all mem_len + tgt_len rows
    (tokens/s per tgt_len: BENCHMARKS.md, "Evaluation speed: cached vs vanilla"). XL's own
    eval scripts use tgt_len 64-128 with mem_len 640-3800."""
    return max(1, attn_len // 4)


def _cpu_seconds(fn) -> float:
    """CPU time of this process (all threads): time stolen by the hypervisor of a shared VM
    is not charged to the process (benchmarks/common.py)."""
    start = time.process_time()
    fn()
    return time.process_time() - start


@torch.inference_mode()
def time_vanilla(model: MemoryLM, tokens: torch.Tensor, context: int) -> tuple[float, int]:
    """(CPU seconds, tokens scored) of vanilla evaluation with every window full-length:
    tokens [B, context + n] -> the last n tokens of every row are scored."""
    n_scored = tokens.shape[0] * (tokens.shape[1] - context)
    secs = _cpu_seconds(lambda: vanilla_sliding_nll(model, tokens, context, first=context))
    return secs, n_scored


@torch.inference_mode()
def time_cached(model: MemoryLM, tokens: torch.Tensor, tgt_len: int, mem_len: int,
                warm_segments: int, same_length: bool = False) -> tuple[float, int]:
    """(CPU seconds, tokens scored) of cached evaluation with a full memory: the first
    `warm_segments` segments of tokens [B, N] fill the memory untimed, the rest is timed."""
    warm = warm_segments * tgt_len
    with _evaluation_mode(model, mem_len=mem_len, same_length=same_length):
        _, state = _cached_segments(model, tokens[:, :warm + 1], tgt_len)
        rest = tokens[:, warm:]
        secs = _cpu_seconds(lambda: _cached_segments(model, rest, tgt_len, state))
    return secs, rest.shape[0] * (rest.shape[1] - 1)


def compare_speed(model: MemoryLM, attn_len: int, *, batch: int = 4,
                  tgt_len: int | None = None, vanilla_tokens: int = 16,
                  cached_tokens: int = 512, rounds: int = 3, seed: int = 0,
                  log=None) -> SpeedResult:
    """Tokens/s of vanilla evaluation (context attn_len) and of cached evaluation at the same
    attention length (mem_len + tgt_len = attn_len; and mem_len = attn_len with same_length),
    on random tokens (the cost does not depend on the values), `batch` rows.

    The methods run in `rounds` interleaved rounds (the order rotates) and each ratio is the
    median of the per-round ratios, so a slow patch of a shared machine hits both sides of a
    ratio alike. vanilla_tokens / cached_tokens: tokens scored per row and round (a vanilla
    token costs ~attn_len tokens' worth of forward, so it gets far fewer). Only full windows
    and full memories are timed; the untimed first call of each absorbs one-off costs."""
    tgt_len = tgt_len or default_tgt_len(attn_len)
    if not 1 <= tgt_len <= attn_len:
        raise ValueError(f"tgt_len must be in [1, attn_len={attn_len}], got {tgt_len}")
    mem_len = attn_len - tgt_len
    gen = torch.Generator().manual_seed(seed)
    vocab = model.cfg.vocab_size
    v_tokens = torch.randint(0, vocab, (batch, attn_len + vanilla_tokens), generator=gen)
    n_timed = max(1, -(-cached_tokens // tgt_len))
    variants = {"cached": (mem_len, False), "same_length": (attn_len, True)}
    c_tokens, warm = {}, {}
    for name, (mem, _) in variants.items():
        warm[name] = -(-mem // tgt_len)  # segments that fill the memory
        c_tokens[name] = torch.randint(0, vocab, (batch, (warm[name] + n_timed) * tgt_len + 1),
                                       generator=gen)

    def run(name: str, n_segments: int | None = None) -> float:
        if name == "vanilla":
            toks = v_tokens if n_segments is None else v_tokens[:, :attn_len + 1]
            secs, n = time_vanilla(model, toks, attn_len)
        else:
            w = warm[name]
            toks = c_tokens[name]
            if n_segments is not None:
                toks = toks[:, :(w + n_segments) * tgt_len + 1]
            mem, same = variants[name]
            secs, n = time_cached(model, toks, tgt_len, mem, w, same)
        return n / secs

    names = ["vanilla", *variants]
    for name in names:
        run(name, n_segments=1)  # warm-up
    per_round = []
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        tps = {name: run(name) for name in order}
        tps["speedup"] = tps["cached"] / tps["vanilla"]
        tps["speedup_same_length"] = tps["same_length"] / tps["vanilla"]
        per_round.append(tps)
        if log:
            log(f"  L={attn_len} round {r + 1}/{rounds}: vanilla {tps['vanilla']:.1f}, cached "
                f"{tps['cached']:.0f}, same_length {tps['same_length']:.0f} tokens/s; "
                f"{tps['speedup']:.0f}x / {tps['speedup_same_length']:.0f}x")

    def med(key: str) -> float:
        return statistics.median(x[key] for x in per_round)

    return SpeedResult(
        attn_len=attn_len, tgt_len=tgt_len, mem_len=mem_len, batch=batch,
        vanilla_tokens_per_s=med("vanilla"), cached_tokens_per_s=med("cached"),
        same_length_tokens_per_s=med("same_length"), speedup=med("speedup"),
        speedup_same_length=med("speedup_same_length"), rounds=per_round)
