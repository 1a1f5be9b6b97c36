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
