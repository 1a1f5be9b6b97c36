"""Writing shards: splits as webdataset tar files in corpus order (format and manifest in
data_pipeline/shards.py), each shard committed whole under its name (AtomicFile), the
manifest last. Token shards record each chunk's byte offset (`chunk_offsets`) so that a
reader can seek to the chunk it needs. Episode shards are written the same way, their tar
members laid out by data_pipeline/episode_writer.py.
"""

from __future__ import annotations

import tarfile
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import webdataset as wds
from webdataset.tariterators import base_plus_ext

from .atomic import AtomicFile, atomic_write_text
from .episode_writer import write_episodes
from .shards import (
    MANIFEST,
    Manifest,
    ShardError,
    ShardInfo,
    SplitInfo,
    content_sha256,
    file_sha256,
)


def _padded(n: int) -> int:
    return -(-n // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE


def group_offsets(path: Path) -> list[int]:
    """Byte offset of each member group's first header in a tar file, then the end of its
    last member's data: the `chunk_offsets` of a shard. Reads the headers only (seeking
    over the data) and groups members by key the way webdataset does (base_plus_ext)."""
    starts: list[int] = []
    key, end = None, 0
    with tarfile.open(path, "r:") as tar:
        for info in tar:
            prefix, _ = base_plus_ext(info.name)
            if prefix != key:
                starts.append(info.offset)
                key = prefix
            end = info.offset_data + _padded(info.size)
    return starts + [end]


class _AtomicShardWriter:
    """Writes numbered tar shards of at most `chunks_per_shard` member groups; with
    `record_offsets`, notes each group's byte offset for seeking readers."""

    def __init__(self, out_dir: Path, split: str, chunks_per_shard: int,
                 record_offsets: bool = False):
        self.out_dir, self.split, self.per_shard = out_dir, split, chunks_per_shard
        self.record_offsets = record_offsets
        self.shards: list[ShardInfo] = []
        self._tar = self._file = None
        self._name = None
        self._count = self._tokens = self._first = 0

    def _open(self, first_chunk: int) -> None:
        self._name = f"{self.split}-{len(self.shards):06d}.tar"
        # Committed in close_shard(): a shard appears under its name only whole.
        self._file = AtomicFile(self.out_dir / self._name)
        self._tar = wds.TarWriter(self._file.file, mtime=0.0)  # mtime fixed: byte-reproducible
        self._count, self._tokens, self._first = 0, 0, first_chunk

    def write(self, index: int, sample: dict, n_tokens: int) -> None:
        if self._tar is None:
            self._open(index)
        self._tar.write(sample)
        self._count += 1
        self._tokens += n_tokens
        if self._count == self.per_shard:
            self.close_shard()

    def close_shard(self) -> None:
        if self._tar is None:
            return
        self._tar.close()
        final = self._file.commit()
        offsets = None
        if self.record_offsets:
            # Taken from the written file, not from the writer's bookkeeping: they are what
            # a reader will find, whatever header format the tar writer chose.
            offsets = group_offsets(final)
            if len(offsets) != self._count + 1:
                raise ShardError(f"{final}: {len(offsets) - 1} member groups written where "
                                 f"{self._count} chunks were expected")
        self.shards.append(ShardInfo(path=self._name, n_tokens=self._tokens,
                                     first_chunk=self._first, n_chunks=self._count,
                                     sha256=file_sha256(final), chunk_offsets=offsets))
        self._tar = None


def write_token_split(out_dir: Path, split: str, pieces: Iterable[np.ndarray], dtype: np.dtype,
                      chunk_tokens: int, chunks_per_shard: int, progress=None) -> SplitInfo:
    """Re-cut the id pieces of one split into fixed chunks and write them as shards."""
    writer = _AtomicShardWriter(out_dir, split, chunks_per_shard, record_offsets=True)
    buf = np.empty(chunk_tokens, dtype=dtype)
    fill = chunk = total = 0

    def flush(n: int) -> None:
        nonlocal chunk
        arr = buf[:n].copy()
        meta = {"split": split, "chunk": chunk, "offset": chunk * chunk_tokens, "n": n,
                "sha256": content_sha256(arr)}
        writer.write(chunk, {"__key__": f"{split}-{chunk:09d}", "tokens.npy": arr,
                             "meta.json": meta}, n)
        chunk += 1

    for piece in pieces:
        piece = np.asarray(piece)
        if piece.size and (piece.min() < 0 or int(piece.max()) > np.iinfo(dtype).max):
            raise ValueError(f"{split}: token ids outside {dtype} range")
        pos = 0
        while pos < piece.size:
            take = min(chunk_tokens - fill, piece.size - pos)
            buf[fill:fill + take] = piece[pos:pos + take]
            fill, pos, total = fill + take, pos + take, total + take
            if fill == chunk_tokens:
                flush(fill)
                fill = 0
            if progress is not None:
                progress(take)
    if fill:
        flush(fill)
    writer.close_shard()
    if total == 0:
        raise ShardError(f"split {split!r} is empty: nothing to write")
    return SplitInfo(n_tokens=total, shards=writer.shards)


def write_episode_split(out_dir: Path, split: str, tokens: np.ndarray, loss_mask: np.ndarray,
                        answer_mask: np.ndarray, samples_per_shard: int) -> SplitInfo:
    """One episode per member group (tokens.npy, loss_mask.npy, answer_mask.npy, meta.json),
    `samples_per_shard` to a shard. The tar members are laid out by data_pipeline/
    episode_writer.py, the same bytes TarWriter wrote through _AtomicShardWriter, without
    its per-member cost (the record formats' prepare time, BENCHMARKS.md)."""
    return write_episodes(out_dir, split, tokens, loss_mask, answer_mask, samples_per_shard)


def write_manifest(out_dir: Path, manifest: Manifest) -> Path:
    # Written after every shard was renamed into place: the manifest appears last, and whole.
    return atomic_write_text(out_dir / MANIFEST, manifest.to_json())
