"""What the engine sees of any model: (tokens, memory) -> LMOutput.

    out = model(tokens, state, targets=..., loss_mask=...)
    out.loss, out.nll, out.state          # carry out.state into the next segment

`SegmentLM` holds what every model shares (run-time memory lengths, a forward that runs the
decoder the way its caller says: segment checkpointing is applied from train/); the native
stack (model/lm.py `MemoryLM`) and a pretrained backbone with memory tokens
(model/pretrained/wrapper.py) build their layers, `decode` (the segment's hidden states and
the next memory) and `score` (the head and the loss).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from .backbone import Lengths
from .config import ModelConfig
from .memory import MemoryState
from .open_segment import RerunSegment

# (decode, tokens, state) -> decode(tokens, state)'s (hidden, new state), run some way.
DecodeRunner = Callable[..., tuple[torch.Tensor, MemoryState]]


@dataclass
class LMOutput:
    state: MemoryState
    # Per-token negative log-likelihood [B, L] in nats, 0 where loss_mask is False.
    nll: torch.Tensor | None = None
    # Number of tokens counted in `nll` (sum of loss_mask), for exact per-token means.
    n_tokens: torch.Tensor | None = None
    # Mean NLL over counted tokens (the LM loss).
    loss: torch.Tensor | None = None
    # The mechanism's weighted auxiliary loss, if it has one (RMT §3.4): what to minimise
    # is loss + aux_loss (train/bptt.py adds them).
    aux_loss: torch.Tensor | None = None
    # Log-probabilities [B, L, V], only when asked for (costly with a 267k vocabulary).
    log_probs: torch.Tensor | None = None


def add_lm_loss(out: LMOutput, nll: torch.Tensor, loss_mask: torch.Tensor | None) -> None:
    """Fill `out`'s nll (nll [B, L] where loss_mask [B, L] holds, 0 elsewhere), n_tokens and
    loss (their mean) from the per-token NLL: every backbone scores the same way."""
    if loss_mask is None:
        loss_mask = torch.ones_like(nll, dtype=torch.bool)
    # The training step hands the mask over from the host (model/loss.py selects the rows
    # there); the copy does not wait.
    loss_mask = loss_mask.to(nll.device, non_blocking=True)
    out.nll = nll * loss_mask
    out.n_tokens = loss_mask.sum()
    out.loss = out.nll.sum() / out.n_tokens.clamp(min=1)


class SegmentLM(nn.Module):
    """What every model the engine trains shares: (tokens, memory) -> LMOutput and run-time
    lengths. Subclasses build their layers, `decode` and `score`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.lengths = Lengths.from_config(cfg)

    def initial_state(self, batch_size: int, device=None) -> MemoryState:
        raise NotImplementedError

    def set_lengths(self, mem_len: int | None = None, clamp_len: int | None = None,
                    same_length: bool | None = None) -> None:
        """Change the evaluation memory settings (segment length is the input's length)."""
        lengths = Lengths(self.lengths.mem_len if mem_len is None else mem_len,
                          self.lengths.clamp_len if clamp_len is None else clamp_len,
                          self.lengths.same_length if same_length is None else same_length)
        self.cfg.check_lengths(lengths.mem_len, lengths.clamp_len, lengths.same_length)
        self.lengths = lengths

    @contextmanager
    def using_lengths(self, mem_len: int | None = None, clamp_len: int | None = None,
                      same_length: bool | None = None) -> Iterator[Lengths]:
        """`set_lengths` for the body of a with-block; the previous lengths come back after
        it, also on an error (evaluation protocols, RECL, the speed comparison)."""
        saved = self.lengths
        self.set_lengths(mem_len, clamp_len, same_length)
        try:
            yield self.lengths
        finally:
            self.lengths = saved

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, tokens: torch.Tensor, state: MemoryState | None = None,
                targets: torch.Tensor | None = None, loss_mask: torch.Tensor | None = None,
                return_log_probs: bool = False, run_decode: DecodeRunner | None = None
                ) -> LMOutput:
        """tokens [B, L] -> LMOutput. targets [B, L] are the next tokens, on the device or
        on the host (the training step passes the host copy: the adaptive softmax routes its
        clusters there without a device sync); loss_mask [B, L] (bool), on the host or the
        device, limits the loss to some positions (e.g. a task's answer): only those rows
        reach the head, chosen on the host from a host mask (model/loss.py).

        run_decode: how the decoder runs, as run_decode(self.decode, tokens, state); None:
        directly. The training loop passes segment checkpointing here (train/
        segment_checkpoint.py): how the model runs is decided there, not here. Only the
        decoder goes through it: the head and the loss run outside (model/loss.py,
        chunked), so a checkpointed segment's backward never recomputes them. What that
        keeps per segment: the decoder's output rows that reach the head (all B x L x
        d_model of a language-modelling segment in the model's dtype; only the answer rows
        of a masked task), besides the segment's inputs."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, length], got shape {tuple(tokens.shape)}")
        if state is not None and state.batch_size != tokens.shape[0]:
            raise ValueError(f"memory state has {state.batch_size} rows but tokens have "
                             f"{tokens.shape[0]}")
        if run_decode is None:
            hidden, new_state = self.decode(tokens, state)
        else:
            hidden, new_state = run_decode(self.decode, tokens, state)
        return self.score(hidden, new_state, targets, loss_mask, return_log_probs)

    def decode(self, tokens: torch.Tensor, state: MemoryState | None
               ) -> tuple[torch.Tensor, MemoryState]:
        """tokens [B, L] read on `state` -> (hidden [B, L, d] the head reads, new state)."""
        raise NotImplementedError

    def score(self, hidden: torch.Tensor, state: MemoryState, targets: torch.Tensor | None,
              loss_mask: torch.Tensor | None, return_log_probs: bool) -> LMOutput:
        """The head on `decode`'s hidden states: the loss (model/loss.py: only supervised
        rows, in chunks, never the whole [B*L, V] float32 logits) and, when asked for, the
        full log-probabilities."""
        raise NotImplementedError

    def next_token_log_probs(self, tokens: torch.Tensor, state: MemoryState | None
                             ) -> tuple[torch.Tensor, MemoryState]:
        """tokens [B, L] read on `state` -> (log-probabilities [B, V] of the token after
        the last one, float32 or wider; the state after the L tokens, as `forward` returns
        it). This default keeps the last row of `forward`'s log-probs; a subclass computes
        only that row."""
        out = self(tokens, state, return_log_probs=True)
        return out.log_probs[:, -1], out.state

    def open_segment(self, state: MemoryState):
        """The open segment of a generation on the committed `state` (model/open_segment.py):
        by default re-read whole at every new token, the last position's distribution only."""
        return RerunSegment(self, self.next_token_log_probs, state)
