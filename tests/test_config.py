"""ModelConfig validation, (de)serialisation, and MemoryLM.set_lengths.

A bad value must fail at construction, before any tensor is allocated, with a ConfigError
whose message names the offending field.
"""

import json

import pytest
import torch

from model import ConfigError, LaMemoOptions, ModelConfig, RMTOptions, build_model

TINY = dict(vocab_size=50, n_layer=2, d_model=32, n_head=4, d_inner=64, dropout=0.0,
            tgt_len=4, mem_len=4)


def config(**overrides) -> ModelConfig:
    return ModelConfig(**{**TINY, **overrides})


# (id, overrides, field named in the error)
BAD = [
    ("negative_mem_len", dict(mem_len=-1), "model.mem_len"),
    ("tgt_len_0", dict(tgt_len=0), "model.tgt_len"),
    ("n_head_not_dividing_d_model", dict(n_head=5), "model.n_head"),
    ("n_head_0", dict(n_head=0), "model.n_head"),
    ("negative_d_head", dict(d_head=-1), "model.d_head"),
    ("unknown_mechanism", dict(mechanism="mamba"), "model.mechanism"),
    ("lamemo_without_memory", dict(mechanism="lamemo", mem_len=0), "model.mem_len"),
    ("rmt_zero_mem_tokens", dict(mechanism="rmt", rmt={"num_mem_tokens": 0}),
     "model.rmt.num_mem_tokens"),
    ("dropout_1", dict(dropout=1.0), "model.dropout"),
    ("dropatt_negative", dict(dropatt=-0.1), "model.dropatt"),
    ("clamp_len_0", dict(clamp_len=0), "model.clamp_len"),
    ("clamp_len_below_minus_1", dict(clamp_len=-2), "model.clamp_len"),
    ("same_length_without_memory", dict(same_length=True, mem_len=0), "model.same_length"),
    ("unknown_attn_impl", dict(attn_impl="flash"), "model.attn_impl"),
    ("cutoffs_not_increasing", dict(cutoffs=[20, 10]), "model.cutoffs"),
    ("cutoffs_repeated", dict(cutoffs=[10, 10]), "model.cutoffs"),
    ("cutoff_equal_to_vocab", dict(cutoffs=[10, 50]), "model.cutoffs"),
    ("cutoff_beyond_vocab", dict(cutoffs=[10, 60]), "model.cutoffs"),
    ("tie_projs_too_short", dict(cutoffs=[10, 20], tie_projs=[False, True]), "model.tie_projs"),
    ("tie_projs_without_cutoffs", dict(tie_projs=[False, True]), "model.tie_projs"),
    ("div_val_without_cutoffs", dict(div_val=2), "model.div_val"),
    ("odd_d_model", dict(d_model=33, n_head=3), "model.d_model"),
    ("lamemo_bad_pos_enc", dict(mechanism="lamemo", lamemo={"pos_enc": "rope"}),
     "model.lamemo.pos_enc"),
    ("lamemo_eps_0", dict(mechanism="lamemo", lamemo={"eps": 0.0}), "model.lamemo.eps"),
    ("rmt_same_length", dict(mechanism="rmt", same_length=True), "model.same_length"),
    ("rmt_mem_loss_token_out_of_vocab", dict(mechanism="rmt", rmt={"mem_loss_token": 50}),
     "model.rmt.mem_loss_token"),
]


@pytest.mark.parametrize(("overrides", "field"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_config_raises_config_error_naming_the_field(overrides, field):
    with pytest.raises(ConfigError) as info:
        config(**overrides)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")
    assert len(str(info.value)) > len(field) + 2  # and gives a reason


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        config(mem_len=-1)


@pytest.mark.parametrize(("overrides", "field"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_config_from_dict_fails_the_same_way(overrides, field):
    data = {**TINY, **overrides}
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_dict(data)
    assert info.value.field == field


@pytest.mark.parametrize("mechanism", ["xl", "lamemo", "rmt"])
def test_build_model_rejects_a_bad_dict_before_building(mechanism):
    with pytest.raises(ConfigError, match="model.tgt_len"):
        build_model({**TINY, "mechanism": mechanism, "tgt_len": 0})


@pytest.mark.parametrize(("data", "field"), [
    ({**TINY, "n_layers": 3}, "model.n_layers"),
    ({**TINY, "mechanism": "lamemo", "lamemo": {"epsilon": 1e-6}}, "model.lamemo.epsilon"),
    ({**TINY, "mechanism": "rmt", "rmt": {"num_memory_tokens": 4}}, "model.rmt.num_memory_tokens"),
], ids=["top_level", "nested_lamemo", "nested_rmt"])
def test_from_dict_rejects_unknown_fields(data, field):
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_dict(data)
    assert info.value.field == field
    assert field in str(info.value)


VALID = {
    "xl_adaptive": dict(mechanism="xl", vocab_size=500, cutoffs=[100, 300], div_val=2,
                        tie_projs=[False, True, True], clamp_len=16, same_length=True,
                        untie_r=True, attn_impl="plain", dropout=0.1, dropatt=0.05),
    "lamemo": dict(mechanism="lamemo", lamemo={"eps": 1e-5, "interpolate": False,
                                               "pos_enc": "xl"}),
    "rmt": dict(mechanism="rmt", mem_len=0, rmt={"num_mem_tokens": 3, "mem_loss_weight": 0.01,
                                                 "mem_loss_token": 7,
                                                 "read_mem_from_cache": True}),
}


@pytest.mark.parametrize("name", VALID)
def test_valid_config_round_trips_through_to_dict_and_from_dict(name):
    cfg = config(**VALID[name])
    data = cfg.to_dict()
    assert isinstance(data["lamemo"], dict) and isinstance(data["rmt"], dict)
    back = ModelConfig.from_dict(data)
    assert back == cfg
    assert back.to_dict() == data
    assert isinstance(back.lamemo, LaMemoOptions) and isinstance(back.rmt, RMTOptions)
    # ... and through JSON, as a config file or checkpoint header would store it.
    again = ModelConfig.from_dict(json.loads(json.dumps(data)))
    assert again == cfg


def test_round_trip_keeps_non_default_values():
    cfg = config(**VALID["rmt"])
    back = ModelConfig.from_dict(cfg.to_dict())
    assert back.rmt.num_mem_tokens == 3 and back.rmt.mem_loss_token == 7
    assert back.rmt.read_mem_from_cache is True and back.mem_len == 0
    assert back != config(mechanism="rmt", mem_len=0)


def test_d_head_defaults_to_d_model_over_n_head_and_explicit_d_head_is_kept():
    assert config().d_head == 8
    assert config(n_head=5, d_head=7).d_head == 7  # explicit d_head: n_head need not divide


def test_nested_options_given_as_dicts_become_dataclasses():
    cfg = config(mechanism="rmt", rmt={"num_mem_tokens": 3})
    assert isinstance(cfg.rmt, RMTOptions) and cfg.rmt.num_mem_tokens == 3


# --------------------------------------------------------------------------- set_lengths
@pytest.mark.parametrize(("kwargs", "field"), [
    (dict(mem_len=-1), "model.mem_len"),
    (dict(clamp_len=0), "model.clamp_len"),
    (dict(same_length=True, mem_len=0), "model.same_length"),
])
def test_set_lengths_validates_and_leaves_lengths_unchanged_on_error(kwargs, field):
    model = build_model(config(clamp_len=8))
    before = (model.lengths.mem_len, model.lengths.clamp_len, model.lengths.same_length)
    with pytest.raises(ConfigError) as info:
        model.set_lengths(**kwargs)
    assert info.value.field == field
    assert (model.lengths.mem_len, model.lengths.clamp_len, model.lengths.same_length) == before


def test_set_lengths_keeps_mechanism_rules():
    lamemo = build_model(config(mechanism="lamemo"))
    with pytest.raises(ConfigError, match="model.mem_len"):
        lamemo.set_lengths(mem_len=0)
    rmt = build_model(config(mechanism="rmt", rmt={"num_mem_tokens": 3}))
    with pytest.raises(ConfigError, match="model.same_length"):
        rmt.set_lengths(same_length=True)


def test_set_lengths_changes_only_the_given_lengths():
    model = build_model(config(clamp_len=8))
    model.set_lengths(mem_len=12)
    assert (model.lengths.mem_len, model.lengths.clamp_len, model.lengths.same_length) == (
        12, 8, False)
    model.set_lengths(same_length=True)
    assert (model.lengths.mem_len, model.lengths.clamp_len, model.lengths.same_length) == (
        12, 8, True)


def _mem_len_now(state) -> int:
    cache = getattr(state, "cache", None)
    return cache.mem_len_now if cache is not None else state.mem_len_now


@pytest.mark.parametrize("mechanism", ["xl", "lamemo", "rmt", "armt"])
def test_evaluating_with_larger_mem_len_carries_a_longer_memory(mechanism):
    # Trained with mem_len 4 (for RMT: the XL cache beside the memory tokens).
    cfg = config(mechanism=mechanism, rmt={"num_mem_tokens": 3})
    torch.manual_seed(0)
    tokens = torch.randint(0, 50, (2, 5 * 4))
    lengths_seen = {}
    for eval_mem_len in (None, 12):
        model = build_model(cfg).eval()
        if eval_mem_len is not None:
            model.set_lengths(mem_len=eval_mem_len)
        state = None
        with torch.no_grad():
            for s in range(5):
                state = model(tokens[:, 4 * s:4 * (s + 1)], state).state
        lengths_seen[eval_mem_len] = _mem_len_now(state)
    assert lengths_seen[None] == 4  # the training mem_len caps the memory ...
    assert lengths_seen[12] == 12  # ... and the evaluation mem_len replaces it
