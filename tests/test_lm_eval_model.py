"""evaluation/lm_eval_model.py: a memtrain model as lm-eval's "memtrain" model.

The key property: every request is scored exactly as a naive loop scores it, feeding the
whole sequence (context + continuation) segment by segment from a fresh memory and carrying
the memory; and that memory matters (the same request read with a fresh memory at every
segment scores differently). Models are built and exported here, not trained; the data
manifest only carries a character vocabulary. Nothing is downloaded.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from pretrained_helpers import hf_model_section, tiny_gpt2
from reference import sharpened_model

from data_pipeline.shard_writer import write_manifest
from data_pipeline.shards import Manifest, id_dtype
from data_pipeline.vocab import SymbolVocab
from evaluation.lm_eval_model import MemtrainLM
from model import ModelConfig, build_model
from model.io import save_model

SEG = 5
CHARS = "abcdefgh ?\n"
VOCAB = SymbolVocab.build_chars(CHARS)
NATIVE = {"xl": ("xl", 6), "rmt": ("rmt", 0), "lamemo": ("lamemo", 6)}


def write_char_manifest(folder, vocab) -> str:
    d = vocab.to_dict()
    write_manifest(folder, Manifest(kind="tokens", source="chars", vocab=d,
                                    vocab_fingerprint=vocab.fingerprint(), vocab_size=vocab.size,
                                    dtype=str(id_dtype(vocab.size)), chunk_tokens=64, splits={}))
    return str(folder)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """{setup: (exported .safetensors, data folder, the model itself)}."""
    tmp = tmp_path_factory.mktemp("lm_eval")
    tmp.joinpath("data").mkdir()
    data = write_char_manifest(tmp / "data", VOCAB)
    out = {}
    for name, (mechanism, mem_len) in NATIVE.items():
        model = sharpened_model(mechanism, mem_len, vocab=VOCAB.size, seg=SEG)
        out[name] = (str(save_model(model, tmp / f"{name}.safetensors")), data, model)
    # A pretrained backbone (GPT-2 family) with RMT memory tokens; its 64 embedding rows
    # exceed the 11 data ids, so the adapter reads it through generation.DataIds.
    ckpt = tiny_gpt2(tmp / "gpt2", vocab=64, n_positions=128)
    cfg = ModelConfig.from_dict({**hf_model_section(ckpt, m=3, tgt_len=SEG), "vocab_size": 64})
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    out["hf"] = (str(save_model(model, tmp / "hf.safetensors")), data, None)
    return out


def adapter(exported, setup: str, **kwargs) -> MemtrainLM:
    path, data, _ = exported[setup]
    return MemtrainLM(run_dir=path, data=data, device="cpu", **kwargs)


def req(*args):
    return SimpleNamespace(args=args)


def ids_of(text: str) -> list[int]:
    return [int(i) for i in VOCAB.encode(text)]


def random_text(n: int, seed: int, alphabet: str = "abcdefgh ") -> str:
    rng = np.random.default_rng(seed)
    return "".join(rng.choice(list(alphabet), n))


@torch.no_grad()
def naive_log_probs(model, ids: list[int], seg: int, carry: bool = True) -> torch.Tensor:
    """[len(ids), V] log-probabilities after each token: `ids` fed by hand as the inputs, one
    segment at a time from the first, the memory carried (or fresh every segment)."""
    x = torch.tensor([ids])
    state, rows = None, []
    for s in range(0, x.shape[1], seg):
        out = model(x[:, s:s + seg], state if carry else None, return_log_probs=True)
        rows.append(out.log_probs[0].float())
        state = out.state
    return torch.cat(rows)


def naive_token_scores(model, ids: list[int], seg: int, carry: bool = True) -> torch.Tensor:
    """[len(ids) - 1] log-probability of tokens 1.. as memtrain reads a stream: the inputs
    are every token but the last, the targets the tokens one ahead (a scored token is never
    an input of its own segment, as in training and in generation)."""
    lp = naive_log_probs(model, ids[:-1], seg, carry)
    return lp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def naive_score(model, context: str, continuation: str, seg: int, carry: bool = True):
    ctx, cont = ids_of(context), ids_of(continuation)
    lp = naive_log_probs(model, (ctx + cont)[:-1], seg, carry)[len(ctx) - 1:]
    target = torch.tensor(cont)
    return (float(lp.gather(-1, target[:, None]).sum()),
            bool((lp.argmax(-1) == target).all()))


def loaded_model(lm: MemtrainLM):
    return lm.model  # what the adapter reads with (DataIds around a pretrained backbone)


# Contexts spanning 1 to 6 segments; continuations crossing segment boundaries.
PAIRS = [(random_text(23, 1), " abc"), (random_text(9, 2), " hhgfe"), (random_text(30, 3), "d"),
         (random_text(4, 4), " ba"), (random_text(17, 5), " cab ")]


@pytest.mark.parametrize("setup", [*NATIVE, "hf"])
def test_loglikelihood_equals_feeding_the_sequence_segment_by_segment_by_hand(exported, setup):
    lm = adapter(exported, setup, batch_size=3)  # batches of mixed lengths
    got = lm.loglikelihood([req(c, x) for c, x in PAIRS])
    for (context, continuation), (log_p, greedy) in zip(PAIRS, got, strict=True):
        want_lp, want_greedy = naive_score(loaded_model(lm), context, continuation, SEG)
        assert log_p == pytest.approx(want_lp, abs=1e-4)
        assert greedy == want_greedy
        assert log_p < 0


def test_is_greedy_is_true_exactly_for_the_argmax_continuation(exported):
    lm = adapter(exported, "xl")
    context = random_text(13, 7, "abcdefgh")  # no trailing blank to move
    lp = naive_log_probs(loaded_model(lm), ids_of(context), SEG)
    best = VOCAB.decode([int(lp[-1].argmax())])
    other = VOCAB.decode([int(lp[-1].argmin())])
    (_, is_best), (_, is_other) = lm.loglikelihood([req(context, best), req(context, other)])
    assert is_best and not is_other


@pytest.mark.parametrize("setup", ["xl", "rmt"])
def test_the_adapter_carries_the_memory_a_fresh_memory_per_segment_scores_differently(
        exported, setup):
    context, continuation = random_text(24, 8), " abcd"
    carried = adapter(exported, setup).loglikelihood([req(context, continuation)])[0][0]
    reset_lm = adapter(exported, setup, memory="reset")
    reset = reset_lm.loglikelihood([req(context, continuation)])[0][0]
    model = loaded_model(reset_lm)
    assert reset == pytest.approx(naive_score(model, context, continuation, SEG, False)[0],
                                  abs=1e-4)
    assert carried == pytest.approx(naive_score(model, context, continuation, SEG)[0], abs=1e-4)
    assert abs(carried - reset) > 1e-2


def test_trailing_blanks_of_the_context_are_scored_with_the_continuation(exported):
    lm = adapter(exported, "xl")
    context = random_text(11, 9).rstrip() + "a"
    (moved, _), (as_given, _) = lm.loglikelihood([req(context + " ", "bc"),
                                                  req(context, " bc")])
    assert moved == pytest.approx(as_given, abs=1e-6)


@pytest.mark.parametrize("setup", ["xl", "rmt"])
def test_rolling_loglikelihood_scores_every_token_after_the_first(exported, setup):
    lm = adapter(exported, setup, batch_size=2)
    texts = [random_text(n, 20 + n) for n in (26, 7, 1, 12)]
    got = lm.loglikelihood_rolling([req(t) for t in texts])
    for text, value in zip(texts, got, strict=True):
        if len(text) > 1:
            want = float(naive_token_scores(loaded_model(lm), ids_of(text), SEG).sum())
            assert value == pytest.approx(want, abs=1e-4)
    assert got[2] == 0.0  # one token: nothing to predict it from


def test_a_prefix_token_is_read_first_so_the_first_token_is_scored_too(exported):
    prefix = int(VOCAB.encode("\n")[0])
    lm = adapter(exported, "xl", prefix_token_id=prefix)
    text = random_text(14, 30)
    rolling = lm.loglikelihood_rolling([req(text)])[0]
    # Same as a loglikelihood request with an empty context, and as the naive reading.
    assert lm.loglikelihood([req("", text)])[0][0] == pytest.approx(rolling, abs=1e-5)
    want = naive_token_scores(loaded_model(lm), [prefix, *ids_of(text)], SEG)
    assert rolling == pytest.approx(float(want.sum()), abs=1e-4)


def test_an_empty_context_without_a_prefix_token_is_refused_naming_the_option(exported):
    with pytest.raises(ValueError, match="prefix_token_id"):
        adapter(exported, "xl").loglikelihood([req("", "abc")])


@torch.no_grad()
def greedy_by_recomputation(model, ids: list[int], n_new: int, carry: bool = True) -> list[int]:
    seq = list(ids)
    for _ in range(n_new):
        seq.append(int(naive_log_probs(model, seq, SEG, carry)[-1].argmax()))
    return seq[len(ids):]


@pytest.mark.parametrize("setup", [*NATIVE, "hf"])
def test_generate_until_is_greedy_with_the_memory_carried_and_stops_at_until(exported, setup):
    lm = adapter(exported, setup, batch_size=2)
    prompts = [random_text(12, 40), random_text(12, 41), random_text(7, 42)]
    model = loaded_model(lm)
    free = [VOCAB.decode(greedy_by_recomputation(model, ids_of(p), 9))
            for p in prompts]
    # Stop at the first character of the 4th generated one: the text is cut before it.
    stop = free[0][3]
    got = lm.generate_until([req(p, {"until": [stop], "max_gen_toks": 9}) for p in prompts]
                            + [req(prompts[1], {"max_gen_toks": 9})])
    assert got[0] == free[0].split(stop)[0] and len(got[0]) <= 3
    for g, f in zip(got[1:3], free[1:3], strict=True):
        assert g == f.split(stop)[0]
    assert got[3] == free[1]  # no stop string: max_gen_toks tokens


def test_generation_with_a_fresh_memory_per_segment_follows_the_reset_reading(exported):
    lm = adapter(exported, "xl", memory="reset")
    prompt = random_text(12, 43)
    got = lm.generate_until([req(prompt, {"until": [], "max_gen_toks": 8})])[0]
    ids = ids_of(prompt)
    assert got == VOCAB.decode(greedy_by_recomputation(loaded_model(lm), ids, 8, False))
    carried = adapter(exported, "xl").generate_until([req(prompt, {"max_gen_toks": 8})])[0]
    assert got != carried


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback without CUDA")
def test_lm_evals_default_cuda_device_falls_back_to_the_cpu_without_cuda(exported):
    path, data, _ = exported["xl"]
    lm = MemtrainLM(run_dir=path, data=data, device="cuda:0")  # lm-eval's command line default
    assert lm.device == torch.device("cpu")
    assert next(lm.model.parameters()).device.type == "cpu"


def test_sampling_requests_are_refused(exported):
    with pytest.raises(ValueError, match="greedy"):
        adapter(exported, "xl").generate_until([req("ab", {"do_sample": True})])


def test_data_without_a_text_vocabulary_read_text_as_token_ids(exported, tmp_path):
    path, _, model = exported["xl"]
    synthetic = {"kind": "synthetic", "generator": "test", "size": VOCAB.size}
    write_manifest(tmp_path, Manifest(kind="tokens", source="ids", vocab=synthetic,
                                      vocab_fingerprint="x", vocab_size=VOCAB.size,
                                      dtype=str(id_dtype(VOCAB.size)), chunk_tokens=64,
                                      splits={}))
    lm = MemtrainLM(run_dir=path, data=str(tmp_path))
    context = random_text(13, 50)
    ids = [str(i) for i in ids_of(context)]
    as_ids = lm.loglikelihood([req(" ".join(ids[:-3]), " " + " ".join(ids[-3:]))])[0][0]
    as_text = adapter(exported, "xl").loglikelihood([req(context[:-3], context[-3:])])[0][0]
    assert as_ids == pytest.approx(as_text, abs=1e-6)
    out = lm.generate_until([req(" ".join(ids), {"max_gen_toks": 4})])[0]
    assert len(out.split()) == 4 and all(0 <= int(t) < VOCAB.size for t in out.split())


# ------------------------------------------------ a tokenizer's special tokens, as lm-eval's HF
def hf_data(tmp_path, **special) -> str:
    """A data folder whose vocabulary is a transformers tokenizer (tiny.py's characters)
    with the given special tokens, e.g. eos_token="<|endoftext|>"."""
    from transformers import AutoTokenizer

    from data_pipeline.hf_tokenizer import HFVocab
    from model.pretrained.tiny import save_char_tokenizer
    tok_dir = tmp_path / "tok"
    save_char_tokenizer(tok_dir)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    tok.add_special_tokens(special)
    tok.save_pretrained(tok_dir)
    (tmp_path / "data").mkdir()
    return write_char_manifest(tmp_path / "data", HFVocab.load(str(tok_dir)))


def test_generate_until_stops_at_the_tokenizers_eos_as_lm_evals_hf_model(
        exported, tmp_path, monkeypatch):
    import evaluation.lm_eval_model as adapter_module
    path, _, _ = exported["hf"]
    lm = MemtrainLM(run_dir=path, data=hf_data(tmp_path, eos_token="<|endoftext|>"),
                    device="cpu")
    eos = lm.vocab.tokenizer.eos_token_id
    scripted = [*lm.encode(" paris"), eos, *lm.encode(" junk 42")]

    def generate(model, prompt, n_new, **kwargs):   # the model's output, scripted
        for t in scripted[:n_new]:
            yield torch.full((prompt.shape[0],), t)
    monkeypatch.setattr(adapter_module, "stream_generate", generate)
    assert lm.decode(scripted) == " paris<|endoftext|> junk 42"
    got = lm.generate_until([req("where?", {"max_gen_toks": 20}),
                             req("where?", {"until": ["r"], "max_gen_toks": 20}),
                             req("where?", {"until": "<|endoftext|>", "max_gen_toks": 20})])
    assert got == [" paris", " pa", " paris"]


def test_the_prefix_token_defaults_to_the_tokenizers_bos_else_eos_as_lm_evals_hf_model(
        exported, tmp_path):
    path, _, _ = exported["hf"]
    both = MemtrainLM(run_dir=path, data=hf_data(tmp_path / "a", bos_token="<s>",
                                                 eos_token="</s>"), device="cpu")
    assert both.prefix_token_id == both.vocab.tokenizer.bos_token_id
    eos_only = MemtrainLM(run_dir=path, data=hf_data(tmp_path / "b", eos_token="</s>"),
                          device="cpu")
    assert eos_only.prefix_token_id == eos_only.vocab.tokenizer.eos_token_id
    # Rolling perplexity then scores the first token too, read after the prefix.
    text = random_text(9, 70)
    ids = eos_only.encode(text)
    want = naive_token_scores(loaded_model(eos_only), [eos_only.prefix_token_id, *ids], SEG)
    got = eos_only.loglikelihood_rolling([req(text)])[0]
    assert got == pytest.approx(float(want.sum()), abs=1e-4)
    # An explicit prefix still wins.
    chosen = MemtrainLM(run_dir=path, data=hf_data(tmp_path / "c", bos_token="<s>"),
                        device="cpu", prefix_token_id=3)
    assert chosen.prefix_token_id == 3


# --------------------------------------------------------------------------- lm-eval itself
GEN_TASK = """task: mt_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["?"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
"""
CHOICE_TASK = """task: mt_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
"""


def test_simple_evaluate_runs_local_tasks_and_reports_what_the_adapter_computes(
        exported, tmp_path, monkeypatch):
    import datasets.config
    import lm_eval
    for key in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(key, "1")
        monkeypatch.setattr(datasets.config, key, True)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    lm = adapter(exported, "xl")
    contexts = [random_text(14 + i, 60 + i) for i in range(4)]
    choices = ["abc", "bad", "hag"]
    # Targets and labels set from the adapter's own answers, one of four made wrong: the
    # metrics must come back as exactly 3/4.
    gens = lm.generate_until([req(c, {"until": ["?"], "max_gen_toks": 6}) for c in contexts])
    docs = []
    for i, (context, gen) in enumerate(zip(contexts, gens, strict=True)):
        scores = [s for s, _ in lm.loglikelihood([req(context, " " + c) for c in choices])]
        best = int(np.argmax(scores))
        docs.append({"context": context, "target": gen if i else gen + "x", "choices": choices,
                     "label": best if i != 2 else (best + 1) % len(choices)})
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "gen.yaml").write_text(GEN_TASK.format(data=data))
    (tasks / "choice.yaml").write_text(CHOICE_TASK.format(data=data))
    path, folder, _ = exported["xl"]
    out = lm_eval.simple_evaluate(
        model="memtrain", model_args=f"run_dir={path},data={folder},batch_size=2",
        tasks=["mt_gen", "mt_choice"], device="cpu",
        task_manager=lm_eval.tasks.TaskManager(include_path=str(tasks), include_defaults=False))
    assert out["results"]["mt_gen"]["exact_match,none"] == pytest.approx(0.75)
    assert out["results"]["mt_choice"]["acc,none"] == pytest.approx(0.75)
