"""Shard seeks: a stream row opens its shard at the chunk it needs (the manifest's chunk
offsets) instead of reading every earlier member; old manifests and URL shards still work."""

import builtins
import io
import json
import tarfile
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from data_pipeline import shards as shards_mod
from data_pipeline.shard_writer import group_offsets, write_manifest, write_token_split
from data_pipeline.shards import (
    Manifest,
    ShardError,
    _groups_from,
    id_dtype,
    iter_chunks,
    load_manifest,
)
from data_pipeline.streams import TokenStream, _RowReader

CHUNK = 4096          # tokens per chunk (uint16 ids: 8 KiB of payload per chunk)
PER_SHARD = 64        # chunks per shard, as `memtrain prepare` writes by default


def make_corpus(tmp_path: Path, n_chunks=2 * PER_SHARD, chunk=CHUNK, per_shard=PER_SHARD):
    data = np.arange(n_chunks * chunk) % 60000
    info = write_token_split(tmp_path, "train", [data], id_dtype(60000), chunk, per_shard)
    m = Manifest(kind="tokens", source="test", vocab={"kind": "test"}, vocab_fingerprint="f" * 64,
                 vocab_size=60000, dtype=str(id_dtype(60000)), chunk_tokens=chunk,
                 splits={"train": info})
    write_manifest(tmp_path, m)
    return load_manifest(tmp_path)


def strip_offsets(tmp_path: Path) -> Manifest:
    """The same shards under a manifest as written before chunk offsets were recorded."""
    path = tmp_path / "manifest.json"
    d = json.loads(path.read_text())
    for split in d["splits"].values():
        for shard in split["shards"]:
            shard.pop("chunk_offsets")
    path.write_text(json.dumps(d))
    return load_manifest(tmp_path)


class _Counting:
    """A file object that counts the bytes handed out by read/readinto/read1."""

    def __init__(self, f, counter):
        self._f, self._counter = f, counter

    def read(self, *a):
        data = self._f.read(*a)
        self._counter[0] += len(data)
        return data

    def read1(self, *a):
        data = self._f.read1(*a)
        self._counter[0] += len(data)
        return data

    def readinto(self, b):
        n = self._f.readinto(b)
        self._counter[0] += n or 0
        return n

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __iter__(self):
        return iter(self._f)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


@pytest.fixture
def tar_bytes_read(monkeypatch):
    """counter[0]: bytes read from any .tar file opened with open() (webdataset's gopen and
    the seeking reader both open local shards with the builtin)."""
    counter = [0]
    real_open = builtins.open

    def counting_open(file, mode="r", *a, **kw):
        f = real_open(file, mode, *a, **kw)
        if str(file).endswith(".tar") and "r" in mode:
            return _Counting(f, counter)
        return f

    monkeypatch.setattr(builtins, "open", counting_open)
    return counter


def group_size(m: Manifest) -> int:
    offs = m.split("train").shards[0].chunk_offsets
    return offs[1] - offs[0]


def read_segment(m: Manifest, start: int, n: int = 65, counter=None) -> np.ndarray:
    if counter is not None:
        counter[0] = 0  # writing the corpus hashed its shards: count the reads from here
    return _RowReader(m, "train", start, None).take(n, n - 1)


# ----------------------------------------------------------------------------- bytes read
@pytest.mark.parametrize("chunk_in_shard", [48, 63])
def test_a_row_starting_deep_in_a_shard_reads_about_one_chunk(tmp_path, tar_bytes_read,
                                                              chunk_in_shard):
    m = make_corpus(tmp_path)
    start = (PER_SHARD + chunk_in_shard) * CHUNK + CHUNK // 2  # shard 1, mid-chunk
    got = read_segment(m, start, counter=tar_bytes_read)
    assert got.tolist() == [i % 60000 for i in range(start, start + 65)]
    # The chunk holding the start, plus tar's read-ahead (one 10 KiB record) at most:
    # before the seek it was chunk_in_shard + 1 chunks.
    assert 0 < tar_bytes_read[0] <= group_size(m) + tarfile.RECORDSIZE, tar_bytes_read[0]


def test_a_row_spanning_two_chunks_reads_just_those(tmp_path, tar_bytes_read):
    m = make_corpus(tmp_path)
    start = 48 * CHUNK + CHUNK - 10   # the segment runs 55 tokens into chunk 49
    got = read_segment(m, start, counter=tar_bytes_read)
    assert got.tolist() == [i % 60000 for i in range(start, start + 65)]
    assert tar_bytes_read[0] <= 2 * group_size(m) + tarfile.RECORDSIZE, tar_bytes_read[0]


def test_an_old_manifest_without_offsets_reads_linearly_and_warns_once(tmp_path,
                                                                       tar_bytes_read,
                                                                       monkeypatch):
    group = group_size(make_corpus(tmp_path))
    m = strip_offsets(tmp_path)
    monkeypatch.setattr(shards_mod, "_WARNED_NO_OFFSETS", set())
    start = 48 * CHUNK + CHUNK // 2
    with pytest.warns(UserWarning, match=r"no chunk offsets.*Re-run `memtrain prepare`"):
        got = read_segment(m, start, counter=tar_bytes_read)
    assert got.tolist() == [i % 60000 for i in range(start, start + 65)]
    assert tar_bytes_read[0] >= 48 * group   # the linear scan, as before
    with warnings.catch_warnings():
        warnings.simplefilter("error")                # the warning came once
        read_segment(m, start, counter=tar_bytes_read)


@pytest.mark.parametrize("offset", [0, 1])
def test_a_reader_that_stops_early_closes_its_shard_file(tmp_path, offset, monkeypatch):
    """Not left to the garbage collector: every file opened for the shard is closed as soon
    as the member iterator is closed (what a row reader's generator does once it has its
    tokens)."""
    from data_pipeline.shards import iter_shard_members
    m = make_corpus(tmp_path)
    shard = m.split("train").shards[0]
    url = str(tmp_path / shard.path)
    opened, real_open = [], builtins.open

    def tracking_open(file, *args, **kwargs):
        f = real_open(file, *args, **kwargs)
        if str(file) == url:
            opened.append(f)
        return f
    monkeypatch.setattr(builtins, "open", tracking_open)
    members = iter_shard_members(url, shard.chunk_offsets[offset] if offset else 0)
    assert "tokens.npy" in next(members)
    assert opened and not any(f.closed for f in opened)
    members.close()
    assert all(f.closed for f in opened)


# ----------------------------------------------------------------------------- same data
def test_every_start_reads_the_same_tokens_with_and_without_offsets(tmp_path):
    m = make_corpus(tmp_path, n_chunks=11, chunk=16, per_shard=4)
    old = Manifest.from_json(m.to_json(), m.location)
    for shard in old.split("train").shards:
        shard.chunk_offsets = None
    shards_mod._WARNED_NO_OFFSETS.add(old.location)  # this test is not about the warning
    n = 11 * 16
    for start in range(0, n - 20):
        a = _RowReader(m, "train", start, None).take(20, 19)
        b = _RowReader(old, "train", start, None).take(20, 19)
        assert a.tolist() == b.tolist() == list(range(start, start + 20)), start
    for first in range(11):
        a = [(i, ids.tolist()) for i, ids in iter_chunks(m, "train", first)]
        b = [(i, ids.tolist()) for i, ids in iter_chunks(old, "train", first)]
        assert a == b and [i for i, _ in a] == list(range(first, 11))


def test_streams_resume_identically_mid_shard(tmp_path):
    m = make_corpus(tmp_path, n_chunks=12, chunk=32, per_shard=4)
    ref = [b.tokens for b in _take(TokenStream(m, "train", 3, 7), 40)]
    first = TokenStream(m, "train", 3, 7)
    _take(first, 23)
    resumed = TokenStream(m, "train", 3, 7)
    resumed.load_state_dict(first.state_dict())
    for a, b in zip(_take(resumed, 17), ref[23:], strict=True):
        assert torch.equal(a.tokens, b)


def _take(stream, n):
    out = []
    for b in stream:
        out.append(b)
        if len(out) == n:
            break
    return out


def test_url_shards_are_still_read_from_their_first_member(tmp_path):
    m = make_corpus(tmp_path, n_chunks=12, chunk=32, per_shard=4)
    template = f"pipe:cat {tmp_path}/{{shard}}"
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no offsets warning: the manifest has them
        a = _RowReader(m, "train", 6 * 32 + 5, template).take(40, 39)
    assert a.tolist() == list(range(6 * 32 + 5, 6 * 32 + 45))


# ----------------------------------------------------------------------------- offsets
def test_manifest_offsets_are_the_tar_header_offsets_of_each_chunk(tmp_path):
    m = make_corpus(tmp_path, n_chunks=10, chunk=16, per_shard=4)
    for shard in m.split("train").shards:
        with tarfile.open(tmp_path / shard.path) as tar:
            members = tar.getmembers()
        key = [t.name.split(".")[0] for t in members]
        starts = [t.offset for i, t in enumerate(members) if i == 0 or key[i] != key[i - 1]]
        last = members[-1]
        assert shard.chunk_offsets == starts + [
            last.offset_data + -(-last.size // 512) * 512]
        assert len(shard.chunk_offsets) == shard.n_chunks + 1


def test_offsets_and_seeking_handle_pax_and_gnu_long_name_headers(tmp_path):
    """The project's writer emits plain ustar headers; a shard rewritten by another tool may
    carry pax or GNU long-name headers, which the offsets must include."""
    for fmt in (tarfile.PAX_FORMAT, tarfile.GNU_FORMAT):
        path = tmp_path / f"long-{fmt}.tar"
        keys = [("k" * (150 if i % 2 else 3)) + f"{i:03d}" for i in range(5)]
        with tarfile.open(path, "w", format=fmt) as tar:
            for key in keys:
                for ext, data in (("meta.json", b"{}"), ("tokens.npy", bytes(700))):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        offsets = group_offsets(path)
        assert len(offsets) == len(keys) + 1
        for i, off in enumerate(offsets[:-1]):
            got = [s["__key__"] for s in _groups_from(path, off, str(path))]
            assert got == keys[i:], (fmt, i)


def test_manifests_round_trip_offsets_and_tolerate_unknown_shard_fields(tmp_path):
    m = make_corpus(tmp_path, n_chunks=5, chunk=16, per_shard=4)
    d = json.loads(m.to_json())
    d["splits"]["train"]["shards"][0]["future_field"] = 1
    again = Manifest.from_json(json.dumps(d), m.location)
    assert [s.chunk_offsets for s in again.split("train").shards] == \
        [s.chunk_offsets for s in m.split("train").shards]
    assert "chunk_offsets" not in json.dumps(  # episode-style shards write no null field
        json.loads(Manifest.from_json(strip_offsets(tmp_path).to_json(), "x").to_json()))


# ----------------------------------------------------------------------------- bad shards
def test_a_shard_truncated_before_the_seek_offset_fails_naming_it(tmp_path):
    m = make_corpus(tmp_path, n_chunks=12, chunk=32, per_shard=4)
    shard = m.split("train").shards[1]
    path = tmp_path / shard.path
    path.write_bytes(path.read_bytes()[: shard.chunk_offsets[2]])
    with pytest.raises(ShardError, match=r"train-000001\.tar.*truncated"):
        _RowReader(m, "train", 7 * 32, None).take(40, 39)     # chunk 3 of shard 1
    with pytest.raises(ShardError, match=r"train-000001\.tar"):
        _RowReader(m, "train", 6 * 32 + 3, None).take(100, 99)  # chunk 2: gone


def test_offsets_that_do_not_match_the_shard_fail_instead_of_reading_garbage(tmp_path):
    m = make_corpus(tmp_path, n_chunks=12, chunk=32, per_shard=4)
    m.split("train").shards[1].chunk_offsets[2] += 512   # inside chunk 6's first member
    with pytest.raises(ShardError, match=r"train-000001\.tar"):
        _RowReader(m, "train", 6 * 32, None).take(10, 9)
