"""Which segments of a BPTT window the last segment's loss reaches through the carried
memory: the check of a mechanism whose state carries a graph (ARMT's A and z, Titans'
weights and momentum). The trainer's BPTT depth k is a cut k segments back
(train/bptt.py `run_window`'s detach_before)."""

from __future__ import annotations

import torch

from data_pipeline.streams import SegmentBatch
from train.bptt import run_window

# (detach_before, reached) over 4 segments: no cut, a cut before segment 2, before 3.
CUTS = [(frozenset(), [True, True, True, True]),
        (frozenset({2}), [False, False, True, True]),
        (frozenset({3}), [False, False, False, True])]


def random_segments(n: int, vocab: int, seg_len: int, seed: int) -> list[SegmentBatch]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (2, n * seg_len + 1), generator=g)
    return [SegmentBatch(tokens=tokens[:, s * seg_len:(s + 1) * seg_len + 1],
                         reset=torch.zeros(2, dtype=torch.bool), loss_mask=None, epoch=0, step=s)
            for s in range(n)]


def segments_reached(model, segments: list[SegmentBatch], detach_before: frozenset,
                     checkpoint_segments: bool) -> list[bool]:
    """Only the last segment has a loss; whether its gradient reaches each segment's
    embeddings (one zero leaf per segment added to them, keyed by where the segment's
    tokens live, so a segment checkpoint's recompute adds the same leaf again)."""
    probes = {}

    def probe(_module, args, out):
        leaf = probes.setdefault(args[0].data_ptr(), torch.zeros((), requires_grad=True))
        return out + leaf
    handle = model.embedding.register_forward_hook(probe)
    try:
        counted = [False] * (len(segments) - 1) + [True]
        result = run_window(model, None, segments, torch.device("cpu"), counted=counted,
                            detach_before=detach_before,
                            checkpoint_segments=checkpoint_segments)
        result.loss.backward()
    finally:
        handle.remove()
    assert len(probes) == len(segments)
    return [p.grad is not None and p.grad.abs().item() > 0 for p in probes.values()]
