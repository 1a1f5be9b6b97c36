"""The backbones answer through one interface (model/backbones/), looked up by
`model.backbone` in one registry; a ModelConfig is built without reading anything, and the
pretrained checkpoint's shape is read in a step of its own (`resolve_shape`), without which
whatever needs the shape refuses by name; what an architecture is (positions, logits,
windows, experts) is read from its config (model/pretrained/traits.py) and the planner's
layouts are the one table left (model/pretrained/architectures.py)."""

from types import SimpleNamespace

import pytest
import torch
from pretrained_helpers import V, hf_model_section, tiny_gpt2

from model import ConfigError, ModelConfig, backbone_of, build_model, resolve_shape
from model.backbones import BACKBONES, Backbone, shape_class
from model.config import BACKBONE_TRAITS
from model.pretrained import checkpoint_config
from model.pretrained.architectures import planned
from model.pretrained.shapes import layout
from model.pretrained.traits import config_traits


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    return tiny_gpt2(tmp_path_factory.mktemp("hf") / "gpt2")


def test_every_backbone_the_config_accepts_has_one_entry_in_the_registry():
    assert set(BACKBONES) == set(BACKBONE_TRAITS)
    for name, backbone in BACKBONES.items():
        assert isinstance(backbone, Backbone) and backbone.name == name
        assert backbone.traits is BACKBONE_TRAITS[name]
    assert backbone_of(ModelConfig()) is BACKBONES["native"]


def test_a_pretrained_model_config_is_built_without_reading_the_checkpoint(monkeypatch,
                                                                          tmp_path):
    def no_reading(*args):
        raise AssertionError("the checkpoint's config was read while building a ModelConfig")
    monkeypatch.setattr(checkpoint_config, "_hf_config", no_reading)
    absent = str(tmp_path / "absent")       # a directory that does not exist reads nothing
    built = [ModelConfig(backbone="hf", mechanism="rmt", mem_len=0, hf={"path": absent}),
             ModelConfig.from_dict(hf_model_section(absent))]
    for cfg in built:
        assert not cfg.shape_read and cfg.hf.model_type == ""
    monkeypatch.undo()
    with pytest.raises(ConfigError) as err:  # the step of its own reads it, and fails here
        resolve_shape(built[1])
    assert err.value.field == "model.hf.path"


def test_a_shape_not_read_is_refused_where_it_is_needed_and_read_by_build_model(gpt2):
    cfg = ModelConfig.from_dict(hf_model_section(gpt2, m=2, tgt_len=8))
    assert (cfg.vocab_size, cfg.d_model) == (256, 64)     # the defaults, not the checkpoint's
    needs = [lambda: shape_class(cfg).segment_shapes(cfg, 1, 0),
             lambda: shape_class(cfg).parameter_counts(cfg),
             lambda: backbone_of(cfg).build(cfg)]
    for need in needs:
        with pytest.raises(ConfigError, match="which was not read yet") as err:
            need()
        assert err.value.field == "model.hf.path"
    torch.manual_seed(0)
    model = build_model(cfg)                  # reads the shape first
    assert cfg.shape_read and (cfg.vocab_size, cfg.hf.model_type) == (V, "gpt2")
    assert model.base.get_input_embeddings().weight.shape[0] == V
    assert shape_class(cfg).parameter_counts(cfg).total > 0


def test_the_native_stack_reads_nothing_and_its_shape_is_its_config():
    cfg = ModelConfig(vocab_size=50)
    assert cfg.shape_read and resolve_shape(cfg) is cfg and cfg.vocab_size == 50


def test_an_architecture_that_cannot_hold_memory_tokens_is_refused_naming_why():
    # No list of names any more: an architecture is refused by what its config says it is.
    with pytest.raises(ConfigError, match="'t5' is an encoder-decoder model") as err:
        config_traits(SimpleNamespace(model_type="t5", is_encoder_decoder=True))
    assert err.value.field == "model.hf.path"
    # The planner's layouts are the one table left; an architecture the planner has none
    # for is refused naming the planned ones.
    assert planned() == ["gpt2", "llama", "mistral", "qwen2"]
    with pytest.raises(ConfigError, match="planned architectures: gpt2, llama, mistral, "
                                          "qwen2$"):
        layout(SimpleNamespace(model_type="qwen3"))


def test_the_vocabulary_fit_is_exact_for_the_native_stack_and_a_bound_for_a_pretrained_one():
    from evaluation.generation import DataIds, fit_to_data

    class Model(torch.nn.Module):
        def __init__(self, backbone):
            super().__init__()
            self.cfg = SimpleNamespace(backbone=backbone, vocab_size=10)
    for backbone, n_ids, fits in (("native", 10, True), ("native", 8, False),
                                  ("native", 12, False), ("hf", 10, True), ("hf", 8, True),
                                  ("hf", 12, False)):
        model, data = Model(backbone), SimpleNamespace(vocab_size=n_ids)
        if not fits:
            with pytest.raises(ConfigError, match=f"the model has 10 ids but the data at "
                                                  f"here have {n_ids}"):
                fit_to_data(model, data, "here")
            continue
        fitted = fit_to_data(model, data, "here")
        assert isinstance(fitted, DataIds) == (n_ids < 10)
        assert (fitted.n_ids if n_ids < 10 else n_ids) == n_ids


def test_what_submission_stages_is_the_pretrained_checkpoint_only(tmp_path):
    native = ModelConfig()
    hf = ModelConfig.from_dict(hf_model_section(tmp_path / "ckpt"))
    assert backbone_of(native).checkpoint_source(native) is None
    assert backbone_of(hf).checkpoint_source(hf) == ("model.hf.path", str(tmp_path / "ckpt"))
