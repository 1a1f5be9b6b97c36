"""The data regime of a run, decided once from its manifest: a token stream or task samples.

    token stream   a corpus cut into B contiguous rows, read segment after segment with the
                   memory carried from window to window (`TokenStream`; README "Data: shards
                   and ordered streams"); BPTT windows or a sliding window (train/bptt.py).
    task samples   one whole task sample per row and micro-step (the RMT paper's algorithmic
                   tasks, BABILong; `EpisodeStream`): fresh memory at every sample, BPTT
                   through its last k+1 segments, a segment-count curriculum (Bulatov et al.
                   2023), accuracy on the answer tokens.

`regime_of(manifest)` is the one place that asks which (`Manifest.episodic`); what differs
between the two is a method of the regime: the rank's training stream, the BPTT window plan
(train/bptt.py), the curriculum (train/curriculum.py), the evaluation loop
(train/evaluate.py), the window the planner sizes (planner/plan.py), the segments the memory
analysis reads, and what tools that need a token stream refuse (RECL, the memory-length
sweep). The pure data side (reading shards, cutting samples) stays in data_pipeline/.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import NamedTuple

from data_pipeline.shards import Manifest
from data_pipeline.streams import EpisodeStream, SegmentBatch, TokenStream
from model import ConfigError

from .bptt import SampleWindows, StreamWindows, WindowPlan, run_window
from .config import BPTTConfig, CurriculumConfig, RunConfig
from .curriculum import NoCurriculum, SegmentCurriculum


class AnalysisSegments(NamedTuple):
    """What `memtrain analyze` reads: (segment, its index in its row or sample), in order;
    segments per row or sample (the warm-up is counted in them); rows or samples there are
    to count from (a stream's rows run side by side in one batch: 1)."""

    segments: Iterator[tuple[SegmentBatch, int]]
    per_row: int
    units: int


class DataRegime:
    """What a run's data regime decides; `regime_of` builds the one a manifest holds."""

    name: str                 # how messages name the regime
    carries_memory: bool      # whether the memory goes on from one window to the next
    plan_note: str            # what `memtrain plan` adds after bptt.mode in its header

    def __init__(self, manifest: Manifest | None = None):
        self.manifest = manifest   # None: the planner without data (planned as a stream)


class TokenStreamRegime(DataRegime):
    name = "a token stream"
    carries_memory = True
    plan_note = ""

    # ------------------------------------------------------------------ training
    def check_segments(self, tgt_len: int, data_path: str) -> None:
        """A stream is cut into segments of any model.tgt_len."""

    def warn_frozen_base(self, prog: str) -> None:
        # Frozen, the write path is the base itself: only the initial memory trains, and a
        # token stream reads it only where a row's document starts.
        print(f"{prog}: warning: model.hf.finetune frozen on a token stream trains only the "
              "initial memory, which the stream uses only where a document starts; lora "
              "trains how the memory is written too", file=sys.stderr, flush=True)

    def train_stream(self, cfg: RunConfig, rank: int, world: int) -> TokenStream:
        d = cfg.data
        return TokenStream(self.manifest, d.train_split, d.global_batch, cfg.model.tgt_len,
                           rank, world, prefetch=d.prefetch, url_template=d.url_template or None)

    def window_plan(self, bptt: BPTTConfig) -> WindowPlan:
        return StreamWindows(bptt)

    def curriculum(self, cfg: CurriculumConfig, stream, data_path: str) -> NoCurriculum:
        return NoCurriculum(cfg, data_path)

    # ------------------------------------------------------------------ evaluation
    def score(self, forward, proto, rank: int, world: int, device, *, seed: int = 0,
              url_template: str | None = None, n_segments: int | None = None) -> list:
        """[nll, tokens, 0] of this rank's rows under `proto` (train/evaluate.py
        EvalProtocol): read as in training, the memory carried from segment to segment, the
        first `proto.skip_segments` of every row not counted."""
        stream = TokenStream(self.manifest, proto.split, proto.batch, proto.tgt_len, rank,
                             world, url_template=url_template or None)
        n_steps = stream.steps_per_epoch
        if proto.max_segments:
            n_steps = min(n_steps, proto.max_segments)
        if proto.skip_segments >= n_steps:
            raise ValueError(f"eval: skipping {proto.skip_segments} segments leaves nothing "
                             f"of the {n_steps} segments per row of {proto.split!r}")
        state, nll, n = None, 0.0, 0
        for t, seg in zip(range(n_steps), stream, strict=False):
            res = run_window(forward, state, [seg], device)
            state = res.state if proto.carry_memory else None
            if t >= proto.skip_segments:
                nll += float(res.nll_sum)
                n += int(res.n_tokens)
        return [nll, n, 0]

    def task_metrics(self, correct: int, n: int) -> dict:
        """What the report adds to the loss (the stream's metric is bpc or ppl)."""
        return {}

    # ------------------------------------------------------------------ tools
    def analysis_segments(self, split: str, rows: int, tgt_len: int,
                          url_template: str) -> AnalysisSegments:
        stream = TokenStream(self.manifest, split, rows, tgt_len,
                             url_template=url_template or None)
        return AnalysisSegments(((seg, t) for t, seg in enumerate(stream)),
                                stream.steps_per_epoch, 1)

    def require_token_stream(self, what: str, whose: str = "this run trains",
                             hint: str = "") -> None:
        """RECL and the memory-length sweep score a stream's rows at growing contexts; on
        other data they are refused, naming `what`, the runs (`whose`) and the regime."""

    def task_spec(self, key: str):
        """A part of the task's description in the manifest (none: no task)."""
        return None

    # ------------------------------------------------------------------ the planner
    def planned_windows(self, tgt_len: int, depth: int, stages: list[int]
                        ) -> list[tuple[int, int]]:
        """(segment length, segments) of the windows a run trains on: bptt.depth + 1
        segments of model.tgt_len."""
        return [(tgt_len, depth + 1)]

    def carried_states(self, mode: str, depth: int) -> int:
        """Memory states held between windows: the carried one, and under `sliding` the
        one saved with each of the k re-run segments (train/bptt.py `SlidingHistory`)."""
        return depth + 1 if mode == "sliding" else 1

    @property
    def fixed_window(self) -> str | None:
        """Why bptt.depth is not the planner's to search (None: it is)."""
        return None


class TaskSampleRegime(DataRegime):
    name = "task samples"
    carries_memory = False
    plan_note = ", task samples"

    def __init__(self, manifest: Manifest):
        super().__init__(manifest)
        self.positions = manifest.chunk_tokens - 1             # T, a sample's positions
        self.task_segments = int(manifest.extra["n_segments"])  # as the task was prepared

    # ------------------------------------------------------------------ training
    def check_segments(self, tgt_len: int, data_path: str) -> None:
        seg = self.positions // self.task_segments
        if seg != tgt_len:
            raise ConfigError("model.tgt_len", f"{tgt_len} differs from the task's segment "
                              f"length {seg} ({data_path})")

    def warn_frozen_base(self, prog: str) -> None:
        """Every sample starts from the initial memory and writes it through the base."""

    def train_stream(self, cfg: RunConfig, rank: int, world: int) -> EpisodeStream:
        d = cfg.data
        return EpisodeStream(self.manifest, d.train_split, d.global_batch, rank, world,
                             seed=d.seed, url_template=d.url_template or None)

    def window_plan(self, bptt: BPTTConfig) -> WindowPlan:
        return SampleWindows(bptt)

    def curriculum(self, cfg: CurriculumConfig, stream, data_path: str) -> SegmentCurriculum:
        return SegmentCurriculum(cfg, stream, self.manifest, data_path)

    # ------------------------------------------------------------------ evaluation
    def score(self, forward, proto, rank: int, world: int, device, *, seed: int = 0,
              url_template: str | None = None, n_segments: int | None = None) -> list:
        """[nll, answer tokens, answer tokens right] of this rank's samples, in file order,
        each from fresh memory; n_segments: cut them into that many segments (a curriculum
        stage) instead of the task's own count."""
        stream = EpisodeStream(self.manifest, proto.split, proto.batch, rank, world,
                               seed=seed, shuffle=False, url_template=url_template or None,
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

    def task_metrics(self, correct: int, n: int) -> dict:
        """Task samples are reported by their answer accuracy (teacher-forced)."""
        return {"accuracy": correct / max(n, 1), "metric": "accuracy"}

    # ------------------------------------------------------------------ tools
    def analysis_segments(self, split: str, rows: int, tgt_len: int,
                          url_template: str) -> AnalysisSegments:
        """Sample after sample; the warm-up counts from each sample's first segment."""
        stream = EpisodeStream(self.manifest, split, rows, shuffle=False,
                               url_template=url_template or None)
        return AnalysisSegments(((seg, s) for episode in stream for s, seg in enumerate(episode)),
                                stream.n_segments, stream.episodes_per_epoch)

    def require_token_stream(self, what: str, whose: str = "this run trains",
                             hint: str = "") -> None:
        raise ValueError(f"{what} needs a token stream; {whose} on {self.name} (episodic "
                         f"data at {self.manifest.location}){hint}")

    def task_spec(self, key: str):
        extra = self.manifest.extra
        return extra.get(key) if isinstance(extra, dict) else None

    # ------------------------------------------------------------------ the planner
    def planned_windows(self, tgt_len: int, depth: int, stages: list[int]
                        ) -> list[tuple[int, int]]:
        """A window is a whole sample, at every curriculum stage (fewer, longer segments
        first); bptt.depth only places the cuts inside it."""
        return [(self.positions // n, n) for n in (stages or [self.task_segments])]

    def carried_states(self, mode: str, depth: int) -> int:
        return 0   # every sample starts fresh

    @property
    def fixed_window(self) -> str | None:
        return f"task data: a window is the whole sample, {self.task_segments} segments"


def regime_of(manifest: Manifest) -> DataRegime:
    """The regime `manifest` holds: the one place that reads `Manifest.episodic`."""
    return TaskSampleRegime(manifest) if manifest.episodic else TokenStreamRegime(manifest)
