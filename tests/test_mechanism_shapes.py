"""Each mechanism states its segment's shapes next to its code (model/shapes.py), and the
planner counts any mechanism from those shapes alone: the stated rows, keys and distances
are the ones the forward runs, and a mechanism registered from outside is planned without a
line of the planner knowing it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from reference import tiny_config

import model.attention as attention
import model.lm
from model import build_model
from model.mechanisms.xl.core import TransformerXL
from model.registry import Mechanism, register, unregister
from model.shapes import AttentionShape, LayerShape, SegmentShapes, TensorShape
from planner.activations import Dims, count_params, state_bytes
from planner.plan import main_plan
from planner.recompute import segment_ops
from planner.window import window_memory

ROOT = Path(__file__).resolve().parents[1]
ROWS = 3


def _float_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size() if value.is_floating_point() else 0
    if isinstance(value, dict):
        return sum(_float_bytes(v) for v in value.values())
    if isinstance(value, list):
        return sum(_float_bytes(v) for v in value)
    return 0


@pytest.mark.parametrize("cfg", [
    tiny_config("xl"), tiny_config("xl", mem_len=0), tiny_config("lamemo"),
    tiny_config("lamemo", n_layer=3, mem_len=3), tiny_config("rmt", mem_len=0),
    tiny_config("rmt", mem_len=5, pre_lnorm=True),
    tiny_config("lamemo", lamemo={"look_ahead": False}),
    tiny_config("armt", mem_len=0), tiny_config("armt", mem_len=5, pre_lnorm=True),
    tiny_config("armt", mem_len=0, pre_lnorm=True, armt={"carry_tokens": True}),
], ids=["xl", "xl-no-memory", "lamemo", "lamemo-short-memory", "rmt", "rmt-cache",
        "lamemo-without-look-ahead", "armt", "armt-cache", "armt-carried-tokens"])
def test_each_mechanism_states_the_shapes_its_forward_runs(cfg, monkeypatch):
    """One segment with a full memory: every attention call's (queries, keys, distances,
    with a graph or not) in forward order, and the floating-point bytes of the new state."""
    torch.manual_seed(0)
    lm = build_model(cfg).train()
    calls = []
    real = attention.relative_attention

    def recording(q, k, v, r, *args, **kwargs):
        calls.append((q.shape[1], k.shape[1], r.shape[0], torch.is_grad_enabled()))
        return real(q, k, v, r, *args, **kwargs)

    state = None
    for _ in range(3):   # fill the memory (mem_len 6 or less, segments of 4)
        calls.clear()
        monkeypatch.setattr(attention, "relative_attention", recording)
        out = lm(torch.randint(0, cfg.vocab_size, (ROWS, cfg.tgt_len)), state)
        state = out.state
        monkeypatch.undo()
    shapes = model.lm.core_class(cfg).segment_shapes(cfg, ROWS, cfg.mem_len)
    stated = [(a.queries, a.keys, a.distances, a.graph)
              for layer in shapes.layers for a in layer.attention]
    assert calls == stated
    assert len(shapes.layers) == cfg.n_layer
    assert shapes.state_bytes(4) == _float_bytes(state.state_dict())


class Sinks(TransformerXL):
    """A toy mechanism for the planner: XL plus g = 2 "sink" query rows per segment and an
    fp32 gate [B, L, H] saved per layer; it carries the XL cache and a [B, 3, d] summary."""

    @classmethod
    def segment_shapes(cls, cfg, rows, mem_len):
        n, g = cfg.tgt_len, 2
        q, k = n + g, mem_len + n + g
        attn = AttentionShape(q, k, k, q_input=q, kv_input=k, mask_per_row=True)
        layer = LayerShape((attn,), out_rows=q, input_rows=q, input_saved=True,
                           saved=(TensorShape((rows, n, cfg.n_head), "fp32"),))
        state = (TensorShape((rows, mem_len, cfg.d_model), count=cfg.n_layer),
                 TensorShape((rows, 3, cfg.d_model), "fp32"))
        return SegmentShapes((layer,) * cfg.n_layer, distances=k, output_rows=q,
                             state=state, state_text=f"sinks summary [{rows}, 3, d]",
                             saved_label="sink gates")


@pytest.fixture
def sinks():
    @register
    class SinksMechanism(Mechanism):
        name = "sinks"

        def core_class(self, cfg):
            return Sinks
    yield
    unregister("sinks")


def test_a_registered_mechanism_is_planned_from_the_shapes_it_states(sinks, capsys):
    cfg = tiny_config("sinks", dropout=0.1)
    c, b, m = cfg, ROWS, cfg.mem_len
    q, k = c.tgt_len + 2, m + c.tgt_len + 2
    dm = Dims(cfg, b, m, "fp32", kernel="cpu")
    assert state_bytes(dm) == c.n_layer * b * m * c.d_model * 4 + b * 3 * c.d_model * 4
    w = window_memory(dm, count_params(cfg), 1, False)
    # One-pass softmax on the CPU: fp32 probabilities [B, H, Q, K] per layer; the gates.
    assert w.per_segment["scores"] == c.n_layer * b * c.n_head * q * k * 4
    assert w.per_segment["extra"] == c.n_layer * b * c.tgt_len * c.n_head * 4
    # Dropout of the embeddings, of R (K distances), per layer over Q rows, of the output.
    assert segment_ops(dm).draws == b * c.tgt_len * c.d_model + k * c.d_model + c.n_layer * (
        b * q * (2 * c.d_model + c.d_inner)) + b * q * c.d_model
    assert main_plan(["--config", "quickstart", "--gpu", "a100-80gb",
                      "model.mechanism=sinks"]) == 0
    out = capsys.readouterr().out
    assert "memtrain plan: quickstart, sinks" in out
    assert "sinks summary [16, 3, d]" in out and "one segment: sink gates" in out


def test_the_planner_never_asks_which_mechanism_it_plans():
    for path in sorted((ROOT / "planner").glob("*.py")):
        code = path.read_text()
        assert "mechanism ==" not in code and ".mechanism in" not in code, path.name
        assert not re.search(r"""["'](xl|lamemo|rmt)["']|\.(lamemo|rmt)\.""", code), path.name
