"""The data regime (train/regime.py): decided once from the manifest, it answers everything
that differs between a token stream and task samples: the stream, the window plan, the
curriculum, the evaluation loop, the planner's window and what the tools refuse."""

import numpy as np
import pytest
from reference import tiny_model

from data_pipeline.shard_writer import write_episode_split, write_manifest
from data_pipeline.shards import Manifest, load_manifest
from data_pipeline.streams import EpisodeStream, TokenStream
from data_pipeline.synthetic import write_repeat_corpus
from model import ConfigError
from train.bptt import SampleWindows, StreamWindows
from train.config import BPTTConfig, CurriculumConfig, from_dict
from train.curriculum import NoCurriculum, SegmentCurriculum
from train.evaluate import evaluate, protocol_for
from train.regime import TaskSampleRegime, TokenStreamRegime, regime_of

N, T, N_SEG = 16, 12, 3       # 16 task samples of 12 positions, 3 segments of 4


@pytest.fixture(scope="module")
def samples(tmp_path_factory):
    out = tmp_path_factory.mktemp("samples")
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 20, (N, T + 1)).astype(np.uint8)
    answer = np.zeros((N, T), dtype=bool)
    answer[:, -4:] = True
    info = write_episode_split(out, "train", tokens, answer, answer.copy(), 8)
    write_manifest(out, Manifest("episodes", "test", {"kind": "task"}, "e" * 64, 23, "uint8",
                                 T + 1, {"train": info}, extra={"n_segments": N_SEG}))
    return regime_of(load_manifest(out))


@pytest.fixture(scope="module")
def stream(tmp_path_factory):
    out = tmp_path_factory.mktemp("stream")
    write_repeat_corpus(out, n_symbols=23, split_tokens={"train": 2000, "valid": 400,
                                                         "test": 400})
    return regime_of(load_manifest(out))


def _cfg(path, **sections):
    return from_dict({"model": {"mechanism": "rmt", "vocab_size": 23, "n_layer": 2,
                                "d_model": 16, "n_head": 2, "d_inner": 32, "tgt_len": 4,
                                "mem_len": 0, "rmt": {"num_mem_tokens": 2}},
                      "data": {"path": str(path), "global_batch": 4, "valid_split": "train"},
                      "eval": {"split": "train"}, **sections})


def test_the_manifest_decides_the_regime_once(samples, stream):
    assert isinstance(samples, TaskSampleRegime) and samples.name == "task samples"
    assert isinstance(stream, TokenStreamRegime) and stream.name == "a token stream"
    assert (samples.positions, samples.task_segments) == (T, N_SEG)
    assert stream.carries_memory and not samples.carries_memory


def test_each_regime_gives_its_own_stream_of_the_ranks_rows(samples, stream):
    s = samples.train_stream(_cfg(samples.manifest.location), rank=1, world=2)
    assert isinstance(s, EpisodeStream) and list(s.rows) == [2, 3]
    episode = next(iter(s))
    assert len(episode) == N_SEG and episode[0].tokens.shape == (2, T // N_SEG + 1)
    t = stream.train_stream(_cfg(stream.manifest.location), rank=0, world=2)
    assert isinstance(t, TokenStream) and list(t.rows) == [0, 1] and t.seg_len == 4


def test_a_stream_is_cut_into_bptt_windows_and_a_task_sample_is_one_window(samples, stream):
    for mode in ("window", "sliding"):
        plan = stream.window_plan(BPTTConfig(depth=2, mode=mode))
        assert isinstance(plan, StreamWindows) and plan.kind == mode
    plan = samples.window_plan(BPTTConfig(depth=0))
    assert isinstance(plan, SampleWindows) and plan.kind == "episodes"
    with pytest.raises(ConfigError, match="bptt.mode: sliding applies to token streams; "
                                          "task samples"):
        samples.window_plan(BPTTConfig(depth=1, mode="sliding"))


def test_task_samples_fix_the_segment_length_a_stream_takes_any(samples, stream):
    samples.check_segments(T // N_SEG, "data")
    with pytest.raises(ConfigError, match=r"model.tgt_len: 6 differs from the task's segment "
                                          r"length 4 \(data\)"):
        samples.check_segments(6, "data")
    stream.check_segments(6, "data")


def test_only_task_samples_have_a_segment_curriculum(samples, stream):
    s = samples.train_stream(_cfg(samples.manifest.location), rank=0, world=1)
    cur = samples.curriculum(CurriculumConfig(segments=[1, 3], every=2), s, "data")
    assert isinstance(cur, SegmentCurriculum)
    cur.start(resumed=False)
    assert cur.segments == 1 and cur.metrics() == {"curriculum_segments": 1}
    assert cur.after_step(1) is None and cur.after_step(2) == 3 and s.n_segments == 3
    # Without stages, validation scores the task's own segment count.
    plain = samples.curriculum(CurriculumConfig(), s, "data")
    assert plain.segments == 3

    none = stream.curriculum(CurriculumConfig(), None, "data")
    assert isinstance(none, NoCurriculum)
    none.start(resumed=False)
    assert none.segments is None and none.metrics() == {}
    assert none.after_step(2) is None and none.after_validation(1.0) is None
    with pytest.raises(ConfigError, match="curriculum.segments: a segment curriculum needs "
                                          "task data .*holds a token stream"):
        stream.curriculum(CurriculumConfig(segments=[1, 3], every=2), None, "data")


def test_task_samples_are_scored_with_their_answer_accuracy_a_stream_without(samples, stream):
    model = tiny_model("rmt")
    for regime, accuracy in ((samples, True), (stream, False)):
        cfg = _cfg(regime.manifest.location)
        report = evaluate(model, model, regime.manifest, protocol_for(cfg), 0, 1, "cpu")
        assert ("accuracy" in report) == accuracy
        assert report["metric"] == ("accuracy" if accuracy else "ppl")
    # Only the answer tokens count on task samples: 4 per sample.
    cfg = _cfg(samples.manifest.location)
    assert samples.score(model, protocol_for(cfg), 0, 1, "cpu")[1] == N * 4


def test_the_planner_sizes_a_whole_sample_at_every_stage_and_no_carried_memory(samples,
                                                                                stream):
    assert stream.planned_windows(4, 2, []) == [(4, 3)]
    assert stream.carried_states("window", 2) == 1
    assert stream.carried_states("sliding", 2) == 3      # the sliding history's memories
    assert stream.fixed_window is None                   # the planner searches bptt.depth
    assert samples.planned_windows(4, 0, []) == [(4, 3)]
    assert samples.planned_windows(4, 0, [1, 3]) == [(12, 1), (4, 3)]
    assert samples.carried_states("window", 2) == 0
    assert samples.fixed_window == "task data: a window is the whole sample, 3 segments"


def test_tools_that_need_a_token_stream_refuse_task_samples_naming_the_regime(samples,
                                                                             stream):
    stream.require_token_stream("RECL")
    with pytest.raises(ValueError, match=r"RECL needs a token stream; these runs train on "
                                         r"task samples \(episodic data at .*samples"):
        samples.require_token_stream("RECL", "these runs train")
    with pytest.raises(ValueError, match="sweep needs a token stream; this run trains on task "
                                         "samples .*; score it with"):
        samples.require_token_stream("a sweep", hint="; score it with `memtrain eval`")
    assert samples.task_spec("n_segments") == N_SEG and stream.task_spec("n_segments") is None


def test_the_analysis_reads_a_streams_rows_side_by_side_and_samples_one_after_another(
        samples, stream):
    src = samples.analysis_segments("train", 4, 4, "")
    assert (src.per_row, src.units) == (N_SEG, N // 4)
    assert [i for (_, i), _ in zip(src.segments, range(5), strict=False)] == [0, 1, 2, 0, 1]
    src = stream.analysis_segments("train", 4, 4, "")
    assert src.units == 1 and src.per_row == (2000 // 4 - 1) // 4
    assert [i for (_, i), _ in zip(src.segments, range(3), strict=False)] == [0, 1, 2]
