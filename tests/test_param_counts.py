"""The papers' full-size configurations have the papers' parameter counts.

Models are built on the meta device (no memory, no init cost). Each count is checked twice:
against the paper's rounded figure, and exactly against a hand count written out below from
the architecture (per layer: q/kv/r/o projections without biases, two LayerNorms, the FFN;
plus the tied embedding/softmax, the softmax biases, the adaptive-softmax cluster head and the
shared u/v biases).
"""

import functools
import json
from unittest import mock

import pytest
import torch

from model import ModelConfig, build_model

# Transformer-XL (Dai et al. 2019), Table 2: enwik8 base (12L) 41M.
ENWIK8_BASE = dict(n_layer=12, d_model=512, n_head=8, d_head=64, d_inner=2048,
                   vocab_size=204, tgt_len=512, mem_len=512, dropout=0.1, dropatt=0.0)
# Transformer-XL Table 1: WikiText-103 base 151M (adaptive input/softmax, tie_projs F,T,T,T);
# LaMemo (Ji et al. 2022) uses the same shape.
WT103_BASE = dict(n_layer=16, d_model=410, n_head=10, d_head=41, d_inner=2100,
                  vocab_size=267735, cutoffs=[20000, 40000, 200000], div_val=1,
                  tie_weight=True, tie_projs=[False, True, True, True], tgt_len=150,
                  mem_len=150, dropout=0.1, dropatt=0.0)


INIT_FNS = ("normal_", "uniform_", "kaiming_uniform_", "zeros_", "ones_")


def meta_count(**cfg) -> int:
    return _meta_count(json.dumps(cfg, sort_keys=True))


@functools.cache
def _meta_count(cfg_json: str) -> int:
    # Cached: several tests compare against the same baseline. Meta tensors hold no values,
    # so the init functions are skipped: on meta they work but their first call imports
    # torch._dynamo (~3 s here). test_meta_count_equals_real_count_on_a_small_model checks
    # that this build has exactly the parameters of an ordinary one.
    no_op = {name: (lambda t, *_, **__: t) for name in INIT_FNS}
    with mock.patch.multiple(torch.nn.init, **no_op), torch.device("meta"):
        model = build_model(ModelConfig(**json.loads(cfg_json)))
    assert all(p.is_meta for p in model.parameters())
    # Parameters are counted once even when tied (model.parameters() deduplicates).
    return model.num_params()


def layer_count(d: int, n_head: int, d_head: int, d_inner: int) -> int:
    hd = n_head * d_head
    attn = d * hd + 2 * d * hd + d * hd + hd * d  # q_net, kv_net, r_net, o_net (no biases)
    norms = 2 * 2 * d  # attention and FFN LayerNorms, weight + bias
    ff = d * d_inner + d_inner + d_inner * d + d
    return attn + norms + ff


def xl_count(cfg: dict) -> int:
    d, h, dh, v = cfg["d_model"], cfg["n_head"], cfg["d_head"], cfg["vocab_size"]
    n_clusters = len(cfg.get("cutoffs", [])) + 1
    total = cfg["n_layer"] * layer_count(d, h, dh, cfg["d_inner"])
    total += v * d  # embedding, tied with the softmax weight
    total += v  # softmax bias
    total += (n_clusters - 1) * d + (n_clusters - 1)  # cluster head weight and bias
    total += 2 * h * dh  # u and v, shared across layers
    return total


def test_hand_count_formula_itself():
    # Guard the reference: enwik8 base worked out by hand.
    per_layer = 5 * 512 * 512 + 2048 + (512 * 2048 + 2048 + 2048 * 512 + 512)
    assert per_layer == 3_412_480
    assert xl_count(ENWIK8_BASE) == 12 * per_layer + 204 * 512 + 204 + 2 * 512 == 41_055_436


def test_transformer_xl_enwik8_base_has_41m_parameters():
    n = meta_count(mechanism="xl", **ENWIK8_BASE)
    assert round(n / 1e6) == 41
    assert abs(n - xl_count(ENWIK8_BASE)) <= 0.005 * xl_count(ENWIK8_BASE)
    assert n == xl_count(ENWIK8_BASE)


def test_transformer_xl_wikitext103_base_has_151m_parameters():
    n = meta_count(mechanism="xl", **WT103_BASE)
    assert round(n / 1e6) == 151
    assert abs(n - xl_count(WT103_BASE)) <= 0.005 * xl_count(WT103_BASE)
    assert n == xl_count(WT103_BASE) == 151_107_538


def test_untied_softmax_doubles_the_vocabulary_matrix():
    # The count above relies on tying: without it the softmax has its own [V, d] weight.
    tied = meta_count(mechanism="xl", **ENWIK8_BASE)
    untied = meta_count(mechanism="xl", **{**ENWIK8_BASE, "tie_weight": False})
    assert untied - tied == 204 * 512


def test_lamemo_wikitext103_base_is_xl_plus_v_minus():
    xl = meta_count(mechanism="xl", **WT103_BASE)
    n = meta_count(mechanism="lamemo", **WT103_BASE)
    assert round(n / 1e6) == 151
    assert n - xl == 10 * 41  # v− (Eq. 12): the only parameter LaMemo adds


@pytest.mark.parametrize("mem_len", [0, 150])
@pytest.mark.parametrize("num_mem_tokens", [1, 10])
def test_rmt_adds_exactly_the_learnable_initial_memory(num_mem_tokens, mem_len):
    shape = {**WT103_BASE, "mem_len": mem_len}
    xl = meta_count(mechanism="xl", **shape)
    n = meta_count(mechanism="rmt", rmt={"num_mem_tokens": num_mem_tokens}, **shape)
    assert n - xl == num_mem_tokens * 410


@pytest.mark.parametrize("mechanism", ["xl", "lamemo", "rmt", "armt"])
def test_meta_count_equals_real_count_on_a_small_model(mechanism):
    # The meta-device build must not change the parameter set.
    cfg = dict(mechanism=mechanism, vocab_size=300, cutoffs=[50, 100], n_layer=2, d_model=32,
               n_head=4, d_inner=64, tgt_len=4, mem_len=4, tie_projs=[False, True, True],
               rmt={"num_mem_tokens": 3}, armt={"d_key": 8})
    real = build_model(ModelConfig(**cfg)).num_params()
    assert meta_count(**cfg) == real
    # ARMT per layer: W_q, W_k (d x d_key), W_v (d x d), the gate (d + 1); and RMT's memory.
    armt = 2 * (2 * 32 * 8 + 32 * 32 + 32 + 1) + 3 * 32
    extra = {"xl": 0, "lamemo": 4 * 8, "rmt": 3 * 32, "armt": armt}[mechanism]
    assert real == xl_count({**cfg, "d_head": 8}) + extra
