"""The mechanics of benchmarks/smollm2_memory.py with a tiny Llama built from a config standing
in for SmolLM2 (the real model is never loaded here): the task's samples state the code only
in the first segment and ask for it at the start of the last, the no-memory arm may skip the
segments without answers because they change nothing for it, and a run trains both arms from
one base that it leaves untouched. Never timings."""

import numpy as np
import pytest
import torch
from pretrained_helpers import tiny_llama

from benchmarks.smollm2_memory import (
    CodeVocab,
    make_samples,
    model_config,
    parse_args,
    run,
    segments,
)
from model import build_model
from model.pretrained.loading import load_base
from train.bptt import run_window

# The task's pieces as ids of the tiny vocabulary (32): digits 2..11, filler 26..31.
VOCAB = CodeVocab(prefix=(20, 21, 22, 23, 24), period=25, digits=tuple(range(2, 12)),
                  filler=tuple(range(26, 32)))
S, L, D = 3, 8, 2


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return {"path": str(tiny_llama(tmp_path_factory.mktemp("hf") / "llama")), "gguf_file": ""}


def test_the_code_is_stated_only_in_the_first_segment_and_asked_at_the_start_of_the_last():
    tokens, mask = make_samples(VOCAB, 16, S, L, D, np.random.default_rng(0))
    assert tokens.shape == (16, S * L + 1) and mask.shape == (16, S * L)
    fact = list(VOCAB.prefix) + ["d"] * D + [VOCAB.period]
    digits = set(VOCAB.digits)
    for row, m in zip(tokens.tolist(), mask.tolist(), strict=True):
        code = row[L - 1 - D:L - 1]
        assert [t if t not in digits else "d" for t in row[L - len(fact):L]] == fact
        question = row[(S - 1) * L:]
        assert question[:len(VOCAB.prefix)] == list(VOCAB.prefix)
        # The loss is taken on the next-token targets that are the code's digits, and no
        # digit stands anywhere else after the first segment.
        assert [t for t, on in zip(row[1:], m, strict=True) if on] == code
        assert [t for t in row[L:] if t in digits] == code
    with pytest.raises(ValueError, match="--seg-len"):
        make_samples(VOCAB, 1, S, len(fact) - 1, D, np.random.default_rng(0))


def test_without_memory_the_segments_before_the_answer_change_nothing(hf):
    tokens, mask = make_samples(VOCAB, 4, S, L, D, np.random.default_rng(1))
    model = build_model(model_config(hf, 0, L, "full", 4)).eval()
    assert len(segments(tokens, mask, S, answer_only=True)) == 1
    with torch.no_grad():
        every = run_window(model, None, segments(tokens, mask, S), torch.device("cpu"))
        last = run_window(model, None, segments(tokens, mask, S, True), torch.device("cpu"))
    assert every.n_tokens == last.n_tokens == 4 * D
    assert torch.equal(every.nll_sum, last.nll_sum)


def test_a_run_trains_both_arms_from_one_base_and_leaves_the_base_untouched(hf):
    a = parse_args(["--segments", str(S), "--seg-len", str(L), "--digits", str(D),
                    "--mem-tokens", "2", "--steps", "2", "--batch", "2", "--test-size", "4",
                    "--eval-batch", "2", "--log-every", "1"])
    base = load_base(model_config(hf, 2, L, "lora", 4))
    before = {k: v.clone() for k, v in base.state_dict().items()}
    results = run(a, hf, base, VOCAB, torch.device("cpu"))
    assert list(results["arms"]) == ["base, last segment", "base, full context", "memory",
                                     "no memory"]
    for arm in results["arms"].values():
        assert 0 <= arm["digit_accuracy"] <= 1 and 0 <= arm["code_accuracy"] <= 1
        assert np.isfinite(arm["answer_loss"])
    mem, plain = results["arms"]["memory"], results["arms"]["no memory"]
    assert (mem["num_mem_tokens"], plain["num_mem_tokens"]) == (2, 0)
    assert mem["steps"] == plain["steps"] == 2 and len(mem["loss_curve"]) == 2
    # The memory arm trains its adapters and the initial memory (2 x d_model) besides.
    assert mem["trained_parameters"] == plain["trained_parameters"] + 2 * 64
    after = base.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
