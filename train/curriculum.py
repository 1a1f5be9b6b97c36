"""The segment-count curriculum over task samples (`curriculum.*` in the run config).

The RMT follow-up (Bulatov et al. 2023, "Scaling Transformer to 1M tokens and beyond with
RMT") reports that training straight on many segments fails where growing their number
works. A stage here cuts the same samples into more, shorter segments
(`EpisodeStream.set_segments`), or, on a data set of several sample lengths (BABILong-style,
`memtrain tasks babilong --together`), trains on its samples of that many segments. The
stage lives in the stream's state, so it is saved and restored with it. On token streams
(no curriculum) every method is a no-op, which keeps the training loop free of regime
checks.
"""

from __future__ import annotations

from data_pipeline.streams import length_buckets
from model import ConfigError

from .config import CurriculumConfig


class NoCurriculum:
    """A token stream's: one segment length throughout, nothing to advance."""

    segments = None   # validation scores the stream as it is

    def __init__(self, cfg: CurriculumConfig, data_path: str):
        if cfg.segments:
            raise ConfigError("curriculum.segments", f"a segment curriculum needs task data "
                              f"(memtrain tasks); {data_path} holds a token stream")

    def start(self, resumed: bool) -> None:
        pass

    def metrics(self) -> dict:
        return {}

    def after_step(self, step: int) -> int | None:
        return None

    def after_validation(self, accuracy: float | None) -> int | None:
        return None


class SegmentCurriculum:
    """Task samples': the stages of `curriculum.segments` (none: the task's own count)."""

    def __init__(self, cfg: CurriculumConfig, stream, manifest, data_path: str):
        self.cfg, self.stream = cfg, stream
        self.stages = list(cfg.segments)
        if not self.stages:
            return
        n_task = int(manifest.extra["n_segments"])
        positions = manifest.chunk_tokens - 1
        if self.stages[-1] != n_task:
            raise ConfigError("curriculum.segments", f"must end at the task's {n_task} "
                              f"segments ({data_path}), got {self.stages}")
        buckets = length_buckets(manifest, stream.split)
        if buckets is not None:  # samples of several lengths: a stage is one of them
            bad = [n for n in self.stages if n not in buckets]
            if bad:
                raise ConfigError("curriculum.segments", f"{data_path} has samples of "
                                  f"{sorted(buckets)} segments, not {bad}")
            return
        bad = [n for n in self.stages if positions % n]
        if bad:
            raise ConfigError("curriculum.segments", f"{bad} do not divide the task's "
                              f"{positions} positions into equal segments")

    def start(self, resumed: bool) -> None:
        """A new run starts at the first stage; a resumed one where its stream was."""
        if not self.stages:
            return
        if not resumed:
            self.stream.set_segments(self.stages[0])
        if self.stream.n_segments not in self.stages:
            raise ConfigError("curriculum.segments", f"the checkpoint was training on "
                              f"{self.stream.n_segments} segments per sample, which is not a "
                              f"stage of {self.stages}")

    @property
    def segments(self) -> int | None:
        """Segments per sample now (what validation scores)."""
        return self.stream.n_segments

    def metrics(self) -> dict:
        return {"curriculum_segments": self.stream.n_segments}

    def after_step(self, step: int) -> int | None:
        """The new segment count if the stage advances after this step, else None."""
        c = self.cfg
        if self.stages and c.advance == "steps" and step % c.every == 0:
            return self._advance()
        return None

    def after_validation(self, accuracy: float | None) -> int | None:
        """Advance on validation accuracy (all-reduced, so every rank agrees)."""
        c = self.cfg
        if self.stages and c.advance == "accuracy" and accuracy is not None and \
                accuracy >= c.threshold:
            return self._advance()
        return None

    def _advance(self) -> int | None:
        i = self.stages.index(self.stream.n_segments)
        if i + 1 == len(self.stages):
            return None
        self.stream.set_segments(self.stages[i + 1])
        return self.stages[i + 1]
