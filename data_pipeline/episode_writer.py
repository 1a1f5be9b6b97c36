"""Writing episode splits (one sample per member group, format in data_pipeline/shards.py)
with the tar members laid out here rather than by webdataset.TarWriter, byte for byte what
that writer produced (shard_writer._AtomicShardWriter with mtime=0).

Why: through TarWriter each episode cost ~0.65 ms whatever its length, almost all of it
tarfile building four pax + ustar headers and numpy serialising three arrays through
io.BytesIO (BENCHMARKS.md, "Preparing JSONL, Parquet and datasets folders"). Within one
split every member of a kind has the same header but for the sample's key digits (and the
meta's size), and every row the same .npy header, so both are built once by tarfile and
numpy themselves and only the key and the header checksum are patched per episode. The
readers (data_pipeline/shards.py, streams.py, verify_split) therefore see the same bytes;
tests/test_episode_writer.py compares them with TarWriter's.

Memory stays bounded: the members of up to ~1 MiB of episodes are joined, hashed into the
shard's sha256 and written, so the shard is never read back to hash it.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import numpy as np

from .atomic import AtomicFile
from .shards import ShardInfo, SplitInfo

# What webdataset.TarWriter sets on each member (its defaults, and the mtime that
# shard_writer._AtomicShardWriter fixes for reproducible shards: being a float, it makes
# tarfile add a pax header to every member, kept for the same bytes), and the format,
# encoding and errors of the tarfile.open(mode="w|") it writes through.
_MEMBER = {"mode": 0o444, "uname": "bigdata", "gname": "bigdata", "mtime": 0.0}
_FORMAT, _ENCODING, _ERRORS = tarfile.PAX_FORMAT, tarfile.ENCODING, "surrogateescape"
_BLOCK, _RECORD = tarfile.BLOCKSIZE, tarfile.RECORDSIZE
_ZEROS = bytes(_BLOCK)
_CHKSUM = slice(148, 155)      # ustar checksum field: six octal digits and a NUL, then " "
_BATCH_BYTES = 1 << 20         # episode data joined per write


def member_header(name: str, size: int) -> bytes:
    """The header blocks tarfile writes before a TarWriter member of `size` bytes."""
    info = tarfile.TarInfo(name)
    info.size = size
    for field, value in _MEMBER.items():
        setattr(info, field, value)
    return info.tobuf(_FORMAT, _ENCODING, _ERRORS)


class _Headers:
    """Member headers by (key, suffix, size), as pieces whose bytes joined are the header.
    The first of each (key length, suffix, size) is built by tarfile; the others reuse it
    cut around the key (in the ustar name field) and the checksum (a plain byte sum of the
    header, so moved by the difference of the keys' byte sums). A name that is not short
    ASCII goes into a pax 'path' record instead: tarfile builds each of those."""

    def __init__(self):
        self._templates: dict[tuple[int, str, int], tuple | None] = {}

    def __call__(self, key: bytes, key_sum: int, suffix: str, size: int) -> tuple:
        found = self._templates.get((len(key), suffix, size), False)
        if found is False:
            found = self._template(key, suffix, size)
        if found is None:
            return (member_header(f"{key.decode()}.{suffix}", size),)
        head, mid, tail, chksum = found
        return head, key, mid, b"%06o\0" % (chksum + key_sum), tail

    def _template(self, key: bytes, suffix: str, size: int):
        name = key + b"." + suffix.encode()
        buf = member_header(name.decode(), size)
        ustar = len(buf) - _BLOCK
        found = None
        if name.isascii() and len(name) < 100 and buf[ustar:][:len(name) + 1] == name + b"\0":
            chk = ustar + _CHKSUM.start
            found = (buf[:ustar], buf[ustar + len(key):chk], buf[ustar + _CHKSUM.stop:],
                     int(buf[chk:chk + 6], 8) - sum(key))
        self._templates[(len(key), suffix, size)] = found
        return found


def npy_prefix(row: np.ndarray) -> bytes:
    """The .npy header numpy writes (as webdataset's npy encoder does) before rows of
    `row`'s dtype and shape; what follows it is the row's C-order bytes."""
    out = io.BytesIO()
    np.lib.format.write_array(out, row)
    data = out.getvalue()
    if row.dtype.hasobject or data[len(data) - row.nbytes:] != row.tobytes():
        raise ValueError(f"rows of dtype {row.dtype} are not stored as their raw bytes")
    return data[:len(data) - row.nbytes]


class EpisodeShards:
    """Numbered shards `<split>-NNNNNN.tar` of at most `per_shard` episodes, each committed
    whole under its name (AtomicFile), as shard_writer._AtomicShardWriter writes them."""

    def __init__(self, out_dir: Path, split: str, per_shard: int):
        self.out_dir, self.split, self.per_shard = out_dir, split, per_shard
        self.shards: list[ShardInfo] = []
        self._headers = _Headers()
        self._file: AtomicFile | None = None

    def _open(self, first: int) -> None:
        self._name = f"{self.split}-{len(self.shards):06d}.tar"
        self._file = AtomicFile(self.out_dir / self._name)
        self._sha = hashlib.sha256()
        self._parts: list = []
        self._pending = self._offset = self._count = 0
        self._first = first

    def _flush(self) -> None:
        data = b"".join(self._parts)
        self._sha.update(data)
        self._file.file.write(data)
        self._offset += len(data)
        self._parts, self._pending = [], 0

    def write(self, index: int, members: tuple[tuple[str, int, tuple], ...]) -> None:
        """Episode `index`: (suffix, size, pieces) per member in the order written, the
        bytes of `pieces` joined being the member's `size` bytes of data."""
        if self._file is None:
            self._open(index)
        key = f"{self.split}-{index:09d}".encode()
        key_sum = sum(key)
        parts = self._parts
        for suffix, size, pieces in members:
            parts.extend(self._headers(key, key_sum, suffix, size))
            parts.extend(pieces)
            parts.append(_ZEROS[:-size % _BLOCK])
            self._pending += size
        self._count += 1
        if self._pending >= _BATCH_BYTES:
            self._flush()
        if self._count == self.per_shard:
            self.close_shard()

    def close_shard(self) -> None:
        if self._file is None:
            return
        # tarfile's end of archive: two zero blocks, then zeros to a whole record.
        self._flush()
        end = 2 * _BLOCK
        self._parts = [bytes(end + -(self._offset + end) % _RECORD)]
        self._flush()
        final = self._file.commit()
        self.shards.append(ShardInfo(path=final.name, n_tokens=self._count,
                                     first_chunk=self._first, n_chunks=self._count,
                                     sha256=self._sha.hexdigest()))
        self._file = None

    def discard(self) -> None:
        if self._file is not None:
            self._file.discard()
            self._file = None


def write_episodes(out_dir: Path, split: str, tokens: np.ndarray, loss_mask: np.ndarray,
                   answer_mask: np.ndarray, samples_per_shard: int) -> SplitInfo:
    """Episode i of the split is (tokens[i], loss_mask[i], answer_mask[i]); its meta.json
    holds its index and the sha256 of the three rows' bytes (shards.content_sha256)."""
    writer = EpisodeShards(out_dir, split, samples_per_shard)
    split_json = json.dumps(split)
    n = tokens.shape[0]
    # webdataset writes a sample's members sorted by name: answer_mask, loss_mask, meta, tokens
    arrays = {"answer_mask.npy": answer_mask, "loss_mask.npy": loss_mask, "tokens.npy": tokens}
    npy = ({suffix: npy_prefix(np.ascontiguousarray(a[0])) for suffix, a in arrays.items()}
           if n else {})
    try:
        for i in range(n):
            answer, loss, row = (np.ascontiguousarray(a[i]) for a in arrays.values())
            sha = hashlib.sha256(row)
            sha.update(loss)
            sha.update(answer)
            # json.dumps({"split": split, "index": i, "sha256": ...}), webdataset's encoding
            meta = f'{{"split": {split_json}, "index": {i}, "sha256": "{sha.hexdigest()}"}}'
            meta = meta.encode()
            writer.write(i, (_npy_member("answer_mask.npy", npy, answer),
                             _npy_member("loss_mask.npy", npy, loss),
                             ("meta.json", len(meta), (meta,)),
                             _npy_member("tokens.npy", npy, row)))
        writer.close_shard()
    except BaseException:
        writer.discard()
        raise
    return SplitInfo(n_tokens=int(n), shards=writer.shards)


def _npy_member(suffix: str, prefixes: dict[str, bytes], row: np.ndarray) -> tuple:
    prefix = prefixes[suffix]
    return suffix, len(prefix) + row.nbytes, (prefix, row)
