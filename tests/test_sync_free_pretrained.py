"""Host synchronisations around a pretrained decoder, counted as tests/test_sync_free.py
counts them (every `item`/`bool`/`nonzero`/... of a tensor stands for the sync it would be
on a GPU): none in the forward and backward of a BPTT window of RMT, ARMT or Titans, with
segment checkpointing, SDPA or the eager kernel, GPT-2 or Llama. What made one per forward
was transformers' mask code reading the all-ones padding mask (or, without it, the position
ids); model/pretrained/positions.py `causal_attention` gives the same attention without
the read. Its attention is checked here to be bit for bit the all-ones mask's."""

from __future__ import annotations

import pytest
import torch
from pretrained_helpers import hf_model_section, tiny_gpt2, tiny_llama
from test_sync_free import counting_syncs

from data_pipeline.streams import SegmentBatch
from model import ModelConfig, build_model
from model.pretrained.positions import SDPA_CAUSAL, armt_position_ids, causal_attention
from train.bptt import run_window

MECHANISMS = {
    "rmt": {},
    "rmt-causal": {"mechanism": "rmt", "rmt": {"num_mem_tokens": 3, "pattern": "causal"}},
    "armt": {"mechanism": "armt", "armt": {"d_key": 8}},
    "titans": {"mechanism": "titans",
               "titans": {"d_mem": 8, "chunk_size": 2, "num_persistent": 2}},
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {"gpt2": tiny_gpt2(root / "gpt2", tied=False), "llama": tiny_llama(root / "llama")}


def model(path, mechanism: str, attn: str = "sdpa", **extra):
    sec = hf_model_section(path, 3, 8, attn_implementation=attn)
    sec.update(MECHANISMS[mechanism], **extra)
    torch.manual_seed(0)
    return build_model(ModelConfig.from_dict(sec)).train()


def window_syncs(lm, checkpoint: bool) -> dict:
    g = torch.Generator().manual_seed(0)
    segs = [SegmentBatch(torch.randint(0, 30, (2, 9), generator=g),
                         torch.zeros(2, dtype=torch.bool), None, 0, j) for j in range(4)]
    with counting_syncs() as counts:
        res = run_window(lm, None, segs, torch.device("cpu"), checkpoint_segments=checkpoint)
        res.loss.backward()
    return dict(counts)


@pytest.mark.parametrize("mechanism", list(MECHANISMS))
@pytest.mark.parametrize("arch,attn", [("gpt2", "sdpa"), ("llama", "sdpa"), ("gpt2", "eager")])
def test_a_pretrained_window_forward_and_backward_make_no_host_sync(ckpt, mechanism, arch,
                                                                    attn):
    assert window_syncs(model(ckpt[arch], mechanism, attn), checkpoint=True) == {}


@pytest.mark.parametrize("mechanism", ["armt", "titans"])
def test_layer_checkpointing_re_runs_the_layers_without_a_sync(ckpt, mechanism):
    """The layers re-run in backward outside `causal_attention` (under "sdpa" again): the
    same call with no mask, still no read."""
    lm = model(ckpt["llama"], mechanism, checkpoint_layers=True)
    assert window_syncs(lm, checkpoint=False) == {}


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_causal_attention_is_the_all_ones_padding_masks_attention_bit_for_bit(ckpt, arch, attn):
    """Positions that jump (ARMT's fixed memory placement) and positions that repeat
    (Titans' h_i, x_i): the hidden states equal those of the all-ones 2-D mask exactly."""
    lm = model(ckpt[arch], "armt", attn)
    base = lm.base.base_model
    x = torch.randn(2, 9, lm.cfg.d_model)
    jump = armt_position_ids(3, 6, 8)
    repeat = torch.cat([torch.arange(2), torch.arange(2, 5).repeat_interleave(2),
                        torch.tensor([5])])[None]
    for positions in (jump, repeat):
        ones = torch.ones(2, 9, dtype=torch.long)
        want = base(inputs_embeds=x, attention_mask=ones, position_ids=positions.expand(2, -1),
                    use_cache=False)[0]
        with causal_attention(lm.base, 9, x.dtype) as mask:
            got = base(inputs_embeds=x, attention_mask=mask,
                       position_ids=positions.expand(2, -1), use_cache=False)[0]
        assert torch.equal(got, want)
    assert lm.base.config._attn_implementation == attn


def test_the_attention_implementation_is_restored_when_the_forward_raises(ckpt):
    lm = model(ckpt["gpt2"], "armt")
    with pytest.raises(RuntimeError, match="inside"), causal_attention(lm.base, 4, torch.float32):
        assert lm.base.config._attn_implementation == SDPA_CAUSAL
        raise RuntimeError("inside")
    assert lm.base.config._attn_implementation == "sdpa"
