"""A checkpoint's recorded model config against the run's: what counts as a change.

A field this code added after the checkpoint was written is absent from the checkpoint's
record; the model it trained ran with that field's default. Loading it must compare the
default, not report '<absent>' as a change (upgrading memtrain would otherwise refuse every
older run). A field that really differs is still named."""
from pathlib import Path

import pytest

from model import ModelConfig
from model.typed import ConfigError
from train.checkpoint import CheckpointInfo
from train.export import check_model_config


def _info(model_record: dict) -> CheckpointInfo:
    return CheckpointInfo(path=Path("ckpt/step00000010"), tag="step00000010", step=10,
                          world_size=1, zero_stage=0, meta={"model": model_record})


def _drop(record: dict, dotted: str) -> dict:
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in record.items()}
    *parents, leaf = dotted.split(".")
    node = out
    for p in parents:
        node = node[p]
    del node[leaf]
    return out


def test_fields_added_after_the_checkpoint_take_their_defaults_and_load():
    cfg = ModelConfig()
    record = cfg.to_dict()
    # A top-level field and one inside a mechanism's section, both at their defaults.
    section = next(k for k, v in record.items() if isinstance(v, dict) and v)
    inner = next(iter(record[section]))
    top = next(k for k, v in record.items() if not isinstance(v, dict) and k != "mechanism")
    older = _drop(_drop(record, f"{section}.{inner}"), top)
    check_model_config(_info(older), cfg)  # no error


def test_a_field_that_differs_is_still_named():
    cfg = ModelConfig()
    record = cfg.to_dict()
    record["d_model"] = cfg.d_model * 2
    with pytest.raises(ConfigError) as err:
        check_model_config(_info(record), cfg)
    assert err.value.field == "model.d_model"
    assert str(cfg.d_model * 2) in str(err.value)
