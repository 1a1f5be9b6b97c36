"""Evaluation: bpc / ppl of a split with the memory carried, under a stated protocol.

The papers evaluate with other lengths than they train with (XL §3.3 and §4.5: a shorter
tgt_len, a much longer mem_len, clamp_len, same_length), so every number leaves here with the
protocol that produced it. Streams are read exactly as in training (contiguous rows, memory
carried from segment to segment); the first `skip_segments` of every row can be left out of
the score so that each counted token has a full memory behind it. Rows are split across
ranks and the sums all-reduced, so the result does not depend on the world size.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch

from data_pipeline.shards import Manifest
from data_pipeline.streams import EpisodeStream, TokenStream
from model import bits_per_token
from model.backbones import check_segment_positions

from .bptt import run_window
from .config import EvalConfig, RunConfig
from .distributed import all_reduce_sum

# Character-level vocabularies report bits per character, word-level ones perplexity.
_CHAR_VOCABS = ("bytes", "symbols", "chars")


@dataclass
class EvalProtocol:
    split: str
    tgt_len: int
    mem_len: int
    clamp_len: int
    same_length: bool
    batch: int
    skip_segments: int
    max_segments: int
    # False: every segment starts from an empty memory (the memory switched off; works the
    # same for all three mechanisms, RMT's memory tokens included).
    carry_memory: bool = True
    # Which copy of the weights was scored: "fp32", or in a bf16/fp16 run "bf16 (training
    # copy)" during training and "fp32 (master copy)" in the final report and `memtrain
    # eval` (train/master_weights.py). Empty: not stated (the sweep and other tools).
    weights: str = ""

    def describe(self) -> str:
        return (f"{self.split}: tgt_len {self.tgt_len}, mem_len {self.mem_len}, clamp_len "
                f"{self.clamp_len}, same_length {self.same_length}, {self.batch} rows, "
                f"first {self.skip_segments} segments of each row not scored"
                + (f", {self.max_segments} segments per row" if self.max_segments else "")
                + ("" if self.carry_memory else ", memory reset before every segment")
                + (f", weights {self.weights}" if self.weights else ""))


def protocol_for(cfg: RunConfig, ev: EvalConfig | None = None, split: str | None = None,
                 **changes) -> EvalProtocol:
    ev = ev or cfg.eval
    m = cfg.model
    proto = EvalProtocol(
        split=split or ev.split, **ev.lengths(m)._asdict(),
        batch=ev.batch or cfg.data.global_batch, skip_segments=ev.skip_segments,
        max_segments=ev.max_segments)
    for key, value in changes.items():
        setattr(proto, key, value)
    m.check_lengths(proto.mem_len, proto.clamp_len, proto.same_length, "eval")
    # The backbone may not place every length (a learned position table ends).
    check_segment_positions(m, proto.tgt_len, "eval.tgt_len")
    return proto


def headline(report: dict) -> str:
    """One line: the metric the corpus is reported in, with its protocol."""
    if "accuracy" in report:
        main = f"loss {report['loss']:.4f}, accuracy {report['accuracy']:.4f}"
    elif report.get("metric") == "bpc":
        main = f"bpc {report['bpc']:.4f} (loss {report['loss']:.4f} nats)"
    else:
        main = f"ppl {report['ppl']:.2f} (loss {report['loss']:.4f} nats)"
    return f"{main} on {report['tokens']:.0f} tokens [{report['protocol_text']}]"


@torch.no_grad()
def evaluate(forward, model, manifest: Manifest, proto: EvalProtocol, rank: int,
             world_size: int, device: torch.device, *, url_template: str | None = None,
             seed: int = 0, n_segments: int | None = None) -> dict:
    """Score `proto.split`. `forward` is the engine (ZeRO-3 gathers parameters in its hooks)
    or the bare model; `model` is the module whose lengths are switched for the protocol.
    n_segments: cut task samples into this many segments (a curriculum stage) instead of the
    task's own count."""
    was_training = model.training
    model.eval()
    start = time.perf_counter()
    try:
        with model.using_lengths(proto.mem_len, proto.clamp_len, proto.same_length):
            if manifest.episodic:
                sums = _episodes(forward, manifest, proto, rank, world_size, device, seed,
                                 url_template, n_segments)
            else:
                sums = _stream(forward, manifest, proto, rank, world_size, device,
                               url_template)
    finally:
        model.train(was_training)
    nll, n, correct = all_reduce_sum(sums, device)
    loss = nll / max(n, 1)
    report = {"split": proto.split, "loss": loss, "bpc": bits_per_token(loss),
              "ppl": math.exp(min(loss, 700)), "tokens": n,
              "metric": "bpc" if manifest.vocab.get("kind") in _CHAR_VOCABS else "ppl",
              "seconds": time.perf_counter() - start, "protocol": asdict(proto),
              "protocol_text": proto.describe()}
    if manifest.episodic:
        report["accuracy"] = correct / max(n, 1)
        report["metric"] = "accuracy"
    return report


def _stream(forward, manifest, proto, rank, world_size, device, url_template):
    stream = TokenStream(manifest, proto.split, proto.batch, proto.tgt_len, rank, world_size,
                         url_template=url_template or None)
    n_steps = stream.steps_per_epoch
    if proto.max_segments:
        n_steps = min(n_steps, proto.max_segments)
    if proto.skip_segments >= n_steps:
        raise ValueError(f"eval: skipping {proto.skip_segments} segments leaves nothing of "
                         f"the {n_steps} segments per row of {proto.split!r}")
    state, nll, n = None, 0.0, 0
    for t, seg in zip(range(n_steps), stream, strict=False):
        res = run_window(forward, state, [seg], device)
        state = res.state if proto.carry_memory else None
        if t >= proto.skip_segments:
            nll += float(res.nll_sum)
            n += int(res.n_tokens)
    return [nll, n, 0]


def _episodes(forward, manifest, proto, rank, world_size, device, seed, url_template,
              n_segments):
    stream = EpisodeStream(manifest, proto.split, proto.batch, rank, world_size, seed=seed,
                           shuffle=False, url_template=url_template or None,
                           n_segments=n_segments)
    n_batches = stream.episodes_per_epoch
    if proto.max_segments:
        n_batches = min(n_batches, max(1, proto.max_segments // stream.n_segments))
    nll, n, correct = 0.0, 0, 0
    for _, segs in zip(range(n_batches), stream, strict=False):
        if not proto.carry_memory:  # the memory switched off: every segment starts fresh
            for seg in segs:
                seg.reset[:] = True
        res = run_window(forward, None, segs, device, score=True)
        nll += float(res.nll_sum)
        n += int(res.n_tokens)
        correct += int(res.correct)
    return [nll, n, correct]
