"""Episode shards laid out by data_pipeline/episode_writer.py are byte for byte the ones
webdataset.TarWriter wrote through shard_writer._AtomicShardWriter (the writer before it,
kept below as the reference), and read back as the same samples."""

import numpy as np
import pytest

from data_pipeline.shard_writer import _AtomicShardWriter, write_episode_split, write_manifest
from data_pipeline.shards import (
    EPISODES,
    Manifest,
    SplitInfo,
    content_sha256,
    load_manifest,
    read_episodes,
    verify_split,
)


def reference_write(out_dir, split, tokens, loss_mask, answer_mask, samples_per_shard):
    """write_episode_split as it was: one TarWriter sample (four members) per episode."""
    writer = _AtomicShardWriter(out_dir, split, samples_per_shard)
    for i in range(tokens.shape[0]):
        row, loss, answer = (np.ascontiguousarray(a[i]) for a in (tokens, loss_mask,
                                                                   answer_mask))
        meta = {"split": split, "index": i, "sha256": content_sha256(row, loss, answer)}
        writer.write(i, {"__key__": f"{split}-{i:09d}", "tokens.npy": row,
                         "loss_mask.npy": loss, "answer_mask.npy": answer,
                         "meta.json": meta}, 1)
    writer.close_shard()
    return SplitInfo(n_tokens=int(tokens.shape[0]), shards=writer.shards)


def episodes(n, t, dtype, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, np.iinfo(dtype).max, (n, t + 1), endpoint=True).astype(dtype)
    loss = rng.random((n, t)) < 0.6
    return tokens, loss, loss & (rng.random((n, t)) < 0.5)


def assert_same_shards(tmp_path, split, arrays, per_shard):
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir(parents=True)
    new.mkdir()
    want = reference_write(old, split, *arrays, per_shard)
    got = write_episode_split(new, split, *arrays, per_shard)
    assert got == want      # paths, counts, first samples, file sha256s
    for shard in want.shards:
        assert (new / shard.path).read_bytes() == (old / shard.path).read_bytes(), shard.path
    assert sorted(p.name for p in new.iterdir()) == sorted(p.name for p in old.iterdir())
    return got


@pytest.mark.parametrize("dtype, n", [(np.uint8, 120), (np.uint16, 1100), (np.uint32, 120)])
def test_the_shards_are_the_reference_writers_bytes(tmp_path, dtype, n):
    # 1,100 episodes: indices of 1 to 4 digits (meta.json of four sizes), 5 shards, the last
    # one partial; lengths that fill .npy data to a block boundary and past it.
    for t in (7, 509):
        info = assert_same_shards(tmp_path / f"t{t}", "train", episodes(n, t, dtype), 250)
        assert sum(s.n_chunks for s in info.shards) == n
        assert [s.n_chunks for s in info.shards][:-1] == [250] * (len(info.shards) - 1)


def test_names_tarfile_writes_with_a_pax_path_record_are_the_same_bytes(tmp_path):
    # A key too long for the ustar name field, and a non-ASCII one: tarfile puts these names
    # in the pax header, so the writer cannot patch a template and builds each header.
    arrays = episodes(12, 5, np.uint16)
    assert_same_shards(tmp_path / "long", "s" * 95, arrays, 5)
    assert_same_shards(tmp_path / "utf8", "välid", arrays, 5)


def test_strided_inputs_and_an_empty_split(tmp_path):
    tokens, loss, answer = episodes(40, 16, np.uint16)
    strided = (np.asfortranarray(tokens), loss[:, ::1], np.asfortranarray(answer))
    assert_same_shards(tmp_path / "strided", "valid", strided, 16)
    empty = (tokens[:0], loss[:0], answer[:0])
    assert assert_same_shards(tmp_path / "empty", "test", empty, 16).shards == []


def test_the_written_episodes_read_back_as_the_samples(tmp_path):
    tokens, loss, answer = episodes(30, 10, np.uint8)
    info = write_episode_split(tmp_path, "train", tokens, loss, answer, 8)
    write_manifest(tmp_path, Manifest(EPISODES, "test", {"kind": "task"}, "e" * 64, 256,
                                      "uint8", 11, {"train": info}))
    manifest = load_manifest(tmp_path)
    verify_split(manifest, "train")
    for got, want in zip(read_episodes(manifest, "train"), (tokens, loss, answer), strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
