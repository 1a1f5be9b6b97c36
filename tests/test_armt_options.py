"""ARMT's own options (`model.armt.num_mem_tokens`, `model.armt.memory_norm`): read from
its section only, and configs written before they existed (which set RMT's) still load,
upgraded once with a FutureWarning (model/mechanisms/armt/mechanism.py `ARMT.upgrade`)."""

from __future__ import annotations

import warnings

import pytest

from model import ModelConfig, build_model

BASE = dict(mechanism="armt", vocab_size=19, n_layer=2, d_model=32, n_head=2, d_inner=64,
            tgt_len=8, mem_len=0, pre_lnorm=True)


def test_a_config_written_before_armts_own_fields_is_upgraded_once_with_a_warning():
    with pytest.warns(FutureWarning) as seen:
        cfg = ModelConfig.from_dict({**BASE, "rmt": {"num_mem_tokens": 6,
                                                     "memory_norm": "none"},
                                     "armt": {"carry_tokens": True}})
    said = " ".join(str(w.message) for w in seen)
    assert "model.armt.num_mem_tokens: 6" in said and "model.armt.memory_norm: 'none'" in said
    assert (cfg.armt.num_mem_tokens, cfg.armt.memory_norm) == (6, "none")
    assert build_model(cfg).core.memory_layer_norm is None       # 'none': no LayerNorm
    with warnings.catch_warnings():
        warnings.simplefilter("error")                            # written back: no warning
        again = ModelConfig.from_dict(cfg.to_dict())
    assert again.to_dict() == cfg.to_dict()


def test_armt_reads_its_own_section_only_once_the_config_is_built():
    cfg = ModelConfig(**BASE, armt={"num_mem_tokens": 5, "memory_norm": "embedding"})
    cfg.rmt.num_mem_tokens, cfg.rmt.memory_norm = 2, "none"
    assert cfg.mech.num_mem_tokens(cfg) == 5
    model = build_model(ModelConfig(**BASE, armt={"num_mem_tokens": 5, "carry_tokens": True,
                                                  "memory_norm": "embedding"},
                                    rmt={"memory_norm": "none"}))
    assert model.core.memory_init().shape[0] == 5
    assert model.core.memory_layer_norm is not None              # ARMT's 'embedding'


def test_a_config_that_names_neither_takes_the_defaults_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = ModelConfig(**BASE)
    assert (cfg.armt.num_mem_tokens, cfg.armt.memory_norm) == (10, "unit")


def test_armts_memory_norm_is_checked_by_its_own_name():
    from model import ConfigError
    with pytest.raises(ConfigError) as err:
        ModelConfig(**BASE, armt={"memory_norm": "layer"})
    assert err.value.field == "model.armt.memory_norm"
