"""Data in a pretrained model's own tokenizer (`--tokenizer hf:<checkpoint>`) and the
trainer's refusal of data from any other vocabulary (docs/pretrained_data_notes.md).

Tokenizers are built offline with `tokenizers` and saved next to the tiny checkpoints of
pretrained_helpers (never a download): a character-level one in the SentencePiece style
(a "▁" prepended to the start of every text, so a corpus cut into pieces must not look like a
new start there) and a byte-level BPE in the GPT-2 style.
"""

from __future__ import annotations

import numpy as np
import pytest
from pretrained_helpers import V, hf_model_section, tiny_gpt2

from data_pipeline import bpe
from data_pipeline.hf_tokenizer import HFVocab
from data_pipeline.prepare import main_prepare, main_tasks
from data_pipeline.shards import iter_chunks, load_manifest, read_episodes
from data_pipeline.tasks import generate, make_task, render, split_seed
from model import ConfigError

# 13 letters, the digits, the copy task's '_' and '>', '.', ' ' (as "▁") and the line end,
# with <unk> and <eos>: 30 tokens next to a 32-row embedding.
ALPHABET = list("acdehilmnorst0123456789_>.\n")
# Three paragraphs (one per split where a test needs files), each starting with a letter: a
# SentencePiece-style decoder drops the space it reads at the start of a text.
TEXT = ("the cat sat on the mat.\nit is a red hat\n\nsee the 3 rats at 10.\n  so it ends\n\n"
        "more lines than one 24 5\n")


def char_tokenizer(path, alphabet=ALPHABET):
    """A character tokenizer whose ids follow `alphabet` (another order: another vocabulary
    of the same size), with a Metaspace "▁" prepended to the first word of every text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<unk>", "<eos>", "▁", *alphabet])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Metaspace(prepend_scheme="first")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                            eos_token="<eos>").save_pretrained(path)
    return path


def byte_bpe_tokenizer(path):
    """GPT-2 style: byte-level pre-tokenization, BPE merges learnt from a few lines."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT] * 3, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The tiny GPT-2 (32 embedding rows) with the 30-token character tokenizer saved next
    to it, as `save_pretrained` leaves a real checkpoint."""
    path = tiny_gpt2(tmp_path_factory.mktemp("gpt2") / "ckpt")
    return char_tokenizer(path)


def prepare_text(tmp_path, tokenizer, name="data", text=TEXT):
    (tmp_path / "corpus.txt").write_text(text)
    out = tmp_path / name
    assert main_prepare(["--corpus", "text", "--train", str(tmp_path / "corpus.txt"),
                         "--tokenizer", tokenizer, "--out", str(out), "--quiet"]) == 0
    return load_manifest(out)


def split_ids(manifest, split):
    return np.concatenate([ids for _, ids in iter_chunks(manifest, split)])


# ----------------------------------------------------------------------------- prepare
def test_prepare_records_the_tokenizer_by_name_size_and_token_map(ckpt, tmp_path):
    m = prepare_text(tmp_path, f"hf:{ckpt}")
    vocab = HFVocab.load(str(ckpt))
    assert m.vocab["kind"] == "hf" and m.vocab["name"] == str(ckpt.resolve())
    assert m.vocab["size"] == m.vocab_size == len(ALPHABET) + 3 == vocab.size
    assert m.vocab_fingerprint == vocab.fingerprint()
    assert m.extra["max_id"] == max(int(split_ids(m, s).max()) for s in m.splits)


def test_prepared_ids_decode_back_to_each_split_file(ckpt, tmp_path):
    files = dict(zip(("train", "valid", "test"), TEXT.split("\n\n"), strict=True))
    args = []
    for split, text in files.items():
        (tmp_path / f"{split}.txt").write_text(text)
        args += [f"--{split}", str(tmp_path / f"{split}.txt")]
    assert main_prepare([*args, "--corpus", "text", "--tokenizer", f"hf:{ckpt}",
                         "--out", str(tmp_path / "data"), "--quiet"]) == 0
    m, vocab = load_manifest(tmp_path / "data"), HFVocab.load(str(ckpt))
    assert {s: vocab.decode(split_ids(m, s)) for s in files} == files


def test_same_size_tokenizers_with_one_token_moved_have_different_fingerprints(tmp_path):
    moved = ALPHABET[1:2] + ALPHABET[:1] + ALPHABET[2:]
    a = HFVocab.load(str(char_tokenizer(tmp_path / "a")))
    b = HFVocab.load(str(char_tokenizer(tmp_path / "b", moved)))
    copy = HFVocab.load(str(char_tokenizer(tmp_path / "copy")))
    assert a.size == b.size and a.fingerprint() != b.fingerprint()
    assert a.fingerprint() == copy.fingerprint()  # where it was loaded from does not count


@pytest.mark.parametrize("make", [char_tokenizer, byte_bpe_tokenizer])
def test_a_corpus_streamed_in_any_chunks_gets_the_ids_of_the_whole_text(make, tmp_path,
                                                                         monkeypatch):
    vocab = HFVocab.load(str(make(tmp_path / "tok")))
    text = TEXT * 5
    whole = vocab.tokenizer(text, add_special_tokens=False)["input_ids"]
    monkeypatch.setattr(bpe, "_BPE_PIECE_CHARS", 7)  # a cut at nearly every safe line end
    raw = text.encode()
    chunks = [raw[i:i + 13] for i in range(0, len(raw), 13)]
    streamed = np.concatenate(list(vocab.encode_stream(chunks)))
    assert streamed.tolist() == whole == vocab.encode(text).tolist()
    assert vocab.decode(streamed) == text


def test_a_checkpoint_without_tokenizer_files_is_refused_by_name(tmp_path):
    bare = tiny_gpt2(tmp_path / "bare")
    with pytest.raises(ValueError, match=f"{bare}.* has no tokenizer"):
        HFVocab.load(str(bare))


def test_prepare_cli_names_a_missing_checkpoint_and_a_corpus_without_hf(tmp_path, capsys):
    (tmp_path / "c.txt").write_text(TEXT)
    assert main_prepare(["--corpus", "text", "--train", str(tmp_path / "c.txt"),
                         "--tokenizer", f"hf:{tmp_path}/absent", "--out", str(tmp_path / "o"),
                         "--quiet"]) == 2
    assert f"{tmp_path}/absent is not a directory" in capsys.readouterr().err
    assert main_prepare(["--corpus", "enwik8", "--tokenizer", "hf:x", "--out",
                         str(tmp_path / "o")]) == 2
    assert "enwik8: unknown tokenizer 'hf:x'" in capsys.readouterr().err


# ----------------------------------------------------------------------------- tasks
def test_task_symbols_become_the_models_single_tokens_of_their_characters(ckpt, tmp_path):
    out = tmp_path / "copy"
    assert main_tasks(["copy", "--src-len", "4", "--n-segments", "2", "--train-size", "20",
                       "--valid-size", "4", "--test-size", "4", "--seed", "3",
                       "--tokenizer", f"hf:{ckpt}", "--out", str(out)]) == 0
    m = load_manifest(out)
    vocab = HFVocab.load(str(ckpt))
    assert m.vocab["kind"] == "hf" and m.vocab_fingerprint == vocab.fingerprint()
    assert m.vocab["task_symbols"] == {c: vocab.tokenizer.convert_tokens_to_ids(c)
                                       for c in "_>23456789"}
    spec = make_task("copy", src_len=4, n_segments=2)
    native = generate(spec, 20, split_seed(3, "train"))
    tokens, loss, answer = read_episodes(m, "train")
    for row, ids in zip(native.tokens, tokens, strict=True):
        assert vocab.decode(ids) == render(spec, row)   # e.g. "3527>35273527"
    assert (loss == native.loss_mask).all() and (answer == native.answer_mask).all()
    assert m.extra["max_id"] == int(tokens.max()) < V


def test_a_tokenizer_lacking_a_task_symbol_is_refused_naming_the_symbol(tmp_path, capsys):
    tok = char_tokenizer(tmp_path / "tok", [c for c in ALPHABET if c != ">"])
    assert main_tasks(["copy", "--src-len", "4", "--train-size", "2", "--valid-size", "2",
                       "--test-size", "2", "--tokenizer", f"hf:{tok}",
                       "--out", str(tmp_path / "o")]) == 2
    assert "no single token that reads as the task symbol '>'" in capsys.readouterr().err


# ----------------------------------------------------------------------------- training
def run_config(tmp_path, ckpt, data):
    from train.config import from_dict

    return from_dict({"name": "hf", "run_dir": str(tmp_path / "runs" / "hf"), "threads": 1,
                      "model": hf_model_section(ckpt, m=2, tgt_len=4),
                      "data": {"path": str(data), "global_batch": 2}})


def test_training_refuses_data_of_a_same_size_tokenizer_naming_both(ckpt, tmp_path):
    from train.trainer import open_data

    other = char_tokenizer(tmp_path / "other", ALPHABET[::-1])
    m = prepare_text(tmp_path, f"hf:{other}")
    with pytest.raises(ConfigError) as err:
        open_data(run_config(tmp_path, ckpt, m.location), 0)
    assert err.value.field == "data.path"
    assert str(other.resolve()) in str(err.value) and str(ckpt) in str(err.value)
    assert f"--tokenizer hf:{ckpt}" in str(err.value)


def test_training_refuses_text_in_memtrains_own_vocabulary(ckpt, tmp_path):
    from train.trainer import open_data

    m = prepare_text(tmp_path, "bytes")
    with pytest.raises(ConfigError, match="memtrain's 'bytes' vocabulary") as err:
        open_data(run_config(tmp_path, ckpt, m.location), 0)
    assert err.value.field == "data.path"


def test_training_refuses_ids_past_the_embedding_even_from_the_models_tokenizer(tmp_path):
    from train.trainer import open_data

    big = char_tokenizer(tiny_gpt2(tmp_path / "big"), ALPHABET + list("bfgkpquvwxy"))
    m = prepare_text(tmp_path, f"hf:{big}", text=TEXT + "fix the wavy quip\n" * 3)
    assert m.vocab_size > V and m.extra["max_id"] >= V
    with pytest.raises(ConfigError, match=f"ids up to {m.extra['max_id']}.* {V} rows") as err:
        open_data(run_config(tmp_path, big, m.location), 0)
    assert err.value.field == "data.path"


def test_training_accepts_data_of_the_models_tokenizer_and_trains_on_it(ckpt, tmp_path,
                                                                       monkeypatch):
    from train_helpers import step_losses, train_in_process

    m = prepare_text(tmp_path, f"hf:{ckpt}", text=TEXT * 20)
    cfg = run_config(tmp_path, ckpt, m.location)
    cfg.max_steps, cfg.log_every, cfg.eval.every = 2, 1, 0
    cfg.tracking.enabled = False
    train_in_process(cfg, monkeypatch)
    losses = step_losses(tmp_path / "runs" / "hf")
    assert sorted(losses) == [1, 2] and all(np.isfinite(list(losses.values())))


def test_a_frozen_base_on_a_token_stream_is_warned_that_only_the_initial_memory_trains(
        ckpt, tmp_path, capsys):
    from train.trainer import open_data

    m = prepare_text(tmp_path, f"hf:{ckpt}")
    cfg = run_config(tmp_path, ckpt, m.location)
    open_data(cfg, 0)
    assert "frozen" not in capsys.readouterr().err
    cfg.model.hf.finetune = "frozen"
    open_data(cfg, 0)
    assert "frozen on a token stream trains only the initial memory" in capsys.readouterr().err
