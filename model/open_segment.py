"""The open segment of a generation: the tokens read since the memory was last committed.

Generation (model/generate.py) keeps the memory exactly as training does: it advances only
at segment boundaries. Between two boundaries the text grows one token at a time on a
fixed, committed memory, and each new token's distribution is that of the last position of
the open segment read on that memory. The protocol, what generation calls without asking
which model it runs:

    seg = model.open_segment(state)    # nothing read yet; `state` is the committed memory
    seg.read(tokens)                   # tokens [B, n] join the segment, nothing predicted
    log_probs = seg.predict(tokens)    # the same, then the next token's log-probs [B, V]
    state = seg.commit()               # the memory after the segment, once it is full

`commit` returns the state of the ordinary forward `model(tokens, state)` on the segment's
tokens, so generated text is read exactly as the same text would be scored; `read` is how
a prompt's whole segments are committed without computing any distribution.

`RerunSegment` is the default (every `SegmentLM`, and `open_segment` below for any module
with the (tokens, state) -> LMOutput call): each prediction re-runs the whole open segment
on the committed memory and keeps the last position's distribution. A pretrained backbone
overrides it with a KV cache of the open segment's rows (model/pretrained/incremental.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .memory import MemoryState

# (tokens [B, n], committed state) -> (log-probs [B, V] of the token after the last one,
# the state after the n tokens)
ReadLast = Callable[[torch.Tensor, MemoryState], tuple[torch.Tensor, MemoryState]]


class RerunSegment:
    """The open segment re-read whole at every prediction (cost per token: the segment so
    far). The state of the last prediction's read is what `commit` returns, so a full
    segment is not run a second time to commit it; tokens read without a prediction are
    committed by `model`'s forward, which computes no distribution when none is asked for."""

    def __init__(self, model, read_last: ReadLast, state: MemoryState):
        self.model, self.read_last, self.state = model, read_last, state
        self.tokens: torch.Tensor | None = None
        self._after: MemoryState | None = None

    def read(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens if self.tokens is None else torch.cat([self.tokens, tokens], 1)
        self._after = None

    def predict(self, tokens: torch.Tensor) -> torch.Tensor:
        self.read(tokens)
        log_probs, self._after = self.read_last(self.tokens, self.state)
        return log_probs

    def commit(self) -> MemoryState:
        if self.tokens is None:
            raise RuntimeError("commit of an open segment that has read no tokens")
        if self._after is None:
            self._after = self.model(self.tokens, self.state).state
        return self._after


def read_last_by_forward(model) -> ReadLast:
    """`ReadLast` through the model's forward with `return_log_probs` (all positions'
    log-probs are computed, the last kept): for a module that states no `open_segment`."""
    def read_last(tokens, state):
        out = model(tokens, state, return_log_probs=True)
        return out.log_probs[:, -1], out.state
    return read_last


def open_segment(model, state: MemoryState):
    """`model.open_segment(state)`; a module with only the (tokens, state) -> LMOutput call
    (a wrapper, a test double) gets a `RerunSegment` over that call."""
    opener = getattr(model, "open_segment", None)
    if opener is not None:
        return opener(state)
    return RerunSegment(model, read_last_by_forward(model), state)
