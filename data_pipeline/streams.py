"""Ordered per-rank segment streams with exact resume.

Streaming regime (language modelling; README "Data: shards and ordered streams"): a split of
N tokens is cut into B contiguous streams of S = N // B tokens (B = global batch rows). At
step t, row b reads tokens [b*S + t*L, b*S + t*L + L + 1) (inputs and shifted targets); rank
r owns rows [r*b_local, (r+1)*b_local). Nothing is shuffled inside a stream, ever. The read
position is a function of (step, layout) alone, so the state is three integers, resume is
exact, and any world size dividing B reads the same rows: the union over ranks equals the
1-rank reader.

Episodic regime (algorithmic tasks): each row takes whole samples, segment by segment, with
reset flags at sample starts; sample order is a seeded permutation per epoch.
"""

from __future__ import annotations

import atexit
import queue
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from .shards import Manifest, ShardError, iter_chunks, read_episodes


class LayoutError(ValueError):
    """The batch layout does not fit the data or the world size; the message has the numbers."""


@dataclass
class SegmentBatch:
    tokens: torch.Tensor            # [b, L+1] int64: inputs tokens[:, :-1], targets [:, 1:]
    reset: torch.Tensor             # [b] bool: forget the memory before this segment
    loss_mask: torch.Tensor | None  # [b, L] bool, or None = every position
    epoch: int
    step: int                       # step within the epoch


def rows_of_rank(global_batch: int, rank: int, world_size: int) -> range:
    if world_size <= 0 or not 0 <= rank < world_size:
        raise LayoutError(f"rank {rank} is not in a world of size {world_size}")
    if global_batch % world_size:
        nearest = global_batch - global_batch % world_size or world_size
        raise LayoutError(f"global batch {global_batch} is not divisible by world size "
                          f"{world_size}; choose a multiple of {world_size} (e.g. {nearest})")
    b = global_batch // world_size
    return range(rank * b, (rank + 1) * b)


class _RowReader:
    """Tokens of one stream row, from a start offset on, chunk by chunk."""

    def __init__(self, manifest: Manifest, split: str, start: int, url_template: str | None):
        c = manifest.chunk_tokens
        self._chunks = iter_chunks(manifest, split, start // c, url_template)
        self._buf = np.empty(0, dtype=np.dtype(manifest.dtype))
        self._skip = start % c

    def take(self, n: int, advance: int) -> np.ndarray:
        """The next n tokens; then move forward by `advance` (n - 1: the target overlap)."""
        while self._buf.size < n + self._skip:
            try:
                _, ids = next(self._chunks)
            except StopIteration:
                raise ShardError("stream ran past the end of its split") from None
            self._buf = np.concatenate([self._buf, ids])
        if self._skip:
            self._buf, self._skip = self._buf[self._skip:], 0
        out = self._buf[:n]
        self._buf = self._buf[advance:]
        return out


# Prefetch threads of TokenStream iterators that are still running. A daemon thread that is
# inside torch when the interpreter finalizes is killed while re-taking the GIL, and the
# forced unwind through torch's C++ frames aborts the process ("terminate called without an
# active exception", exit 134). So every thread is stopped and joined when its iterator is
# closed or collected, and, for iterators still alive then, at exit: atexit handlers run
# before the interpreter starts finalizing.
_PREFETCHERS: set[tuple[threading.Event, threading.Thread]] = set()
PREFETCH_JOIN_TIMEOUT_S = 10.0  # one batch's read; a hung shard pipe must not hang exit


def _stop_prefetch(stop: threading.Event, thread: threading.Thread) -> None:
    stop.set()
    if thread is not threading.current_thread():
        thread.join(PREFETCH_JOIN_TIMEOUT_S)
    _PREFETCHERS.discard((stop, thread))


@atexit.register
def _stop_all_prefetch() -> None:
    for stop, thread in list(_PREFETCHERS):
        _stop_prefetch(stop, thread)


class TokenStream:
    """One rank's rows of the streaming layout; iterate for SegmentBatch, epoch after epoch."""

    def __init__(self, manifest: Manifest, split: str, global_batch: int, seg_len: int,
                 rank: int = 0, world_size: int = 1, *, prefetch: int = 8,
                 expected_vocab: str | None = None, url_template: str | None = None):
        if manifest.episodic:
            raise LayoutError(f"{manifest.location} holds {manifest.kind}, not a token corpus")
        manifest.check_vocab(expected_vocab)
        self.manifest, self.split, self.url_template = manifest, split, url_template
        self.global_batch, self.seg_len, self.prefetch = global_batch, seg_len, prefetch
        self.rows = rows_of_rank(global_batch, rank, world_size)
        n_tokens = manifest.split(split).n_tokens
        if seg_len <= 0:
            raise LayoutError(f"segment length must be > 0, got {seg_len}")
        self.stream_len = n_tokens // global_batch
        self.steps_per_epoch = (self.stream_len - 1) // seg_len
        if self.steps_per_epoch < 1:
            raise LayoutError(
                f"split {split!r} has {n_tokens} tokens: too short for {global_batch} streams "
                f"of at least {seg_len + 1} tokens (needs {global_batch * (seg_len + 1)}); "
                f"lower the global batch or the segment length")
        self.epoch, self.step = 0, 0      # position of the NEXT batch handed out
        self._reset_all = True            # a new stream start: no memory carries in

    # ------------------------------------------------------------------ state
    def layout(self) -> dict:
        return {"split": self.split, "global_batch": self.global_batch,
                "seg_len": self.seg_len, "stream_len": self.stream_len,
                "vocab": self.manifest.vocab_fingerprint}

    def state_dict(self) -> dict:
        return {"kind": "token_stream", "epoch": self.epoch, "step": self.step,
                "layout": self.layout()}

    def load_state_dict(self, state: dict) -> None:
        """Exact resume with the same layout (any world size). With another layout (global
        batch, segment length) the streams are re-laid at the same fraction of the epoch and
        every row's memory is reset, with a warning."""
        if state.get("kind") != "token_stream":
            raise ValueError(f"not a token stream state: kind {state.get('kind')!r}")
        old = state["layout"]
        if old.get("vocab") != self.manifest.vocab_fingerprint or old["split"] != self.split:
            raise LayoutError("the saved stream read other data (split or vocabulary differ)")
        self.epoch = int(state["epoch"])
        if old == self.layout():
            self.step, self._reset_all = int(state["step"]), False
            return
        consumed = int(state["step"]) * old["seg_len"] / old["stream_len"]
        self.step = min(int(consumed * self.stream_len) // self.seg_len,
                        self.steps_per_epoch - 1)
        self._reset_all = True
        warnings.warn(f"stream layout changed ({old['global_batch']}x{old['seg_len']} -> "
                      f"{self.global_batch}x{self.seg_len}): streams re-laid at step "
                      f"{self.step} of epoch {self.epoch}, memory reset on every row",
                      stacklevel=2)

    # ------------------------------------------------------------------ reading
    def _produce(self, epoch: int, step: int) -> Iterator[SegmentBatch]:
        """Batches from (epoch, step) on, forever."""
        L = self.seg_len
        reset_first = self._reset_all or step == 0
        while True:
            readers = [_RowReader(self.manifest, self.split, g * self.stream_len + step * L,
                                  self.url_template) for g in self.rows]
            for t in range(step, self.steps_per_epoch):
                tokens = np.stack([r.take(L + 1, L) for r in readers]).astype(np.int64)
                reset = torch.full((len(self.rows),), reset_first or t == 0)
                reset_first = False
                yield SegmentBatch(torch.from_numpy(tokens), reset, None, epoch, t)
            epoch, step = epoch + 1, 0

    def __iter__(self) -> Iterator[SegmentBatch]:
        """Batches in order from the current position; a background thread keeps up to
        `prefetch` batches ready. The position advances as batches are handed out, so
        state_dict() is exact whenever it is called between batches. An iterator left
        unfinished stops its thread when it is closed, collected, or at interpreter exit."""
        q: queue.Queue = queue.Queue(maxsize=max(1, self.prefetch))
        stop = threading.Event()
        gen = self._produce(self.epoch, self.step)

        def put(item) -> bool:
            # A timeout, not a blocking put: a consumer gone away must not strand the thread.
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def work():
            try:
                for batch in gen:
                    if not put(batch):
                        return
            except BaseException as err:  # hand the error to the consumer: never a hang
                put(err)
            finally:
                gen.close()  # the shard readers close in this thread, not at exit

        thread = threading.Thread(target=work, daemon=True, name="memtrain-prefetch")
        _PREFETCHERS.add((stop, thread))
        thread.start()
        try:
            while True:
                item = q.get()
                if isinstance(item, BaseException):
                    raise item
                self.epoch, self.step = item.epoch, item.step + 1
                if self.step == self.steps_per_epoch:
                    self.epoch, self.step = self.epoch + 1, 0
                self._reset_all = False
                yield item
        finally:
            _stop_prefetch(stop, thread)


class EpisodeStream:
    """Episodic rows: episode e gives global row g the sample perm_epoch[e*B + g], cut into
    the task's segments; reset is True at each sample's first segment. Task splits are small
    (100k samples of <= 181 ids), so they are read into memory once.

    Data sets holding several sample lengths (`memtrain tasks babilong --together`: rows
    right-aligned in the longest length, manifest extra.babilong.length_rows) keep their
    segment length: `set_segments(n)` then trains on the rows that are n segments long, read
    as their last n segments, which is a curriculum over sample lengths."""

    def __init__(self, manifest: Manifest, split: str, global_batch: int, rank: int = 0,
                 world_size: int = 1, *, seed: int = 0, shuffle: bool = True,
                 url_template: str | None = None, n_segments: int | None = None):
        if not manifest.episodic:
            raise LayoutError(f"{manifest.location} holds {manifest.kind}, not task episodes")
        self.rows = rows_of_rank(global_batch, rank, world_size)
        self.global_batch, self.seed, self.shuffle = global_batch, seed, shuffle
        self.split = split
        self.tokens, self.loss_mask, _ = read_episodes(manifest, split, url_template)
        self.seq_len = self.tokens.shape[1] - 1
        self.task_segments = int(manifest.extra["n_segments"])  # as the task was prepared
        self.buckets = length_buckets(manifest, split)
        self.set_segments(self.task_segments if n_segments is None else n_segments)
        self.epoch, self.episode = 0, 0

    def set_segments(self, n_segments: int) -> None:
        """Cut every sample into `n_segments` equal segments from the next episode on (a
        segment-count curriculum trains on 1, 2, ... segments of the same samples); on a data
        set of several lengths, train on its samples of `n_segments` segments."""
        if self.buckets is not None:
            if n_segments not in self.buckets:
                raise LayoutError(f"split {self.split!r} has samples of "
                                  f"{sorted(self.buckets)} segments, not {n_segments}")
            self.seg_len = self.seq_len // self.task_segments
            self.pool = self.buckets[n_segments]
        else:
            if n_segments < 1 or self.seq_len % n_segments:
                works = ", ".join(str(d) for d in range(1, self.seq_len + 1)
                                  if self.seq_len % d == 0)
                raise LayoutError(f"cannot cut samples of {self.seq_len} positions into "
                                  f"{n_segments} equal segments; segment counts that work: "
                                  f"{works}")
            self.seg_len = self.seq_len // n_segments
            self.pool = np.arange(self.tokens.shape[0])
        self.n_segments = n_segments
        self.episodes_per_epoch = len(self.pool) // self.global_batch
        if self.episodes_per_epoch < 1:
            raise LayoutError(f"split {self.split!r} has {len(self.pool)} samples"
                              f"{f' of {n_segments} segments' if self.buckets else ''}, "
                              f"fewer than the global batch {self.global_batch}")

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return self.pool
        return self.pool[np.random.default_rng([self.seed, epoch]).permutation(len(self.pool))]

    def state_dict(self) -> dict:
        return {"kind": "episode_stream", "epoch": self.epoch, "episode": self.episode,
                "seed": self.seed, "global_batch": self.global_batch,
                "n_segments": self.n_segments}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "episode_stream":
            raise ValueError(f"not an episode stream state: kind {state.get('kind')!r}")
        # The segment count a curriculum had reached (states saved before it: the task's).
        self.set_segments(int(state.get("n_segments", self.task_segments)))
        if state["seed"] != self.seed or state["global_batch"] != self.global_batch:
            warnings.warn("episode stream seed or global batch changed: restarting the epoch",
                          stacklevel=2)
            self.epoch, self.episode = int(state["epoch"]), 0
            return
        self.epoch, self.episode = int(state["epoch"]), int(state["episode"])

    def __iter__(self) -> Iterator[list[SegmentBatch]]:
        """One item per episode: the list of its n_segments SegmentBatches (the trainer runs
        BPTT through the whole sample, or its last k segments, in one optimizer step)."""
        while True:
            order = self._order(self.epoch)
            for e in range(self.episode, self.episodes_per_epoch):
                L = self.seg_len  # read per episode: set_segments may change it
                idx = order[e * self.global_batch + np.asarray(self.rows)]
                first = self.seq_len - self.n_segments * L  # > 0 only for shorter lengths
                toks = torch.from_numpy(self.tokens[idx, first:].astype(np.int64))
                mask = torch.from_numpy(self.loss_mask[idx, first:])
                segs = [SegmentBatch(toks[:, s * L:s * L + L + 1].clone(),
                                     torch.full((len(idx),), s == 0),
                                     mask[:, s * L:(s + 1) * L].clone(), self.epoch, e)
                        for s in range(self.n_segments)]
                self.episode = e + 1
                yield segs
            self.epoch, self.episode = self.epoch + 1, 0


def length_buckets(manifest: Manifest, split: str) -> dict[int, np.ndarray] | None:
    """Row indices by segments per sample, for a data set holding several sample lengths
    (data_pipeline/babilong/build.py, length_rows); None for data of one length."""
    info = manifest.extra.get("babilong") or {}
    ranges = (info.get("length_rows") or {}).get(split)
    if not ranges or len({n for n, _, _ in ranges}) < 2:
        return None
    seg_len = int(info["seg_len"])
    buckets: dict[int, list[np.ndarray]] = {}
    for n, lo, hi in ranges:
        buckets.setdefault(int(n) // seg_len, []).append(np.arange(lo, hi))
    return {k: np.concatenate(v) for k, v in buckets.items()}
