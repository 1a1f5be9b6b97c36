"""Shards: splits written as webdataset tar files in corpus order, plus a JSON manifest.

Token splits ("tokens") are cut into fixed-size chunks; chunk i holds tokens
[i*chunk_tokens, (i+1)*chunk_tokens) of the split, stored as one tar member group:

    <key>.tokens.npy   the ids (dtype from the vocabulary size)
    <key>.meta.json    {"split", "chunk", "offset", "n", "sha256"}   (sha256 of the ids' bytes)

Episodic splits ("episodes", algorithmic tasks) store one sample per member group
(tokens.npy [T+1], loss_mask.npy, answer_mask.npy, meta.json {"index", "sha256"}).

Every chunk carries its own checksum, so corruption is caught whatever transport delivered the
shard (local file, pipe:, http); the manifest also lists each shard's sha256 and token count.

Seeking: for token splits the manifest records, per shard, the byte offset of each chunk's
first tar header (`chunk_offsets`, n_chunks + 1 entries, the last one the end of the last
chunk). A stream row that starts at chunk i of a local shard opens the file at that offset
and reads from there, instead of reading (and discarding) chunks 0..i-1: with 64 chunks of
1M tokens per shard, up to 63M ids (63 MB as uint8, 252 MB as uint32) less per row at every
start, resume and epoch. Shards read through a URL (`data.url_template`: pipe:, http,
s3 ...) are still read from their first member (no range requests). Manifests written
before the offsets were recorded still work the old way, with a one-time warning.
Writing (data_pipeline/shard_writer.py) is atomic: shards and the manifest go to temporary
names and are renamed when complete, the manifest last, so a crash never leaves a manifest
that points at half-written shards. This module holds the manifest types and the readers.
"""

from __future__ import annotations

import hashlib
import io
import json
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

import numpy as np
import webdataset as wds
from webdataset.tariterators import group_by_keys, tar_file_iterator

FORMAT = "memtrain-shards/1"
MANIFEST = "manifest.json"


class ShardError(RuntimeError):
    """A shard or manifest is missing, corrupted or inconsistent; the message says which."""


def id_dtype(vocab_size: int) -> np.dtype:
    for dt in (np.uint8, np.uint16, np.uint32):
        if vocab_size <= np.iinfo(dt).max + 1:
            return np.dtype(dt)
    raise ValueError(f"vocab_size {vocab_size} does not fit in uint32")


def content_sha256(*arrays: np.ndarray) -> str:
    h = hashlib.sha256()
    for arr in arrays:
        h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()


def file_sha256(path: Path) -> str:
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
    # Token splits: byte offset of each chunk's first tar header (the pax/GNU long-name
    # header when there is one: tarfile's TarInfo.offset), then the end of the last chunk.
    # None in manifests written before offsets were recorded, and for episode splits
    # (read whole): the reader then starts at the shard's first member.
    chunk_offsets: list[int] | None = None


_SHARD_FIELDS = frozenset(ShardInfo.__dataclass_fields__)


@dataclass
class SplitInfo:
    n_tokens: int        # tokens in the split, or samples for episodes
    shards: list[ShardInfo] = field(default_factory=list)
    raw_bytes: int = 0


TOKENS, EPISODES = "tokens", "episodes"   # Manifest.kind


@dataclass
class Manifest:
    kind: str                       # TOKENS | EPISODES
    source: str                     # corpus or task name
    vocab: dict                     # Vocab.to_dict() (tokens) or task vocabulary description
    vocab_fingerprint: str
    vocab_size: int
    dtype: str
    chunk_tokens: int               # tokens per chunk; for episodes the sample length T+1
    splits: dict[str, SplitInfo]
    extra: dict = field(default_factory=dict)   # e.g. the task spec
    location: str = ""              # folder or URL prefix the manifest was read from

    @property
    def episodic(self) -> bool:
        """Whether the data are episodes (one sample of the RMT paper's algorithmic tasks
        per row, read with fresh memory) rather than one long token stream. Outside
        data_pipeline/ only train/regime.py reads it, to build the run's data regime."""
        return self.kind == EPISODES

    def to_json(self) -> str:
        d = {"format": FORMAT, "kind": self.kind, "source": self.source, "vocab": self.vocab,
             "vocab_fingerprint": self.vocab_fingerprint, "vocab_size": self.vocab_size,
             "dtype": self.dtype, "chunk_tokens": self.chunk_tokens, "extra": self.extra,
             "splits": {name: {"n_tokens": s.n_tokens, "raw_bytes": s.raw_bytes,
                               "shards": [{k: v for k, v in vars(sh).items()
                                           if v is not None} for sh in s.shards]}
                        for name, s in self.splits.items()}}
        return json.dumps(d, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, location: str) -> Manifest:
        d = json.loads(text)
        if d.get("format") != FORMAT:
            raise ShardError(f"{location}/{MANIFEST}: format {d.get('format')!r} is not "
                             f"{FORMAT!r}; re-run `memtrain prepare`")
        splits = {name: SplitInfo(n_tokens=s["n_tokens"], raw_bytes=s.get("raw_bytes", 0),
                                  shards=[ShardInfo(**{k: v for k, v in sh.items()
                                                       if k in _SHARD_FIELDS})
                                          for sh in s["shards"]])
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


# ----------------------------------------------------------------------------- reading
def _decode_npy(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


def _identity(urls):
    return urls


def _local_path(url: str) -> Path | None:
    """The file a shard URL names when it is on a (local or shared) file system, else None
    (pipe:, http, s3 ...: a stream that can only be read from its start)."""
    if url.startswith("file://"):
        return Path(url2pathname(urlparse(url).path))
    if "://" in url or url.startswith("pipe:"):
        return None
    return Path(url)


def _groups_from(path: Path, offset: int, url: str) -> Iterator[dict]:
    """The member groups of a local tar file from byte `offset` on (a header boundary),
    grouped exactly as webdataset's tarfile_to_samples groups them."""
    with open(path, "rb") as f:
        f.seek(offset)
        files = ({**member, "__url__": url} for member in tar_file_iterator(f))
        yield from group_by_keys(files)


def iter_shard_members(url: str, offset: int = 0) -> Iterator[dict]:
    """The member groups of one shard, in order, as raw bytes. Our own code picks the shards,
    so webdataset's node/worker splitting and shuffling are switched off. With `offset` > 0
    (a local shard only) reading starts at that byte, which must be where a member group's
    first header starts (ShardInfo.chunk_offsets)."""
    path = _local_path(url)
    if path is not None and not path.exists():
        raise ShardError(f"missing shard {url}: the manifest lists it but the file is not there "
                         "(copy it back or run `memtrain prepare` again)")
    if offset and path is None:
        raise ValueError(f"{url}: only a local shard can be read from an offset")
    if path is not None:
        # webdataset's tar iterator and grouping over a file we own: a reader that stops
        # early (a row seeking its start) closes it below; wds.WebDataset would leave its
        # stream to the garbage collector.
        samples = _groups_from(path, offset, url)
    else:
        samples = iter(wds.WebDataset([url], shardshuffle=False, nodesplitter=_identity,
                                      workersplitter=_identity, empty_check=False))
    try:
        for sample in samples:
            missing = [m for m in ("meta.json", "tokens.npy") if m not in sample]
            if missing:
                raise ShardError(f"{url}: member group {sample.get('__key__')!r} lacks "
                                 f"{', '.join(missing)} (truncated or corrupted shard; run "
                                 "`memtrain prepare` again)")
            yield sample
    except ShardError:
        raise
    except Exception as err:  # tarfile.ReadError, truncated stream, pipe failure ...
        where = f" from byte {offset} (the manifest's chunk offset)" if offset else ""
        raise ShardError(f"cannot read shard {url}{where}: {type(err).__name__}: {err} "
                         "(truncated or corrupted; run `memtrain prepare` again)") from err
    finally:
        samples.close()


_WARNED_NO_OFFSETS: set[str] = set()


def _seek_offset(manifest: Manifest, shard: ShardInfo, skip: int, url: str) -> int:
    """Byte offset at which chunk `first_chunk + skip` of `shard` starts, or 0 when the shard
    must be read from its first member: a URL shard (pipe:, http ...: no range requests), or
    a manifest written before chunk offsets were recorded (warned once per manifest)."""
    if skip == 0 or _local_path(url) is None:
        return 0
    offsets = shard.chunk_offsets
    if offsets is None:
        if manifest.location not in _WARNED_NO_OFFSETS:
            _WARNED_NO_OFFSETS.add(manifest.location)
            warnings.warn(
                f"{manifest.location}/{MANIFEST} has no chunk offsets (written by an older "
                "memtrain): every stream row reads its shard from the first member to reach "
                "its chunk, which at scale means gigabytes read at every start, resume and "
                "epoch. Re-run `memtrain prepare` to record the offsets (shards and order "
                "stay the same).", stacklevel=3)
        return 0
    if len(offsets) != shard.n_chunks + 1:
        raise ShardError(f"{url}: the manifest lists {len(offsets)} chunk offsets for "
                         f"{shard.n_chunks} chunks (corrupted manifest); run `memtrain "
                         "prepare` again")
    return int(offsets[skip])


def iter_chunks(manifest: Manifest, split: str, first_chunk: int = 0,
                url_template: str | None = None) -> Iterator[tuple[int, np.ndarray]]:
    """(chunk index, ids) of a token split from `first_chunk` on, checked against the
    manifest and each chunk's checksum. A local shard is opened at the first wanted chunk
    (the manifest's chunk offsets); otherwise earlier chunks are read and skipped."""
    info = manifest.split(split)
    for shard in info.shards:
        if shard.first_chunk + shard.n_chunks <= first_chunk:
            continue
        url = manifest.shard_url(shard, url_template)
        skip = max(0, first_chunk - shard.first_chunk)
        offset = _seek_offset(manifest, shard, skip, url)
        expect = shard.first_chunk + (skip if offset else 0)
        for sample in iter_shard_members(url, offset):
            if expect < first_chunk:  # skip to the wanted chunk (no decode, no hash)
                expect += 1
                continue
            meta = json.loads(sample["meta.json"])
            if meta.get("chunk") != expect or meta.get("split") != split:
                raise ShardError(f"{url}: holds chunk {meta.get('chunk')} of split "
                                 f"{meta.get('split')!r} where the manifest expects chunk "
                                 f"{expect} of {split!r}: manifest and shards disagree")
            ids = _decode_npy(sample["tokens.npy"])
            if ids.size != meta["n"] or content_sha256(ids) != meta["sha256"]:
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
            if meta.get("index") != index or content_sha256(*arrays) != meta.get("sha256"):
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
        actual = file_sha256(path)
        if actual != shard.sha256:
            raise ShardError(f"{path}: sha256 {actual[:12]} != manifest {shard.sha256[:12]}")

