"""`memtrain tasks` / `memtrain prepare` write shards that the streams read back intact."""

import numpy as np
import torch

from data_pipeline.shards import load_manifest
from data_pipeline.streams import EpisodeStream
from data_pipeline.tasks import generate, make_task, split_seed
from memtrain.cli import main


def test_tasks_command_round_trips_the_generated_samples_into_episode_batches(tmp_path):
    out = tmp_path / "copy"
    assert main(["tasks", "copy", "--src-len", "4", "--n-segments", "3", "--out", str(out),
                 "--train-size", "40", "--valid-size", "8", "--test-size", "8",
                 "--seed", "5"]) == 0
    m = load_manifest(out)
    assert m.kind == "episodes" and m.extra["n_segments"] == 3
    want = generate(make_task("copy", src_len=4, n_segments=3), 40, split_seed(5, "train"))
    stream = EpisodeStream(m, "train", 8, shuffle=False)
    episode = next(iter(stream))
    rebuilt = torch.cat([seg.tokens[:, :-1] for seg in episode], 1)
    assert torch.equal(rebuilt, torch.from_numpy(want.tokens[:8, :-1].astype(np.int64)))
    mask = torch.cat([seg.loss_mask for seg in episode], 1)
    assert torch.equal(mask, torch.from_numpy(want.loss_mask[:8]))


def test_tasks_command_reports_a_bad_segment_count_with_exit_code_2(tmp_path, capsys):
    assert main(["tasks", "copy", "--src-len", "4", "--n-segments", "5",
                 "--out", str(tmp_path / "x")]) == 2
    assert "n_segments" in capsys.readouterr().err


def test_prepare_command_shards_a_text_corpus_that_streams_back_in_order(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    text = ("the quick brown fox jumps over the lazy dog\n" * 300).encode()
    (raw / "a.txt").write_bytes(text)
    out = tmp_path / "shards"
    assert main(["prepare", "--corpus", "text", "--data-dir", str(raw), "--train",
                 str(raw / "a.txt"), "--out", str(out), "--chunk-tokens", "512",
                 "--chunks-per-shard", "4", "--verify", "--quiet"]) == 0
    m = load_manifest(out)
    assert m.kind == "tokens" and sum(s.n_tokens for s in m.splits.values()) == len(text)
    from data_pipeline.streams import TokenStream
    from data_pipeline.vocab_by_kind import vocab_from_dict

    vocab = vocab_from_dict(m.vocab)
    stream = TokenStream(m, "train", 1, 64, expected_vocab=vocab.fingerprint())
    first = next(iter(stream)).tokens[0]
    assert vocab.decode(first.tolist()) == text[:65].decode()
