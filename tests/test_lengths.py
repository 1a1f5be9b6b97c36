"""Evaluation memory lengths: one check, one way to switch them for a block of code."""

import pytest
import torch
from reference import tiny_model

from model import ConfigError
from train.config import load_config
from train.evaluate import protocol_for


def test_using_lengths_switches_for_the_block_and_restores_even_on_error():
    model = tiny_model("xl", mem_len=6)
    with model.using_lengths(mem_len=12, same_length=True) as lengths:
        assert (model.lengths.mem_len, model.lengths.same_length) == (12, True) == \
            (lengths.mem_len, lengths.same_length)
    assert (model.lengths.mem_len, model.lengths.same_length) == (6, False)
    with pytest.raises(RuntimeError), model.using_lengths(mem_len=3):
        raise RuntimeError("scoring failed")
    assert model.lengths.mem_len == 6


def test_invalid_lengths_are_refused_with_the_same_message_everywhere():
    model = tiny_model("lamemo", mem_len=6)
    with pytest.raises(ConfigError, match="model.mem_len: LaMemo refreshes a memory"):
        model.set_lengths(mem_len=0)
    with pytest.raises(ConfigError, match="eval.mem_len: LaMemo refreshes a memory"):
        load_config("quickstart", ["model.mechanism=lamemo", "eval.mem_len=0"])
    cfg = load_config("quickstart", ["eval.same_length=true"])
    # A protocol that asks for same_length without a memory is an error, not silently
    # turned into another protocol.
    with pytest.raises(ConfigError, match="eval.same_length: needs mem_len > 0"):
        protocol_for(cfg, mem_len=0)


def test_rmt_keeps_an_xl_cache_exactly_when_the_run_time_lengths_ask_for_one():
    model = tiny_model("rmt", mem_len=0)
    x = torch.randint(0, 23, (2, 4))
    with torch.no_grad():
        assert model(x).state.cache is None
        with model.using_lengths(mem_len=6):
            state = model(x).state
            assert state.cache is not None and int(state.cache.length[0]) == 6
            assert model(x, state).state.cache.mem_len_now == 6


def test_evaluation_lengths_left_unset_are_the_trained_ones():
    """One sentinel, null: eval.* lengths not given resolve to the model's."""
    cfg = load_config("quickstart", ["model.mem_len=24", "model.clamp_len=30"])
    assert (cfg.eval.tgt_len, cfg.eval.mem_len, cfg.eval.clamp_len, cfg.eval.same_length) \
        == (None, None, None, None)
    m = cfg.model
    assert cfg.eval.lengths(m) == (m.tgt_len, 24, 30, m.same_length)
    proto = protocol_for(cfg)
    assert (proto.tgt_len, proto.mem_len, proto.clamp_len, proto.same_length) == \
        tuple(cfg.eval.lengths(m))
    given = load_config("quickstart", ["eval.tgt_len=5", "eval.mem_len=0",
                                       "eval.clamp_len=-1", "eval.same_length=false"])
    assert tuple(given.eval.lengths(given.model)) == (5, 0, -1, False)


def test_the_old_as_trained_values_still_read_as_unset():
    """Run directories written before kept tgt_len 0 and mem_len -1 for "as trained"."""
    cfg = load_config("quickstart", ["eval.tgt_len=0", "eval.mem_len=-1"])
    assert (cfg.eval.tgt_len, cfg.eval.mem_len) == (None, None)
    assert cfg.eval.lengths(cfg.model)[:2] == (cfg.model.tgt_len, cfg.model.mem_len)
    with pytest.raises(ConfigError, match="eval.mem_len: must be >= 0"):
        load_config("quickstart", ["eval.mem_len=-2"])
    with pytest.raises(ConfigError, match="eval.tgt_len: must be > 0"):
        load_config("quickstart", ["eval.tgt_len=-3"])
