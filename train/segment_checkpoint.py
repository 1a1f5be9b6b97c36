"""Segment checkpointing, applied to the model from the training loop.

A checkpointed segment keeps none of its decoder's activations for backward, only its
inputs (the tokens and the incoming memory) and the rows the head reads, and re-runs the
decoder inside the backward. Across a BPTT window this leaves only the memory passed
between segments alive, so the peak hardly grows with the depth k (`bptt.checkpoint_segments`;
README, "Segment checkpointing").

The model does not decide this: `SegmentLM.forward(..., run_decode=)` (model/segment_lm.py)
runs its decoder through whatever runner it is handed, and train/bptt.py hands it a
`SegmentCheckpoint` for the segments it checkpoints. The runner goes in as an argument of
the model's forward because the training step calls the model through the DeepSpeed engine:
the checkpoint has to wrap the module's own decoder, under the engine, since wrapping the
engine call would re-run the engine's bookkeeping (ZeRO-3's parameter coordinator, timers)
inside the backward.

Non-reentrant checkpointing: one backward per step (what ZeRO-2/3 require); the RNG state is
restored so dropout recomputes identically. `recompute` names what a checkpointed segment
keeps besides its inputs, so that its re-run skips those ops (train/recompute.py).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .recompute import context_fn


class SegmentCheckpoint:
    """run_decode(decode, tokens, state) -> decode's (hidden, new state), with the decoder
    checkpointed when autograd records (evaluation runs it directly). `decode` is the
    model's bound method: the model it belongs to is read from it at each call."""

    def __init__(self, recompute: str = "full"):
        self.recompute = recompute

    def __call__(self, decode, tokens: torch.Tensor, state):
        if not torch.is_grad_enabled():
            return decode(tokens, state)
        model = getattr(decode, "__self__", None)
        extra = {}
        # The selective policies find the FFN's second matmul by its width (recompute.py).
        d_inner = model.cfg.d_inner if hasattr(model, "cfg") else 0
        ctx = context_fn(self.recompute, d_inner)   # one store per checkpointed call
        if ctx is not None:
            extra["context_fn"] = ctx
        # A frozen parameter may be sharded again between the forward and its re-run: a
        # ZeRO-3-style wrapper releases each module's gathered parameters after its forward
        # (the re-run's too) and gathers them again before that module's backward reads
        # them. The re-run's saved references then look empty when checkpoint compares
        # their metadata, though every value backward reads is the gathered one (DeepSpeed
        # 0.19.8 does this to frozen parameters only; trained ones compare equal), so the
        # comparison is off where parameters are frozen. Exact: a frozen base under ZeRO-3
        # with checkpointed segments repeats the run without them (tests/test_titans.py,
        # around a pretrained model).
        if isinstance(model, nn.Module) and any(not p.requires_grad
                                                for p in model.parameters()):
            extra["determinism_check"] = "none"
        return checkpoint(decode, tokens, state, use_reentrant=False, **extra)
