"""Shards: splits written as webdataset tar files in corpus order, plus a JSON manifest.

Token splits ("tokens") are cut into fixed-size chunks; chunk i holds tokens
[i*chunk_tokens, (i+1)*chunk_tokens) of the split, stored as one tar member group:

    <key>.tokens.npy   the ids (dtype from the vocabulary size)
    <key>.meta.json    {"split", "chunk", "offset", "n", "sha256"}   (sha256 of the ids' bytes)

Episodic splits ("episodes", algorithmic tasks) store one sample per member group
(tokens.npy [T+1], loss_mask.npy, answer_mask.npy, meta.json {"index", "sha256"}).

Every chunk carries its own checksum, so corruption is caught whatever transport delivered the
shard (local file, pipe:, http); the manifest also lists each shard's sha256 and token count.
Writing is atomic: shards and the manifest go to temporary names and are renamed when complete,
the manifest last, so a crash never leaves a manifest that points at half-written shards.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import webdataset as wds

from .atomic import AtomicFile, atomic_write_text

FORMAT = "memtrain-shards/1"
MANIFEST = "manifest.json"


class ShardError(RuntimeError):
    """A shard or manifest is missing, corrupted or inconsistent; the message says which."""


def id_dtype(vocab_size: int) -> np.dtype:
    for dt in (np.uint8, np.uint16, np.uint32):
        if vocab_size <= np.iinfo(dt).max + 1:
            return np.dtype(dt)
    raise ValueError(f"vocab_size {vocab_size} does not fit in uint32")


def _sha256(*arrays: np.ndarray) -> str:
    h = hashlib.sha256()
    for arr in arrays:
        h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


# ----------------------------------------------------------------------------- manifest
@dataclass
class ShardInfo:
    path: str            # relative to the manifest's folder
    n_tokens: int        # tokens (token splits) or samples (episodes)
    first_chunk: int     # index of its first chunk / sample
    n_chunks: int
    sha256: str


@dataclass
class SplitInfo:
    n_tokens: int        # tokens in the split, or samples for episodes
    shards: list[ShardInfo] = field(default_factory=list)
    raw_bytes: int = 0


@dataclass
class Manifest:
    kind: str                       # "tokens" | "episodes"
    source: str                     # corpus or task name
    vocab: dict                     # Vocab.to_dict() (tokens) or task vocabulary description
    vocab_fingerprint: str
    vocab_size: int
    dtype: str
    chunk_tokens: int               # tokens per chunk; for episodes the sample length T+1
    splits: dict[str, SplitInfo]
    extra: dict = field(default_factory=dict)   # e.g. the task spec
    location: str = ""              # folder or URL prefix the manifest was read from

    def to_json(self) -> str:
        d = {"format": FORMAT, "kind": self.kind, "source": self.source, "vocab": self.vocab,
             "vocab_fingerprint": self.vocab_fingerprint, "vocab_size": self.vocab_size,
             "dtype": self.dtype, "chunk_tokens": self.chunk_tokens, "extra": self.extra,
             "splits": {name: {"n_tokens": s.n_tokens, "raw_bytes": s.raw_bytes,
                               "shards": [vars(sh) for sh in s.shards]}
                        for name, s in self.splits.items()}}
        return json.dumps(d, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, location: str) -> Manifest:
        d = json.loads(text)
        if d.get("format") != FORMAT:
            raise ShardError(f"{location}/{MANIFEST}: format {d.get('format')!r} is not "
                             f"{FORMAT!r}; re-run `memtrain prepare`")
        splits = {name: SplitInfo(n_tokens=s["n_tokens"], raw_bytes=s.get("raw_bytes", 0),
                                  shards=[ShardInfo(**sh) for sh in s["shards"]])
                  for name, s in d["splits"].items()}
        return cls(kind=d["kind"], source=d["source"], vocab=d["vocab"],
                   vocab_fingerprint=d["vocab_fingerprint"], vocab_size=d["vocab_size"],
                   dtype=d["dtype"], chunk_tokens=d["chunk_tokens"], splits=splits,
                   extra=d.get("extra", {}), location=location)

    def split(self, name: str) -> SplitInfo:
        if name not in self.splits:
            raise ShardError(f"{self.location}: no split {name!r}; the manifest has "
                             f"{', '.join(self.splits)}")
        return self.splits[name]

    def shard_url(self, shard: ShardInfo, template: str | None = None) -> str:
        """Where to read a shard: next to the manifest, or through `template` with {shard}
        (e.g. "pipe:aws s3 cp s3://bucket/enwik8/{shard} -")."""
        if template:
            return template.format(shard=shard.path)
        return f"{self.location.rstrip('/')}/{shard.path}"

    def check_vocab(self, expected_fingerprint: str | None) -> None:
        if expected_fingerprint and expected_fingerprint != self.vocab_fingerprint:
            raise ShardError(
                f"{self.location}/{MANIFEST} was written with vocabulary "
                f"{self.vocab_fingerprint[:12]} ({self.source}, {self.vocab_size} ids) but the "
                f"run expects {expected_fingerprint[:12]}: the data were prepared with another "
                f"tokenizer; prepare them again or point the run at the matching data")


def load_manifest(location: str | Path) -> Manifest:
    """Read `<location>/manifest.json` (a folder, or any URL webdataset's gopen opens)."""
    location = str(location)
    if location.endswith(MANIFEST):
        location = location[: -len(MANIFEST)].rstrip("/")
    url = f"{location.rstrip('/')}/{MANIFEST}"
    is_local = "://" not in url and not url.startswith("pipe:")
    if is_local and not Path(url).exists():
        raise ShardError(f"no manifest at {url}; run `memtrain prepare` first")
    try:
        with wds.gopen(url, "rb") as f:
            text = f.read().decode()
    except Exception as err:
        raise ShardError(f"cannot read manifest {url}: {err}") from err
    return Manifest.from_json(text, location)


# ----------------------------------------------------------------------------- writing
class _AtomicShardWriter:
    """Writes numbered tar shards of at most `chunks_per_shard` member groups."""

    def __init__(self, out_dir: Path, split: str, chunks_per_shard: int):
        self.out_dir, self.split, self.per_shard = out_dir, split, chunks_per_shard
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
        self.shards.append(ShardInfo(path=self._name, n_tokens=self._tokens,
                                     first_chunk=self._first, n_chunks=self._count,
                                     sha256=_file_sha256(final)))
        self._tar = None


def write_token_split(out_dir: Path, split: str, pieces: Iterable[np.ndarray], dtype: np.dtype,
                      chunk_tokens: int, chunks_per_shard: int, progress=None) -> SplitInfo:
    """Re-cut the id pieces of one split into fixed chunks and write them as shards."""
    writer = _AtomicShardWriter(out_dir, split, chunks_per_shard)
    buf = np.empty(chunk_tokens, dtype=dtype)
    fill = chunk = total = 0

    def flush(n: int) -> None:
        nonlocal chunk
        arr = buf[:n].copy()
        meta = {"split": split, "chunk": chunk, "offset": chunk * chunk_tokens, "n": n,
                "sha256": _sha256(arr)}
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
    writer = _AtomicShardWriter(out_dir, split, samples_per_shard)
    for i in range(tokens.shape[0]):
        row, loss, answer = (np.ascontiguousarray(a[i]) for a in (tokens, loss_mask,
                                                                   answer_mask))
        meta = {"split": split, "index": i, "sha256": _sha256(row, loss, answer)}
        writer.write(i, {"__key__": f"{split}-{i:09d}", "tokens.npy": row,
                         "loss_mask.npy": loss, "answer_mask.npy": answer,
                         "meta.json": meta}, 1)
    writer.close_shard()
    return SplitInfo(n_tokens=int(tokens.shape[0]), shards=writer.shards)


def write_manifest(out_dir: Path, manifest: Manifest) -> Path:
    # Written after every shard was renamed into place: the manifest appears last, and whole.
    return atomic_write_text(out_dir / MANIFEST, manifest.to_json())


# ----------------------------------------------------------------------------- reading
def _decode_npy(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


def _identity(urls):
    return urls


def iter_shard_members(url: str) -> Iterator[dict]:
    """The member groups of one shard, in order, as raw bytes. Our own code picks the shards,
    so webdataset's node/worker splitting and shuffling are switched off."""
    local = "://" not in url and not url.startswith("pipe:")
    if local and not Path(url).exists():
        raise ShardError(f"missing shard {url}: the manifest lists it but the file is not there "
                         "(copy it back or run `memtrain prepare` again)")
    ds = wds.WebDataset([url], shardshuffle=False, nodesplitter=_identity,
                        workersplitter=_identity, empty_check=False)
    try:
        for sample in ds:
            missing = [m for m in ("meta.json", "tokens.npy") if m not in sample]
            if missing:
                raise ShardError(f"{url}: member group {sample.get('__key__')!r} lacks "
                                 f"{', '.join(missing)} (truncated or corrupted shard; run "
                                 "`memtrain prepare` again)")
            yield sample
    except ShardError:
        raise
    except Exception as err:  # tarfile.ReadError, truncated stream, pipe failure ...
        raise ShardError(f"cannot read shard {url}: {type(err).__name__}: {err} "
                         "(truncated or corrupted; run `memtrain prepare` again)") from err


def iter_chunks(manifest: Manifest, split: str, first_chunk: int = 0,
                url_template: str | None = None) -> Iterator[tuple[int, np.ndarray]]:
    """(chunk index, ids) of a token split from `first_chunk` on, checked against the
    manifest and each chunk's checksum."""
    info = manifest.split(split)
    for shard in info.shards:
        if shard.first_chunk + shard.n_chunks <= first_chunk:
            continue
        url = manifest.shard_url(shard, url_template)
        expect = shard.first_chunk
        for sample in iter_shard_members(url):
            if expect < first_chunk:  # skip to the wanted chunk (no decode, no hash)
                expect += 1
                continue
            meta = json.loads(sample["meta.json"])
            if meta.get("chunk") != expect or meta.get("split") != split:
                raise ShardError(f"{url}: holds chunk {meta.get('chunk')} of split "
                                 f"{meta.get('split')!r} where the manifest expects chunk "
                                 f"{expect} of {split!r}: manifest and shards disagree")
            ids = _decode_npy(sample["tokens.npy"])
            if ids.size != meta["n"] or _sha256(ids) != meta["sha256"]:
                raise ShardError(f"{url}: chunk {expect} fails its checksum (corrupted "
                                 "shard); run `memtrain prepare` again")
            yield expect, ids
            expect += 1
        if expect != shard.first_chunk + shard.n_chunks:
            raise ShardError(f"{url}: ended after chunk {expect - 1} but the manifest lists "
                             f"{shard.n_chunks} chunks from {shard.first_chunk} (truncated "
                             "shard)")


def read_episodes(manifest: Manifest, split: str, url_template: str | None = None):
    """(tokens [N, T+1], loss_mask [N, T], answer_mask [N, T]) of an episodic split."""
    info = manifest.split(split)
    tokens, loss, answer = [], [], []
    for shard in info.shards:
        url = manifest.shard_url(shard, url_template)
        n = 0
        for sample in iter_shard_members(url):
            meta = json.loads(sample["meta.json"])
            index = shard.first_chunk + n
            try:
                arrays = [_decode_npy(sample[k]) for k in ("tokens.npy", "loss_mask.npy",
                                                           "answer_mask.npy")]
            except (KeyError, ValueError) as err:
                raise ShardError(f"{url}: sample {index} is unreadable ({err})") from err
            if meta.get("index") != index or _sha256(*arrays) != meta.get("sha256"):
                raise ShardError(f"{url}: sample {index} is corrupted or out of place")
            tokens.append(arrays[0])
            loss.append(arrays[1])
            answer.append(arrays[2])
            n += 1
        if n != shard.n_chunks:
            raise ShardError(f"{url}: {n} samples, the manifest lists {shard.n_chunks} "
                             "(truncated shard)")
    if len(tokens) != info.n_tokens:
        raise ShardError(f"{manifest.location}: split {split!r} has {len(tokens)} samples, "
                         f"the manifest says {info.n_tokens}")
    return np.stack(tokens), np.stack(loss), np.stack(answer)


def verify_split(manifest: Manifest, split: str) -> None:
    """Full check of local shards against the manifest's sha256 (`memtrain prepare --verify`)."""
    for shard in manifest.split(split).shards:
        path = Path(manifest.shard_url(shard))
        if not path.exists():
            raise ShardError(f"missing shard {path}")
        actual = _file_sha256(path)
        if actual != shard.sha256:
            raise ShardError(f"{path}: sha256 {actual[:12]} != manifest {shard.sha256[:12]}")

