"""Truncated backpropagation through time over the memory, ONE backward per micro-step.

A window of segments is run forward with the memory threaded through and its losses
summed; the caller makes one backward for the whole window. ZeRO-2/3 and DDP reduce
gradients from hooks that fire once per backward, so a backward per segment would reduce
shared weights several times (probed on 2 CPU ranks: silently wrong at ZeRO-1/2, a crash
at ZeRO-3). Only RMT's memory carries gradient between segments; XL and LaMemo states come out
of the model detached, so for them a window only batches k+1 steps into one update.

Two ways to cut the stream into windows (`bptt.mode`):

    window   segments [t, t+k] form one window; the memory entering it is detached. The first
             segment's loss reaches no earlier segment, the last one's reaches k back.
    sliding  every step re-runs the previous k segments from the memory saved when the
             oldest of them was new, then the new segment; only the new segment's loss counts
             (unless loss_on_rerun), and every loss reaches k segments back (RMT LM code).

Task samples are a third plan: one whole sample per micro-step, fresh memory, BPTT through
its last k+1 segments (all of them when k >= n_segments - 1).

A `WindowPlan` (`StreamWindows` or `SampleWindows`) is built once from the BPTT config by the
data regime (train/regime.py) and is the only place that knows them: it hands the loop the
next window, says what memory to carry after the step, and owns its resumable state (the
sliding history, with its depth checked on load).
`run_window` runs a window; `SlidingHistory` keeps the saved inputs and memories.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from data_pipeline.streams import SegmentBatch
from model import ConfigError, MemoryState

from .segment_checkpoint import SegmentCheckpoint


@dataclass
class WindowResult:
    loss: torch.Tensor          # what to backpropagate: mean NLL over counted tokens (+ aux)
    nll_sum: torch.Tensor       # detached sum of counted NLL (nats), for exact means
    n_tokens: torch.Tensor      # counted tokens
    state: MemoryState | None   # memory after the last segment, detached
    correct: torch.Tensor       # counted tokens predicted right (teacher forcing)
    state_before_last: MemoryState | None  # memory entering the last segment, detached
    # The model's auxiliary loss term in `loss` (the mean of the counted segments'
    # `aux_loss`: RMT's memory loss, a mixture-of-experts base's load balancing), detached;
    # None when it has none. Logged apart from the LM loss (train/loop.py).
    aux: torch.Tensor | None = None


def run_window(forward, state: MemoryState | None, segments: list[SegmentBatch],
               device: torch.device, *, counted: list[bool] | None = None,
               detach_before: set[int] | frozenset = frozenset(),
               checkpoint_segments: bool = False, recompute: str = "full",
               keep_last_segments: int = 0, score: bool = False) -> WindowResult:
    """Thread the memory through `segments`; sum the losses of the `counted` ones.

    forward(tokens, state, targets=, loss_mask=, run_decode=) is the engine (or the bare
    model). `detach_before` holds segment indices where the memory is cut (task
    samples longer than k+1 segments). The state entering the window is always detached:
    the previous window's graph has been freed by its backward. `score` also counts
    teacher-forced correct predictions (task accuracy; needs the full log-probabilities).

    With `checkpoint_segments`, `recompute` says what each checkpointed segment keeps
    (train/recompute.py) and the last `keep_last_segments` segments are not checkpointed.
    The last one costs no peak memory that way: its backward runs first, right after the
    forward, and a checkpointed segment would hold the same activations while it runs.
    """
    counted = counted or [True] * len(segments)
    state = state.detach() if state is not None else None
    nll_sum = n_tok = aux = correct = None
    n_aux = 0
    entering_last = None
    n_ckpt = len(segments) - keep_last_segments if checkpoint_segments else 0
    # Applied to the model from here (train/segment_checkpoint.py); a forward that is not
    # the model's (a test's stand-in) is only handed it when it checkpoints.
    ckpt = SegmentCheckpoint(recompute) if n_ckpt > 0 else None
    for i, seg in enumerate(segments):
        if i == len(segments) - 1:
            entering_last = state.detach() if state is not None else None
        if state is not None:
            if i in detach_before:
                state = state.detach()
            if _any_on_host(seg.reset):
                state = state.reset_rows(seg.reset.to(device, non_blocking=True))
        # Host-to-device copies that do not wait (a blocking copy is a sync on a GPU). The
        # targets and the loss mask go in as the host copies too: the adaptive softmax
        # routes its clusters from the targets (model/adaptive.py) and the loss picks the
        # supervised rows from the mask (model/loss.py) without a device sync.
        tokens = seg.tokens.to(device, non_blocking=True)
        out = forward(tokens[:, :-1], state, targets=seg.tokens[:, 1:],
                      loss_mask=seg.loss_mask,
                      return_log_probs=score, **({"run_decode": ckpt} if i < n_ckpt else {}))
        state = out.state
        if not counted[i]:
            continue
        seg_nll = out.nll.sum()
        nll_sum = seg_nll if nll_sum is None else nll_sum + seg_nll
        n_tok = out.n_tokens if n_tok is None else n_tok + out.n_tokens
        if out.aux_loss is not None:
            # The model's weighted auxiliary loss (RMT §3.4; a mixture-of-experts base's
            # load balancing, model/pretrained/router.py), apart from the LM loss.
            aux = out.aux_loss if aux is None else aux + out.aux_loss
            n_aux += 1
        with torch.no_grad():
            mask = (seg.loss_mask.to(device, non_blocking=True) if seg.loss_mask is not None
                    else None)
            hits = _hits(out, tokens[:, 1:], mask)
        correct = hits if correct is None else correct + hits
    if nll_sum is None:
        raise ValueError("a BPTT window must count at least one segment's loss")
    # Token-weighted mean over the window: for equal segments the mean of the segment means,
    # and for task samples every answer token weighs the same whatever its segment.
    loss = nll_sum / n_tok.clamp(min=1)
    if aux is not None:
        loss = loss + aux / n_aux
    return WindowResult(loss=loss, nll_sum=nll_sum.detach(), n_tokens=n_tok.detach(),
                        state=state.detach() if state is not None else None,
                        correct=correct, state_before_last=entering_last,
                        aux=(aux / n_aux).detach() if aux is not None else None)


def _any_on_host(flags: torch.Tensor) -> bool:
    """Any True in the stream's reset flags, decided on the host without a device sync: the
    stream makes them on the host (`.numpy()` raises for a device tensor, so this can never
    wait for a device). Flags already on a device: reset_rows is a torch.where per memory
    tensor that leaves unflagged rows unchanged, cheaper than a sync."""
    if flags.device.type == "cpu":
        return bool(flags.numpy().any())
    return True


def _hits(out, targets: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Teacher-forced correct predictions, only where asked for (log_probs are costly for a
    large vocabulary, so the engine asks only on task data, which has a loss mask)."""
    if out.log_probs is None or mask is None:
        return torch.zeros((), device=targets.device)
    pred = out.log_probs.argmax(-1)
    return ((pred == targets) & mask).sum()


def episode_cuts(n_segments: int, depth: int) -> frozenset:
    """Where to detach inside one task sample so gradients reach at most `depth` segments
    back: windows of depth+1 segments aligned to the END of the sample, where the answer is
    (the RMT code: full BPTT within an example when depth >= n_segments - 1)."""
    span = depth + 1
    return frozenset(i for i in range(1, n_segments) if (n_segments - i) % span == 0)


@dataclass
class _Saved:
    segment: SegmentBatch
    state_before: MemoryState | None   # detached memory that entered this segment


@dataclass
class SlidingHistory:
    """The last k segments and the memory that entered each, for `sliding` BPTT."""

    depth: int
    items: deque = field(default_factory=deque)

    def window(self, new: SegmentBatch, carried: MemoryState | None):
        """(start state, segments) for the step that brings `new`."""
        segs = [it.segment for it in self.items] + [new]
        start = self.items[0].state_before if self.items else carried
        return start, segs

    def push(self, new: SegmentBatch, state_before: MemoryState | None) -> None:
        if self.depth == 0:
            return
        self.items.append(_Saved(new, state_before.detach() if state_before is not None
                                 else None))
        while len(self.items) > self.depth:
            self.items.popleft()

    def clear(self) -> None:
        self.items.clear()

    def state_dict(self) -> dict:
        return {"depth": self.depth, "items": [
            {"tokens": it.segment.tokens, "reset": it.segment.reset,
             "loss_mask": it.segment.loss_mask, "epoch": it.segment.epoch,
             "step": it.segment.step,
             "state_before": None if it.state_before is None else
             it.state_before.to("cpu").state_dict()} for it in self.items]}

    def load_state_dict(self, data: dict, device: torch.device) -> None:
        if data["items"] and data["depth"] != self.depth:
            raise ConfigError("bptt.depth", f"the checkpoint's sliding-BPTT history was saved "
                              f"with depth {data['depth']}, this run has {self.depth}; resume "
                              "with the same bptt.depth")
        self.items.clear()
        for it in data["items"]:
            seg = SegmentBatch(it["tokens"], it["reset"], it["loss_mask"], it["epoch"],
                               it["step"])
            st = it["state_before"]
            st = None if st is None else MemoryState.from_state_dict(st).to(device)
            self.items.append(_Saved(seg, st))


@dataclass
class Window:
    """One micro-step's work for `run_window`."""

    start: MemoryState | None            # memory entering the first segment
    segments: list[SegmentBatch]
    counted: list[bool] | None = None    # whose losses count (None: all)
    cuts: frozenset = frozenset()        # segment indices where the memory is detached

    @property
    def new_tokens(self) -> int:
        """Tokens this rank trains on for the first time in this window (a sliding window
        re-runs all but its last segment)."""
        fresh = self.segments if self.counted is None else [
            s for s, c in zip(self.segments, self.counted, strict=True) if c]
        return sum(s.tokens.shape[0] * (s.tokens.shape[1] - 1) for s in fresh)


class WindowPlan:
    """How the data are cut into BPTT windows, decided once from `bptt.*` by the data regime
    (train/regime.py gives `StreamWindows` or `SampleWindows`):

        plan = regime.window_plan(cfg.bptt)
        window = plan.next_window(batches, memory)     # before the step
        memory = plan.after_step(window, result)       # the memory to carry on
    """

    kind: str                   # "window", "sliding" or "episodes"

    def __init__(self, bptt, history_depth: int = 0):
        self.depth, self.loss_on_rerun = bptt.depth, bptt.loss_on_rerun
        self.history = SlidingHistory(history_depth)

    def next_window(self, batches: Iterator, memory: MemoryState | None) -> Window:
        raise NotImplementedError

    def after_step(self, window: Window, result: WindowResult) -> MemoryState | None:
        """The memory the next window starts from (None: each sample starts fresh)."""
        raise NotImplementedError

    def after_nonfinite(self) -> MemoryState | None:
        """The memory to carry after a window whose loss was NaN/Inf (a step fp16 loss
        scaling skips): none of what that window produced. Every row starts afresh, as at a
        stream start: its output memory may hold the NaN/Inf, and the memory that entered
        it (possibly the cause) is k+1 segments older than the next segment, so carrying it
        would put a non-adjacent context at the wrong relative positions. The sliding
        history goes too: its saved memories came from the same chain."""
        self.history.clear()
        return None

    def state_dict(self) -> dict:
        return self.history.state_dict()

    def load_state_dict(self, data: dict, device: torch.device) -> None:
        self.history.load_state_dict(data, device)


class StreamWindows(WindowPlan):
    """A token stream's windows, `bptt.mode` window or sliding; the memory carries on."""

    def __init__(self, bptt):
        super().__init__(bptt, bptt.depth if bptt.mode == "sliding" else 0)
        self.kind = bptt.mode

    def next_window(self, batches: Iterator, memory: MemoryState | None) -> Window:
        if self.kind == "window":
            return Window(memory, [next(batches) for _ in range(self.depth + 1)])
        new = next(batches)
        start, segs = self.history.window(new, memory)
        return Window(start, segs, [self.loss_on_rerun] * (len(segs) - 1) + [True])

    def after_step(self, window: Window, result: WindowResult) -> MemoryState | None:
        if self.kind == "sliding":
            self.history.push(window.segments[-1], result.state_before_last)
        return result.state


class SampleWindows(WindowPlan):
    """Task samples: one whole sample per window, fresh memory, the cuts aligned to the
    sample's end (`episode_cuts`)."""

    kind = "episodes"

    def __init__(self, bptt):
        if bptt.mode == "sliding":
            raise ConfigError("bptt.mode", "sliding applies to token streams; task samples "
                              "run BPTT through the sample (bptt.depth limits it)")
        super().__init__(bptt)

    def next_window(self, batches: Iterator, memory: MemoryState | None) -> Window:
        segs = next(batches)
        return Window(None, segs, cuts=episode_cuts(len(segs), self.depth))

    def after_step(self, window: Window, result: WindowResult) -> MemoryState | None:
        return None


@dataclass
class TrainState:
    """What a run carries from step to step besides the engine: saved in every checkpoint."""

    step: int = 0                        # optimizer steps done
    tokens_seen: int = 0                 # counted training tokens, all ranks
    memory: MemoryState | None = None    # this rank's rows, carried between windows
    plan: WindowPlan | None = None       # the BPTT windows and their resumable state
    # Windows in a row whose loss was non-finite (fp16): too many stop the run
    # (optim.max_nonfinite_steps). Not checkpointed: a resumed run counts afresh.
    nonfinite_in_a_row: int = 0
