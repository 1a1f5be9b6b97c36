"""Cached generation (model/open_segment.py, model/pretrained/incremental.py): a pretrained
backbone reads the open segment through the base model's KV cache, one new row per token,
and computes the last position's logits only; the memory is committed at segment
boundaries by the forward's own pass. The property: greedy generation gives the same
tokens, and the same last-position log-probs at every step, as the re-run algorithm that
came before the cache (`rerun_reference`, kept here as the reference), across several
segment boundaries from a prompt longer than a segment, for GPT-2 and Llama, RMT in both
attention patterns, ARMT and no memory. The native models keep their re-run path and give
the reference's tokens too; the evaluation wrappers keep the cached path."""

from __future__ import annotations

import pytest
import torch
from pretrained_helpers import TINY, V, hf_model_section
from reference import sharpened_model

from evaluation.babilong import generate_answers
from evaluation.generation import DataIds
from evaluation.lm_eval_model import FreshMemory
from model import ModelConfig, build_model, stream_generate
from model.pretrained.incremental import CachedSegment

ARCHS = ("gpt2", "llama")
SETUPS = ("rmt-paper", "rmt-causal", "armt", "no-memory")
M, SEG = 3, 8
PROMPT, NEW = 13, 27     # the prompt spans 1 5/8 segments; generation crosses 3 boundaries
ATOL = 1e-5


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {arch: TINY[arch](root / arch) for arch in ARCHS}


def _model(path, setup: str, attn: str = "sdpa"):
    torch.manual_seed(0)
    section = hf_model_section(path, 0 if setup == "no-memory" else M, SEG,
                               attn_implementation=attn)
    if setup.startswith("rmt"):
        section["rmt"]["pattern"] = setup.split("-")[1]
    if setup == "armt":
        section = {**section, "mechanism": "armt", "armt": {"d_key": 8}}
    model = build_model(ModelConfig.from_dict(section)).eval()
    if setup == "armt":
        with torch.no_grad():   # W_v = 0 at initialisation: every read would be 0
            for block in model.associative:
                block.v_proj.weight.normal_(0, 0.3)
    return model


def _prompt(rows: int = 2, length: int = PROMPT, vocab: int = V, seed: int = 1):
    return torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def rerun_reference(model, prompt, n_new: int, seg_len: int, state=None):
    """Greedy generation as model/generate.py did it before the cache: the prompt's whole
    segments committed by the forward, then for every new token the whole open segment
    re-run on the committed memory with [B, L, V] log-probs, the last row kept; a full
    segment's forward state becomes the memory. -> (tokens [B, n_new], [log-probs [B, V]])."""
    state = state if state is not None else model.initial_state(prompt.shape[0])
    n_full = (prompt.shape[1] - 1) // seg_len
    for s in range(n_full):
        state = model(prompt[:, s * seg_len:(s + 1) * seg_len], state).state
    open_seg, tokens, log_probs = prompt[:, n_full * seg_len:], [], []
    for _ in range(n_new):
        out = model(open_seg, state, return_log_probs=True)
        lp = out.log_probs[:, -1]
        nxt = lp.argmax(-1, keepdim=True)
        tokens.append(nxt)
        log_probs.append(lp)
        if open_seg.shape[1] == seg_len:
            state, open_seg = out.state, nxt
        else:
            open_seg = torch.cat([open_seg, nxt], dim=1)
    return torch.cat(tokens, dim=1), log_probs


class Recorded(torch.nn.Module):
    """`model` whose open segments record every prediction (the log-probs generation
    samples from), and which open segment class served them."""

    def __init__(self, model):
        super().__init__()
        self.model, self.cfg = model, model.cfg
        self.log_probs, self.kinds = [], set()

    def initial_state(self, batch_size, device=None):
        return self.model.initial_state(batch_size, device)

    def forward(self, tokens, state=None, **kwargs):
        return self.model(tokens, state, **kwargs)

    def open_segment(self, state):
        seg, record = self.model.open_segment(state), self

        class Segment:
            def read(self, tokens):
                seg.read(tokens)

            def predict(self, tokens):
                lp = seg.predict(tokens)
                record.log_probs.append(lp)
                return lp

            def commit(self):
                return seg.commit()

        self.kinds.add(type(seg))
        return Segment()


def _greedy(model, prompt, n_new=NEW, **kw):
    return torch.stack(list(stream_generate(model, prompt, n_new, top_k=1, seg_len=SEG,
                                            **kw)), dim=1)


def _assert_same(got, got_lps, want, want_lps):
    assert torch.equal(got, want)
    assert len(got_lps) == len(want_lps)
    for step, (a, b) in enumerate(zip(got_lps, want_lps, strict=True)):
        assert a.shape == b.shape and a.dtype == torch.float32, step
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0, msg=f"step {step}")


# --------------------------------------------------------------------------- pretrained
@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("arch", ARCHS)
def test_cached_greedy_tokens_and_log_probs_equal_the_rerun_reference(ckpt, arch, setup):
    model = _model(ckpt[arch], setup)
    prompt = _prompt()
    rec = Recorded(model)
    got = _greedy(rec, prompt)
    assert rec.kinds == {CachedSegment}
    _assert_same(got, rec.log_probs, *rerun_reference(model, prompt, NEW, SEG))


@pytest.mark.parametrize("arch", ARCHS)
def test_cached_generation_equals_the_reference_with_the_eager_kernel(ckpt, arch):
    # The read block is prefilled with the pattern's additive mask (the eager kernel's).
    model = _model(ckpt[arch], "rmt-paper", attn="eager")
    prompt = _prompt()
    rec = Recorded(model)
    _assert_same(_greedy(rec, prompt), rec.log_probs, *rerun_reference(model, prompt, NEW, SEG))


@pytest.mark.parametrize("setup", ["rmt-paper", "armt"])
def test_cached_generation_from_a_carried_state_with_one_row_reset(ckpt, setup):
    """Rows of one batch on different memories: one carries a segment read before, the
    other starts a document (a fresh row)."""
    model = _model(ckpt["llama"], setup)
    with torch.no_grad():
        state = model(_prompt(length=SEG, seed=5), model.initial_state(2)).state
    state = state.reset_rows(torch.tensor([False, True]))
    prompt = _prompt(length=2 * SEG, seed=6)     # whole segments: the open one is full
    rec = Recorded(model)
    got = _greedy(rec, prompt, state=state)
    _assert_same(got, rec.log_probs, *rerun_reference(model, prompt, NEW, SEG, state=state))


@pytest.mark.parametrize("setup", ["rmt-paper", "armt"])
def test_each_new_token_runs_one_decoder_row_and_one_head_row(ckpt, setup):
    """What reaches the decoder per call, and the head: a whole segment per commit (the
    forward's pass, 2m + L rows for RMT, L + m for ARMT, no head), the read block once per
    open segment (RMT), then the prompt's open part, then one row per new token; the head
    sees one position per row per prediction."""
    model = _model(ckpt["gpt2"], setup)
    rows, head_rows = [], []
    hooks = [model.base.base_model.register_forward_pre_hook(
                 lambda mod, args, kw: rows.append(kw["inputs_embeds"].shape[1]),
                 with_kwargs=True),
             model.base.get_output_embeddings().register_forward_pre_hook(
                 lambda mod, args: head_rows.append(tuple(args[0].shape[:-1])))]
    try:
        _greedy(model, _prompt(), n_new=20)
    finally:
        for h in hooks:
            h.remove()
    segment, read = (2 * M + SEG, [M]) if setup == "rmt-paper" else (SEG + M, [])
    open_part = PROMPT - SEG                     # 5 tokens open after the prompt
    # tokens 13..15 fill the open segment, then 8 per segment: commits after 16 and 24
    want = [segment, *read, open_part, 1, 1, 1,
            segment, *read, *[1] * 8, segment, *read, *[1] * 8]
    assert rows == want
    assert head_rows == [(2,)] * 20


@pytest.mark.parametrize("setup", ["rmt-paper", "rmt-causal", "armt"])
def test_the_committed_memory_is_the_forward_state_of_the_segment(ckpt, setup):
    model = _model(ckpt["llama"], setup)
    tokens = _prompt(length=SEG, seed=3)
    state = model.initial_state(2)
    with torch.no_grad():
        seg = model.open_segment(state)
        seg.predict(tokens[:, :3])
        for i in range(3, SEG):
            seg.predict(tokens[:, i:i + 1])
        got, want = seg.commit(), model(tokens, state).state
    for name in ("tokens", "A", "z", "writes", "fresh"):
        a, b = getattr(got, name, None), getattr(want, name, None)
        assert (a is None) == (b is None), name
        if a is not None:
            assert torch.equal(a, b), name


# --------------------------------------------------------------------------- native stack
@pytest.mark.parametrize("mechanism,mem_len", [("xl", 6), ("lamemo", 6), ("rmt", 0),
                                               ("rmt", 6), ("armt", 0)])
def test_native_models_generate_the_rerun_reference(mechanism, mem_len):
    model = sharpened_model(mechanism, mem_len, vocab=50, seg=SEG)
    prompt = _prompt(vocab=50)
    rec = Recorded(model)
    _assert_same(_greedy(rec, prompt), rec.log_probs, *rerun_reference(model, prompt, NEW, SEG))


# --------------------------------------------------------------------------- evaluation
def test_data_ids_keep_the_cached_path_and_sample_only_the_data_ids(ckpt):
    """`memtrain generate`, `eval --babilong` and the lm-eval adapter read a pretrained
    model through DataIds when the data have fewer ids than the model."""
    model = _model(ckpt["llama"], "rmt-paper")
    n_ids = 20
    prompt = _prompt(vocab=n_ids)
    rec = Recorded(DataIds(model, n_ids))
    got = _greedy(rec, prompt)
    want, want_lps = rerun_reference(DataIds(model, n_ids), prompt, NEW, SEG)
    _assert_same(got, rec.log_probs, want, want_lps)
    assert bool((got < n_ids).all())
    assert all(bool(torch.isinf(lp[:, n_ids:]).all()) for lp in rec.log_probs)
    # The wrapper's open segment is the model's cached one, masked.
    assert isinstance(DataIds(model, n_ids).open_segment(model.initial_state(2)).segment,
                      CachedSegment)


def test_fresh_memory_generates_with_every_segment_on_a_fresh_memory(ckpt):
    """lm-eval's memory=reset: the open segment is read on a fresh memory, whatever the
    committed one."""
    model = _model(ckpt["gpt2"], "rmt-paper")
    prompt = _prompt()
    rec = Recorded(FreshMemory(model))
    got = _greedy(rec, prompt)
    _assert_same(got, rec.log_probs, *rerun_reference(FreshMemory(model), prompt, NEW, SEG))
    assert rec.kinds == {CachedSegment}


def test_babilong_answers_are_generated_through_the_cache(ckpt):
    model = _model(ckpt["llama"], "armt")
    prompt = _prompt(length=3 * SEG + 2)
    rows = []
    hook = model.base.base_model.register_forward_pre_hook(
        lambda mod, args, kw: rows.append(kw["inputs_embeds"].shape[1]), with_kwargs=True)
    try:
        got = generate_answers(model, prompt, 4, SEG)
    finally:
        hook.remove()
    assert torch.equal(got, rerun_reference(model, prompt, 4, SEG)[0])
    assert rows == [SEG + M] * 3 + [2, 1, 1, 1]
