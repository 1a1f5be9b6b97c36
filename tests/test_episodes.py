"""Episodic streams: whole samples per row, reset at sample starts, seeded order, resume."""

import itertools
import tarfile

import numpy as np
import pytest
import torch

from data_pipeline.shard_writer import write_episode_split, write_manifest
from data_pipeline.shards import Manifest, ShardError, load_manifest
from data_pipeline.streams import EpisodeStream, LayoutError, TokenStream

N, T, N_SEG = 24, 12, 3  # 24 samples of 12 positions, 3 segments of 4


def make_episodes(tmp_path):
    # Sample i is [i, i, ..., i] (T+1 ids) so every read says which sample it came from.
    tokens = np.repeat(np.arange(N, dtype=np.uint8)[:, None], T + 1, axis=1)
    loss = np.zeros((N, T), dtype=bool)
    loss[:, T // 2:] = True
    info = write_episode_split(tmp_path, "train", tokens, loss, loss.copy(), 10)
    write_manifest(tmp_path, Manifest("episodes", "test", {"kind": "task"}, "e" * 64, N, "uint8",
                                      T + 1, {"train": info}, extra={"n_segments": N_SEG}))
    return load_manifest(tmp_path)


def episodes(stream, n):
    return list(itertools.islice(iter(stream), n))


def test_each_row_takes_one_whole_sample_segment_by_segment_with_reset_at_its_start(tmp_path):
    m = make_episodes(tmp_path)
    ep = episodes(EpisodeStream(m, "train", 4, seed=1), 1)[0]
    assert len(ep) == N_SEG
    for s, seg in enumerate(ep):
        assert seg.tokens.shape == (4, T // N_SEG + 1)
        assert seg.reset.all() == (s == 0) and seg.reset.any() == (s == 0)
        assert torch.equal(seg.loss_mask, torch.tensor([[False] * 4, [False, False, True, True],
                                                        [True] * 4][s]).expand(4, -1))
    samples = ep[0].tokens[:, 0]
    for seg in ep:  # the same sample in a row across the episode
        assert torch.equal(seg.tokens[:, 0], samples)


def test_sample_order_is_a_seeded_permutation_per_epoch(tmp_path):
    m = make_episodes(tmp_path)
    first = [e[0].tokens[:, 0] for e in episodes(EpisodeStream(m, "train", 4, seed=1), 12)]
    epoch0 = torch.cat(first[:6]).tolist()
    epoch1 = torch.cat(first[6:]).tolist()
    assert sorted(epoch0) == list(range(N)) and sorted(epoch1) == list(range(N))
    assert epoch0 != epoch1 and epoch0 != list(range(N))
    again = [e[0].tokens[:, 0] for e in episodes(EpisodeStream(m, "train", 4, seed=1), 6)]
    assert torch.cat(again).tolist() == epoch0
    other = [e[0].tokens[:, 0] for e in episodes(EpisodeStream(m, "train", 4, seed=2), 6)]
    assert torch.cat(other).tolist() != epoch0


def test_episode_stream_resumes_exactly_and_two_ranks_read_what_one_reads(tmp_path):
    m = make_episodes(tmp_path)
    ref = episodes(EpisodeStream(m, "train", 4, seed=3), 9)
    s = EpisodeStream(m, "train", 4, seed=3)
    episodes(s, 4)
    r = EpisodeStream(m, "train", 4, seed=3)
    r.load_state_dict(s.state_dict())
    for a, b in zip(episodes(r, 5), ref[4:], strict=True):
        assert torch.equal(a[0].tokens, b[0].tokens)
    r0 = episodes(EpisodeStream(m, "train", 4, 0, 2, seed=3), 9)
    r1 = episodes(EpisodeStream(m, "train", 4, 1, 2, seed=3), 9)
    for a, b, c in zip(ref, r0, r1, strict=True):
        assert torch.equal(a[1].tokens, torch.cat([b[1].tokens, c[1].tokens]))


def test_corrupted_episode_shard_and_too_few_samples_fail_clearly(tmp_path):
    m = make_episodes(tmp_path)
    with pytest.raises(LayoutError, match="24 samples, fewer than the global batch 32"):
        EpisodeStream(m, "train", 32)
    path = tmp_path / m.split("train").shards[0].path
    raw = bytearray(path.read_bytes())
    raw[raw.index(b"\x93NUMPY") + 130] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(ShardError, match=r"train-000000\.tar.*sample 0"):
        EpisodeStream(m, "train", 4)


def test_an_episode_shard_cut_at_a_tar_member_boundary_is_refused_naming_it(tmp_path):
    m = make_episodes(tmp_path)
    path = tmp_path / m.split("train").shards[1].path
    whole = path.read_bytes()
    with tarfile.open(path) as tar:
        cuts = [member.offset for member in tar.getmembers()[1:]]
    assert len(cuts) == 10 * 4 - 1  # 10 samples x 4 members
    for cut in cuts:
        path.write_bytes(whole[:cut])
        with pytest.raises(ShardError, match=r"train-000001\.tar.*truncated"):
            EpisodeStream(m, "train", 4)


def test_the_manifest_says_once_which_data_regime_it_holds(tmp_path):
    """Manifest.episodic decides episodes vs token stream for training, curriculum and
    evaluation; each stream refuses the other regime's manifest."""
    m = make_episodes(tmp_path)
    assert m.episodic
    with pytest.raises(LayoutError, match="holds episodes, not a token corpus"):
        TokenStream(m, "train", 4, T // N_SEG)
    tokens = Manifest("tokens", "test", {"kind": "bytes"}, "t" * 64, 256, "uint8", 65, {})
    assert not tokens.episodic
    with pytest.raises(LayoutError, match="holds tokens, not task episodes"):
        EpisodeStream(tokens, "train", 4)
