"""RMT's `paper` attention pattern around a pretrained decoder, against a reference written
from the pattern's definition (Bulatov et al. 2022, §3; model/pretrained/positions.py):
rows [read | tokens | write]; every row reads the read block, tokens are causal among
themselves, the write rows see the read block, every token and the whole write block; the
read rows at positions 0..m-1, the tokens at m..m+L-1, the write rows at m+T..m+T+m-1 with
T = max(L, tgt_len). The reference builds the mask and the positions cell by cell, runs the
base model's decoder on [mem; E(x); mem] with them, and takes the token rows' log-probs and
the write rows as the next memory; the wrapper must give the same, segment after segment
(a shift of the write rows or of a mask cell changes both)."""

import pytest
import torch
from pretrained_helpers import TINY, V, hf_model_section
from reference import rmt_paper_pattern

from model import ModelConfig, build_model
from model.pretrained.logits import lm_logits

M, L = 3, 5


def _positions(m: int, n: int, tgt_len: int) -> torch.Tensor:
    t = max(n, tgt_len)
    return torch.tensor([i for i in range(m + n)] + [m + t + k for k in range(m)])[None]


def _reference(model, tokens, memory):
    """(token rows' log-probs [B, n, V], the write rows [B, m, d]) of one segment read on
    `memory` [B, m, d]."""
    base = model.base
    bsz, n = tokens.shape
    x = torch.cat([memory, base.get_input_embeddings()(tokens), memory], dim=1)
    mask = rmt_paper_pattern(M, n)[None, None]
    h = base.base_model(inputs_embeds=x, attention_mask=mask,
                        position_ids=_positions(M, n, L).expand(bsz, -1), use_cache=False)[0]
    logp = torch.log_softmax(lm_logits(base, h[:, M:M + n]).float(), dim=-1)
    return logp, h[:, M + n:]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {arch: TINY[arch](root / arch) for arch in ("gpt2", "llama")}


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_paper_pattern_outputs_and_next_memory_equal_the_reference_from_its_definition(
        checkpoints, arch):
    section = hf_model_section(checkpoints[arch], M, L)
    section["rmt"]["pattern"] = "paper"
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_dict(section)).eval()
    x = torch.randint(0, V, (2, 3 * L - 1), generator=torch.Generator().manual_seed(3))
    state, memory = None, model.memory_init().detach()[None].expand(2, -1, -1)
    with torch.no_grad():
        # three segments, the last one shorter than tgt_len (the write rows keep their places)
        for seg in (x[:, :L], x[:, L:2 * L], x[:, 2 * L:]):
            out = model(seg, state, return_log_probs=True)
            ref_logp, ref_write = _reference(model, seg, memory)
            torch.testing.assert_close(out.log_probs, ref_logp, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(out.state.tokens, ref_write, rtol=1e-5, atol=1e-6)
            state, memory = out.state, ref_write


def test_the_reference_mask_is_not_the_causal_one():
    """The check can fail: the pattern differs from a causal mask over the same rows."""
    allowed = rmt_paper_pattern(M, L)
    assert not torch.equal(allowed, torch.ones_like(allowed).tril())
    assert allowed[0, M - 1] and not allowed[M, M + 1] and allowed[M + L, 2 * M + L - 1]
