"""A mechanism is one module: a toy mechanism defined only in this file is configured,
trained, checkpointed, resumed, evaluated (the engine's scoring, `memtrain eval`, RECL, the
analysis plots), planned, and run around a pretrained model, with no other file knowing it.

The toy ("summary memory"): Transformer-XL's cache plus one carried vector per row,
s_{τ+1} = decay * s_τ + (1 - decay) * mean_t h_τ,t (the segment's top-layer outputs), added
to every embedding of the next segment through a learned projection. One option
(`model.toy.decay`, in [0, 1)). It is named in the run config by its import path,
"test_toy_mechanism:Toy", so every process that reads the config finds it
(model/registry.py); the fixture removes it again, so the other tests' configs
never see its section.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import ClassVar

import pytest
import torch
from torch import nn
from train_helpers import tiny_config, train_in_process

from model import ConfigError, ModelConfig, build_model
from model.backbone import RelativeBackbone, causal_allowed
from model.mechanisms.xl.core import TransformerXL
from model.memory import MemoryState, XLMemory
from model.positional import distance_list
from model.registry import Mechanism, get, unregister
from model.shapes import TensorShape

NAME = "test_toy_mechanism:Toy"


@dataclass
class ToyOptions:
    # Weight of the old summary in the carried average.
    decay: float = 0.5


@dataclass
class ToyMemory(MemoryState):
    kind: ClassVar[str] = "toy"
    summary: torch.Tensor = field(default_factory=lambda: torch.zeros(0))   # [B, d]
    cache: XLMemory = field(default_factory=XLMemory)

    @property
    def length(self) -> torch.Tensor:
        return self.cache.length

    def reset_rows(self, mask: torch.Tensor) -> ToyMemory:
        keep = (~mask.to(self.summary.device))[:, None].to(self.summary.dtype)
        return ToyMemory(summary=self.summary * keep, cache=self.cache.reset_rows(mask))


def _summary(cfg, old: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    d = cfg.toy.decay
    return d * old + (1 - d) * hidden.mean(dim=1).to(old.dtype)


def _initial(batch: int, d: int, device) -> ToyMemory:
    return ToyMemory(summary=torch.zeros(batch, d, device=device),
                     cache=XLMemory(length=torch.zeros(batch, dtype=torch.long, device=device)))


class ToyCore(RelativeBackbone):
    """The native forward: XL's layers over [cache ∘ (embeddings + W s)]."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.summary_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    @classmethod
    def segment_shapes(cls, cfg, rows, mem_len):
        xl = TransformerXL.segment_shapes(cfg, rows, mem_len)
        return replace(xl, state=(*xl.state, TensorShape((rows, cfg.d_model))),
                       state_text=f"{xl.state_text}, toy summary [{rows}, {cfg.d_model}]",
                       state_aliases_inputs=False)

    def empty_state(self, batch_size, device=None) -> ToyMemory:
        return _initial(batch_size, self.cfg.d_model, device)

    def forward(self, h0, state, lengths):
        bsz, n, _ = h0.shape
        state = state if state is not None else self.empty_state(bsz, h0.device)
        h = h0 + self.summary_proj(state.summary.to(h0.dtype))[:, None]
        cache, m_now = state.cache, state.cache.mem_len_now
        allowed = causal_allowed(n, m_now, cache.length, lengths, h0.device)
        r_emb = self.r_emb(distance_list(m_now, n, 0, m_now + n, n_dist=m_now + n,
                                         device=h0.device), lengths, dtype=h0.dtype)
        inputs, bias = [], self.bias_tensors()
        for i, layer in enumerate(self.layers):
            inputs.append(h)
            u, v = self.biases(i, bias)
            h = self.run_layer(layer, h, cache.hids[i] if m_now else None, r_emb, u, v, allowed)
        h = self.drop(h)
        new_cache = (cache.appended(inputs, lengths.mem_len) if lengths.mem_len
                     else XLMemory(length=torch.zeros_like(cache.length)))
        return h, ToyMemory(summary=_summary(self.cfg, state.summary, h), cache=new_cache)


class Toy(Mechanism):
    name = "toy"
    section = "toy"
    options = ToyOptions
    state = ToyMemory
    pretrained = True

    def validate(self, cfg) -> None:
        if not 0 <= cfg.toy.decay < 1:
            raise ConfigError("model.toy.decay", f"must be in [0, 1), got {cfg.toy.decay}")

    def core_class(self, cfg):
        return ToyCore

    def pretrained_parameters(self, cfg, base, memory_scale):
        return {"summary_proj": nn.Linear(cfg.d_model, cfg.d_model, bias=False)}

    def pretrained_initial_state(self, lm, batch_size, device=None):
        return _initial(batch_size, lm.cfg.d_model, device)

    def pretrained_decode(self, lm, emb, state):
        x = emb + lm.summary_proj(state.summary.to(emb.dtype))[:, None]
        h = lm.base.base_model(inputs_embeds=x, use_cache=False)[0]
        return h, ToyMemory(summary=_summary(lm.cfg, state.summary, h), cache=state.cache)


@pytest.fixture
def toy():
    mech = get(NAME)      # imports this module by its path: the config's way
    yield mech
    unregister(NAME)
    unregister("toy")


def test_the_toy_is_configured_validated_and_written_with_its_own_section(toy):
    cfg = ModelConfig(mechanism=NAME, toy={"decay": 0.25}, mem_len=4)
    assert cfg.toy.decay == 0.25 and isinstance(cfg.mech, Toy)
    assert cfg.to_dict()["toy"] == {"decay": 0.25}
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    for bad, name in (({"decay": 1.0}, "model.toy.decay"), ({"decay": "x"}, "model.toy.decay"),
                      ({"rate": 1}, "model.toy.rate")):
        with pytest.raises(ConfigError) as err:
            ModelConfig.from_dict({"mechanism": NAME, "toy": bad})
        assert err.value.field == name


def test_a_mechanism_the_registry_cannot_import_is_refused_by_name():
    with pytest.raises(ConfigError) as err:
        ModelConfig(mechanism="no_such_module:Toy")
    assert err.value.field == "model.mechanism"


def test_the_toy_trains_resumes_evaluates_and_is_analysed(toy, tmp_path, monkeypatch,
                                                             capsys):
    from evaluation.analyze_cli import main_analyze
    from evaluation.cli import main_eval
    from evaluation.recl_cli import main_recl
    from train.config import load_config
    config = tiny_config(tmp_path, "toy", max_steps=3, save_every=3,
                         model={"mechanism": NAME, "toy": {"decay": 0.5}, "n_layer": 1,
                                "d_model": 16, "d_inner": 32, "tgt_len": 4, "mem_len": 4},
                         data={"global_batch": 2}, eval={"max_segments": 2})
    train_in_process(load_config(config), monkeypatch)
    run = tmp_path / "runs" / "toy"
    # Resumed from the step-3 checkpoint (the toy's memory loads back by its kind).
    train_in_process(load_config(config, ["max_steps=5"]), monkeypatch)
    steps = [json.loads(line).get("step") for line in (run / "metrics.jsonl").read_text()
             .splitlines()]
    assert max(s for s in steps if s is not None) == 5
    assert main_eval(["--run-dir", str(run), "--no-track"]) == 0
    assert main_recl(["--run-dirs", str(run), "--start", "0", "--step", "4", "--max-context", "8",
                      "--rows", "2", "--max-tokens", "64", "--no-track", "--split", "test",
                      "--out", str(tmp_path / "recl")]) == 0
    assert (tmp_path / "recl").is_dir()
    assert main_analyze(["--config", str(config), "--split", "test", "--segments", "2",
                         "--rows", "2", "--no-track"]) == 0
    assert list((run / "analysis").glob("attention_vs_distance_*.png"))


def test_the_toy_is_planned_from_the_shapes_it_states(toy, capsys):
    from planner.plan import main_plan
    assert main_plan(["--config", "quickstart", "--gpu", "a100-80gb",
                      f"model.mechanism={NAME}"]) == 0
    assert "toy summary [16, " in capsys.readouterr().out


def test_the_toy_runs_around_a_pretrained_model(toy, tmp_path):
    from pretrained_helpers import tiny_gpt2
    path = tiny_gpt2(tmp_path / "gpt2")
    cfg = ModelConfig(mechanism=NAME, backbone="hf", tgt_len=4, mem_len=0,
                      toy={"decay": 0.5}, hf={"path": str(path)})
    torch.manual_seed(0)
    lm = build_model(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, 4))
    first = lm(x, targets=x)
    second = lm(x, first.state, targets=x)
    assert isinstance(second.state, ToyMemory) and second.state.summary.abs().sum() > 0
    second.loss.backward()
    assert lm.summary_proj.weight.grad.abs().sum() > 0   # the memory reached the loss
