"""WindowPlan: the one place that turns `bptt.*` into BPTT windows, for a token stream
(StreamWindows) or for task samples (SampleWindows); the data regime picks which."""

import pytest
import torch
from reference import tiny_config

from data_pipeline.streams import SegmentBatch
from model import ConfigError, build_model
from train.bptt import SampleWindows, StreamWindows, run_window
from train.config import BPTTConfig


def _batches(n_rows=2, seg=4, start=0):
    t = start
    while True:
        yield SegmentBatch(torch.arange(t, t + seg + 1).repeat(n_rows, 1) % 23,
                           torch.zeros(n_rows, dtype=torch.bool), None, 0, t)
        t += seg


def test_each_plan_hands_out_the_windows_its_mode_promises():
    window = StreamWindows(BPTTConfig(depth=2, mode="window"))
    w = window.next_window(_batches(), "memory")
    assert len(w.segments) == 3 and w.start == "memory" and w.counted is None
    assert w.new_tokens == 3 * 2 * 4

    sliding = StreamWindows(BPTTConfig(depth=2, mode="sliding"))
    model = build_model(tiny_config("rmt")).eval()
    batches, memory = _batches(), None
    for step in range(4):
        w = sliding.next_window(batches, memory)
        assert len(w.segments) == min(step, 2) + 1 and w.counted[-1] is True
        assert w.new_tokens == 2 * 4  # only the new segment is new
        memory = sliding.after_step(w, run_window(model, w.start, w.segments, "cpu"))

    episodes = SampleWindows(BPTTConfig(depth=0))
    segs = [next(_batches(start=4 * i)) for i in range(3)]
    w = episodes.next_window(iter([segs]), "ignored")
    assert w.start is None and w.cuts == frozenset({1, 2})  # depth 0: each segment alone
    assert episodes.after_step(w, None) is None  # samples never carry memory on


def test_sliding_history_saved_with_another_depth_is_refused_on_load():
    model = build_model(tiny_config("rmt")).eval()
    plan = StreamWindows(BPTTConfig(depth=2, mode="sliding"))
    w = plan.next_window(_batches(), None)
    plan.after_step(w, run_window(model, w.start, w.segments, "cpu"))
    saved = plan.state_dict()
    other = StreamWindows(BPTTConfig(depth=1, mode="sliding"))
    with pytest.raises(ConfigError, match="bptt.depth: .*saved with depth 2, this run has 1"):
        other.load_state_dict(saved, torch.device("cpu"))
    same = StreamWindows(BPTTConfig(depth=2, mode="sliding"))
    same.load_state_dict(saved, torch.device("cpu"))
    assert len(same.history.items) == 1


def test_sliding_windows_on_task_samples_are_refused_by_name():
    with pytest.raises(ConfigError, match="bptt.mode: sliding applies to token streams"):
        SampleWindows(BPTTConfig(depth=1, mode="sliding"))
