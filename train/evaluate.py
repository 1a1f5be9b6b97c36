"""Evaluation: bpc / ppl of a split with the memory carried, under a stated protocol.

The papers evaluate with other lengths than they train with (XL §3.3 and §4.5: a shorter
tgt_len, a much longer mem_len, clamp_len, same_length), so every number leaves here with the
protocol that produced it. Streams are read exactly as in training (contiguous rows, memory
carried from segment to segment); the first `skip_segments` of every row can be left out of
the score so that each counted token has a full memory behind it. Rows are split across
ranks and the sums all-reduced, so the result does not depend on the world size. Task
samples are scored sample by sample from fresh memory, with their answer accuracy; both loops
are the data regime's (train/regime.py).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch

from data_pipeline.shards import Manifest
from model import bits_per_token
from model.backbones import check_segment_positions

from .config import EvalConfig, RunConfig
from .process_group import all_reduce_sum
from .regime import regime_of

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
    task's own count. How the split is read and scored is its data regime's
    (train/regime.py)."""
    regime = regime_of(manifest)
    was_training = model.training
    model.eval()
    start = time.perf_counter()
    try:
        with model.using_lengths(proto.mem_len, proto.clamp_len, proto.same_length):
            sums = regime.score(forward, proto, rank, world_size, device, seed=seed,
                                url_template=url_template, n_segments=n_segments)
    finally:
        model.train(was_training)
    nll, n, correct = all_reduce_sum(sums, device)
    loss = nll / max(n, 1)
    report = {"split": proto.split, "loss": loss, "bpc": bits_per_token(loss),
              "ppl": math.exp(min(loss, 700)), "tokens": n,
              "metric": "bpc" if manifest.vocab.get("kind") in _CHAR_VOCABS else "ppl",
              "seconds": time.perf_counter() - start, "protocol": asdict(proto),
              "protocol_text": proto.describe()}
    report.update(regime.task_metrics(correct, n))
    return report

