"""Shards and streams: order, resume, elasticity, and a clear error for every bad input."""

import itertools
import os
import shutil
import tarfile
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from data_pipeline.shard_writer import write_manifest, write_token_split
from data_pipeline.shards import Manifest, ShardError, id_dtype, load_manifest, verify_split
from data_pipeline.streams import LayoutError, TokenStream

N_TOKENS = 1000


def make_corpus(tmp_path: Path, n_tokens=N_TOKENS, chunk=64, per_shard=3) -> Manifest:
    """Token i of the split has id i (mod 60000): every read position is checkable."""
    data = np.arange(n_tokens) % 60000
    pieces = np.array_split(data, 7)  # uneven pieces: chunking must not depend on them
    info = write_token_split(tmp_path, "train", pieces, id_dtype(60000), chunk, per_shard)
    m = Manifest(kind="tokens", source="test", vocab={"kind": "test"}, vocab_fingerprint="f" * 64,
                 vocab_size=60000, dtype=str(id_dtype(60000)), chunk_tokens=chunk,
                 splits={"train": info})
    write_manifest(tmp_path, m)
    return load_manifest(tmp_path)


def take(stream, n):
    return list(itertools.islice(iter(stream), n))


def test_streams_are_contiguous_disjoint_and_cover_the_split_in_order(tmp_path):
    m = make_corpus(tmp_path)
    s = TokenStream(m, "train", global_batch=4, seg_len=7)
    S = N_TOKENS // 4
    batches = take(s, s.steps_per_epoch)
    for t, b in enumerate(batches):
        for row in range(4):
            start = row * S + t * 7
            assert b.tokens[row].tolist() == list(range(start, start + 8))
    # Consecutive steps overlap by exactly the one target token.
    assert batches[1].tokens[0, 0] == batches[0].tokens[0, -1]
    assert s.steps_per_epoch == (S - 1) // 7


def test_reset_flags_mark_each_epoch_start_and_the_epoch_wraps(tmp_path):
    m = make_corpus(tmp_path)
    s = TokenStream(m, "train", global_batch=4, seg_len=50)
    n = s.steps_per_epoch
    batches = take(s, n + 2)
    assert batches[0].reset.all() and not batches[1].reset.any()
    assert batches[n].reset.all() and batches[n].epoch == 1 and batches[n].step == 0
    assert torch.equal(batches[n].tokens, batches[0].tokens)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_resume_at_a_random_point_reproduces_the_uninterrupted_batches(tmp_path, seed):
    m = make_corpus(tmp_path)
    rng = np.random.default_rng(seed)
    cut = int(rng.integers(1, 40))
    ref = [b.tokens for b in take(TokenStream(m, "train", 4, 5), cut + 10)]
    first = TokenStream(m, "train", 4, 5)
    take(first, cut)
    state = first.state_dict()
    resumed = TokenStream(m, "train", 4, 5)
    resumed.load_state_dict(state)
    got = take(resumed, 10)
    for a, b in zip(got, ref[cut:], strict=True):
        assert torch.equal(a.tokens, b)
    assert not got[0].reset.any()  # the memory is restored with the stream: no reset


def test_two_ranks_together_read_exactly_what_one_rank_reads(tmp_path):
    m = make_corpus(tmp_path)
    one = take(TokenStream(m, "train", 4, 9), 12)
    r0 = take(TokenStream(m, "train", 4, 9, rank=0, world_size=2), 12)
    r1 = take(TokenStream(m, "train", 4, 9, rank=1, world_size=2), 12)
    for a, b, c in zip(one, r0, r1, strict=True):
        assert torch.equal(a.tokens, torch.cat([b.tokens, c.tokens]))


def test_resume_with_another_world_size_is_exact_for_the_same_global_batch(tmp_path):
    m = make_corpus(tmp_path)
    one = TokenStream(m, "train", 4, 9)
    take(one, 5)
    state = one.state_dict()
    ref = take(one, 3)
    r1 = TokenStream(m, "train", 4, 9, rank=1, world_size=2)
    r1.load_state_dict(state)
    assert torch.equal(take(r1, 1)[0].tokens, ref[0].tokens[2:])


def test_another_layout_is_relaid_with_a_warning_and_a_memory_reset(tmp_path):
    m = make_corpus(tmp_path)
    s = TokenStream(m, "train", 4, 10)
    take(s, 10)
    other = TokenStream(m, "train", 2, 10)
    with pytest.warns(UserWarning, match="re-laid"):
        other.load_state_dict(s.state_dict())
    b = take(other, 1)[0]
    assert b.reset.all()
    # Same fraction of the epoch: 10 of 24 steps -> step 20 of 49 on the wider streams.
    assert b.step == int(10 * 10 / 250 * 500) // 10


def test_shards_hold_the_split_in_order_with_manifest_counts_and_checksums(tmp_path):
    m = make_corpus(tmp_path, chunk=64, per_shard=3)
    info = m.split("train")
    assert info.n_tokens == N_TOKENS
    assert sum(s.n_tokens for s in info.shards) == N_TOKENS
    assert [s.first_chunk for s in info.shards] == [0, 3, 6, 9, 12, 15]
    verify_split(m, "train")
    assert not list(tmp_path.glob(".*tmp"))  # nothing half-written left behind


# ----------------------------------------------------------------------------- bad input
def read_all(m):
    s = TokenStream(m, "train", 1, 50, prefetch=2)
    return take(s, s.steps_per_epoch)


def test_corrupted_shard_fails_naming_the_shard_and_the_chunk(tmp_path):
    m = make_corpus(tmp_path)
    path = tmp_path / m.split("train").shards[1].path
    raw = bytearray(path.read_bytes())
    i = raw.index(b"\x93NUMPY") + 200  # inside the first chunk's ids
    raw[i] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(ShardError, match=r"train-000001\.tar.*chunk 3.*checksum"):
        read_all(m)
    with pytest.raises(ShardError, match="sha256"):
        verify_split(m, "train")


def test_truncated_shard_fails_naming_the_shard(tmp_path):
    m = make_corpus(tmp_path)
    path = tmp_path / m.split("train").shards[2].path
    path.write_bytes(path.read_bytes()[: os.path.getsize(path) // 2])
    with pytest.raises(ShardError, match=r"train-000002\.tar"):
        read_all(m)


def member_boundaries(path: Path) -> list[int]:
    """Byte offsets where a tar member starts: cutting the file there leaves only whole
    members (a copy interrupted between two files of the archive)."""
    with tarfile.open(path) as tar:
        return [member.offset for member in tar.getmembers()[1:]]


def test_a_shard_cut_at_any_tar_member_boundary_is_refused_naming_it(tmp_path):
    # Every cut loses whole chunks (between two member groups) or half a group (between a
    # chunk's meta.json and tokens.npy); the tar reader itself sees a clean end of archive.
    # No cut may yield fewer tokens: the reader must fail, naming the shard.
    m = make_corpus(tmp_path)
    path = tmp_path / m.split("train").shards[2].path
    whole = path.read_bytes()
    cuts = member_boundaries(path)
    assert len(cuts) == 5  # 3 chunks x (meta.json, tokens.npy), minus the first member
    for cut in cuts:
        path.write_bytes(whole[:cut])
        with pytest.raises(ShardError, match=r"train-000002\.tar.*truncated"):
            read_all(m)
    path.write_bytes(whole)
    assert sum(b.tokens.numel() for b in read_all(m)) > 0


def test_missing_shard_fails_naming_the_file(tmp_path):
    m = make_corpus(tmp_path)
    (tmp_path / m.split("train").shards[4].path).unlink()
    with pytest.raises(ShardError, match=r"missing shard .*train-000004\.tar"):
        read_all(m)


def test_manifest_and_shards_that_disagree_fail_with_both_chunk_numbers(tmp_path):
    m = make_corpus(tmp_path)
    a, b = (tmp_path / m.split("train").shards[i].path for i in (1, 2))
    shutil.copy(b, a)
    with pytest.raises(ShardError, match="chunk 6 .* expects chunk 3"):
        read_all(m)


def test_manifest_from_another_tokenizer_is_refused(tmp_path):
    m = make_corpus(tmp_path)
    with pytest.raises(ShardError, match="another tokenizer"):
        TokenStream(m, "train", 2, 8, expected_vocab="0" * 64)


def test_split_too_short_for_batch_times_length_names_the_numbers(tmp_path):
    m = make_corpus(tmp_path)
    with pytest.raises(LayoutError, match=r"1000 tokens.*100 streams.*11 tokens"):
        TokenStream(m, "train", global_batch=100, seg_len=10)


def test_world_size_that_does_not_divide_the_global_batch_is_refused(tmp_path):
    m = make_corpus(tmp_path)
    with pytest.raises(LayoutError, match="global batch 5 is not divisible by world size 2"):
        TokenStream(m, "train", 5, 8, rank=0, world_size=2)


def test_missing_manifest_says_to_prepare(tmp_path):
    with pytest.raises(ShardError, match="memtrain prepare"):
        load_manifest(tmp_path)


def test_a_reader_error_reaches_the_consumer_instead_of_hanging(tmp_path):
    m = make_corpus(tmp_path)
    (tmp_path / m.split("train").shards[0].path).unlink()
    with warnings.catch_warnings(), pytest.raises(ShardError):
        take(TokenStream(m, "train", 2, 8), 1)


def test_shards_read_through_a_pipe_url_give_the_same_batches(tmp_path):
    m = make_corpus(tmp_path)
    local = take(TokenStream(m, "train", 4, 9), 8)
    piped = take(TokenStream(m, "train", 4, 9, url_template=f"pipe:cat {tmp_path}/{{shard}}"),
                 8)
    for a, b in zip(local, piped, strict=True):
        assert torch.equal(a.tokens, b.tokens)
