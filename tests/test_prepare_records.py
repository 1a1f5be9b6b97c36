"""`memtrain prepare --corpus jsonl|parquet|datasets` (data_pipeline/records.py,
record_samples.py, prepare_records.py; docs/data-formats.md): rows as people hold them become
episodes the trainer reads, one per row, with the loss where the row's kind puts it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from data_pipeline.shards import iter_chunks, load_manifest, read_episodes
from data_pipeline.streams import EpisodeStream
from memtrain.cli import main

# Documents of several lengths, with what JSON must escape and what UTF-8 spells in 2-3 bytes.
DOCS = [f"doc {i}: " + "the cat sat on the mat. " * (i % 4 + 1) + ('"quoted"\n' if i % 3 == 0
        else "line\tend\n") + ("naïve café €" if i % 5 == 0 else "") for i in range(14)]
SPLIT_DOCS = {"train": DOCS[:10], "valid": DOCS[10:12], "test": DOCS[12:]}
SEG = 16


def _prepare(*argv) -> int:
    return main(["prepare", *map(str, argv), "--seg-len", str(SEG), "--quiet"])


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _write_parquet(path: Path, columns: dict) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path, row_group_size=3)  # several row groups per file
    return path


def _episodes(out: Path) -> dict:
    m = load_manifest(out)
    return {s: read_episodes(m, s) for s in ("train", "valid", "test")}


def _documents(tokens, loss):
    """Each episode's document ids: from position 0 to the last target with loss."""
    return [row[:int(mask.sum()) + 1] for row, mask in zip(tokens, loss, strict=True)]


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    """The tiny checkpoints' character tokenizer (model/pretrained/tiny.py), once plain and
    once with a chat template of characters it has (the tokenizer ships none)."""
    from transformers import AutoTokenizer

    from model.pretrained.tiny import save_char_tokenizer

    root = tmp_path_factory.mktemp("tok")
    save_char_tokenizer(root / "plain")
    tok = AutoTokenizer.from_pretrained(root / "plain")
    tok.chat_template = ("{% for m in messages %}{{ m['role'][0] }}: {{ m['content'] }}\n"
                         "{% endfor %}{% if add_generation_prompt %}a:{% endif %}")
    tok.save_pretrained(root / "chat")
    return root


def test_the_same_documents_as_text_files_jsonl_parquet_and_a_datasets_folder_give_the_same_ids_and_boundaries(tmp_path):  # noqa: E501
    import datasets

    text = {}
    for split, docs in SPLIT_DOCS.items():   # the text corpus: one file per document
        folder = tmp_path / "txt" / split
        folder.mkdir(parents=True)
        for i, doc in enumerate(docs):
            (folder / f"doc{i:03d}.txt").write_text(doc)
        text[split] = sorted(folder.iterdir())
    assert main(["prepare", "--corpus", "text", "--train", str(tmp_path / "txt/train/*.txt"),
                 "--valid", str(tmp_path / "txt/valid/*.txt"), "--test",
                 str(tmp_path / "txt/test/*.txt"), "--out", str(tmp_path / "text"),
                 "--quiet"]) == 0
    rows = {s: [{"text": d, "id": i} for i, d in enumerate(docs)]
            for s, docs in SPLIT_DOCS.items()}
    jl = {s: _write_jsonl(tmp_path / f"{s}.jsonl", r) for s, r in rows.items() if s != "train"}
    _write_jsonl(tmp_path / "train-1.jsonl", rows["train"][:6])   # train in two files, read
    _write_jsonl(tmp_path / "train-2.jsonl", rows["train"][6:])   # in sorted order
    assert _prepare("--corpus", "jsonl", "--train", tmp_path / "train-*.jsonl", "--valid",
                    jl["valid"], "--test", jl["test"], "--field", "text",
                    "--out", tmp_path / "jsonl") == 0
    (tmp_path / "pq").mkdir()
    for s, docs in SPLIT_DOCS.items():
        _write_parquet(tmp_path / "pq" / f"{s}.parquet", {"id": list(range(len(docs))),
                                                         "text": docs})
    assert _prepare("--corpus", "parquet", "--train", tmp_path / "pq/train.parquet",
                    "--valid", tmp_path / "pq/valid.parquet", "--test",
                    tmp_path / "pq/test.parquet", "--out", tmp_path / "parquet") == 0
    names = {"train": "train", "valid": "validation", "test": "test"}
    datasets.DatasetDict({names[s]: datasets.Dataset.from_dict({"text": d})
                          for s, d in SPLIT_DOCS.items()}).save_to_disk(tmp_path / "ds")
    assert _prepare("--corpus", "datasets", "--train", tmp_path / "ds",
                    "--out", tmp_path / "datasets") == 0   # valid, test: the dict's own

    got = {fmt: _episodes(tmp_path / fmt) for fmt in ("jsonl", "parquet", "datasets")}
    m_text = load_manifest(tmp_path / "text")
    for split in SPLIT_DOCS:
        tokens, loss, answer = got["jsonl"][split]
        for fmt in ("parquet", "datasets"):
            for a, b in zip(got[fmt][split], (tokens, loss, answer), strict=True):
                assert np.array_equal(a, b), (fmt, split)
        docs = _documents(tokens, loss)
        stream = np.concatenate([ids for _, ids in iter_chunks(m_text, split)])
        assert np.array_equal(np.concatenate(docs), stream)          # the same ids ...
        assert [d.size for d in docs] == [p.stat().st_size for p in text[split]]  # ... cut
        assert np.array_equal(answer, loss)                           # at the files' ends
    assert len({load_manifest(tmp_path / f).vocab_fingerprint
                for f in ("text", "jsonl", "parquet", "datasets")}) == 1


def test_every_row_is_one_episode_and_the_memory_resets_at_each_documents_start(tmp_path):
    src = _write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in DOCS])
    assert _prepare("--corpus", "jsonl", "--train", src, "--out", tmp_path / "out") == 0
    m = load_manifest(tmp_path / "out")
    assert m.kind == "episodes" and m.extra["task"] == "documents"
    n_rows = {s: m.split(s).n_tokens for s in ("train", "valid", "test")}
    assert n_rows == {"train": 12, "valid": 1, "test": 1}   # 5% each, at least one, carved
    longest = max(len(d.encode()) for d in DOCS)
    assert m.chunk_tokens - 1 == -(-(longest - 1) // SEG) * SEG   # whole segments
    stream = EpisodeStream(m, "train", 1, shuffle=False)
    for i, episode in zip(range(12), stream, strict=False):
        assert [bool(seg.reset[0]) for seg in episode] == [True] + [False] * (len(episode) - 1)
        ids = np.concatenate([seg.tokens[0, :-1].numpy() for seg in episode]
                             + [episode[-1].tokens[0, -1:].numpy()])
        mask = np.concatenate([seg.loss_mask[0].numpy() for seg in episode])
        doc = DOCS[i].encode()
        assert ids[:len(doc)].astype(np.uint8).tobytes() == doc           # this document ...
        assert mask.sum() == len(doc) - 1 and mask[:len(doc) - 1].all()   # ... its loss


def test_context_question_answer_samples_put_the_loss_on_the_answer_tokens_only(tmp_path):
    qa = [{"context": f"mary went to room {i}. " * (1 + i % 3), "question": "where is mary?",
           "answer": f"room {i}" if i % 2 else "hall"} for i in range(12)]
    src = _write_jsonl(tmp_path / "qa.jsonl", qa)
    assert _prepare("--corpus", "jsonl", "--train", src, "--context-field", "context",
                    "--question-field", "question", "--answer-field", "answer",
                    "--out", tmp_path / "out") == 0
    m = load_manifest(tmp_path / "out")
    a = m.extra["records"]["answer_tokens"]
    assert a == len(" room 11") + 1           # the longest answer and its stop
    tokens, loss, answer = read_episodes(m, "train")
    assert np.array_equal(loss, answer)
    T = m.chunk_tokens - 1
    for row, mask, rec in zip(tokens, loss, qa, strict=False):
        said = f" {rec['answer']}\n"
        # BABILong's row (data_pipeline/babilong/assemble.py): filler, context, question
        # prompt, then the answer field (answer, stop, stops): the last A ids.
        prompt = f"{rec['context']}\nQuestion: {rec['question']}\nAnswer:"
        want = (prompt + said + "\n" * (a - len(said))).encode()
        assert row.tobytes() == b" " * (T + 1 - len(want)) + want
        targets = row[1:]
        assert targets[mask].tobytes() == said.encode()            # the loss: answer + stop
        assert mask.sum() == len(said) and not mask[:T - a].any()  # and nothing else


def test_bad_rows_are_skipped_counted_per_file_and_named_by_file_and_row(tmp_path, capsys):
    a = _write_jsonl(tmp_path / "a.jsonl", [{"text": DOCS[0]}, {"text": ""}, {"body": "x"},
                                            {"text": DOCS[1]}, ["not", "an object"],
                                            {"text": 7}, {"text": None}, {"text": DOCS[2]}])
    b = _write_jsonl(tmp_path / "b.jsonl", [{"text": DOCS[3]}, {"text": "x"}])
    v = _write_jsonl(tmp_path / "v.jsonl", [{"text": DOCS[4]}, {"text": DOCS[5] * 9}])
    assert _prepare("--corpus", "jsonl", "--train", a, b, "--valid", v, "--seq-len", 8 * SEG,
                    "--out", tmp_path / "out") == 0
    err = capsys.readouterr().err
    assert "train: skipped 6 bad rows (--on-bad-row skip)\n" in err
    assert f"  {a}: 5 bad rows\n" in err and f"  {b}: 1 bad row\n" in err
    for line in (f"{a} line 2: field 'text' is an empty string",
                 f"{a} line 3: no field 'text' (it has body)",
                 f"{a} line 5: the line holds a list, not a JSON object",
                 f"{a} line 6: field 'text' is a number, not a string",
                 f"{a} line 7: field 'text' is null"):
        assert f"  {line}\n" in err
    assert "  ... and 1 more\n" in err      # b line 2: one token, nothing to predict
    too_long = len((DOCS[5] * 9).encode()) - 1
    assert f"  {v} line 2: {too_long} positions, more than --seq-len {8 * SEG}\n" in err
    m = load_manifest(tmp_path / "out")
    assert m.extra["records"]["bad_rows"] == {"train": {str(a): 5, str(b): 1},
                                              "valid": {str(v): 1}}
    # 4 good train rows: 1 carved for test; valid keeps its 1 good row
    assert [m.split(s).n_tokens for s in ("train", "valid", "test")] == [3, 1, 1]

    t = _write_parquet(tmp_path / "t.parquet", {"text": [DOCS[6], None, "", DOCS[7]],
                                                "n": [1, 2, 3, 4]})
    u = _write_parquet(tmp_path / "u.parquet", {"n": [5, 6]})   # no text column at all
    w = _write_parquet(tmp_path / "w.parquet", {"text": DOCS[8:13]})
    assert _prepare("--corpus", "parquet", "--train", t, u, w, "--out", tmp_path / "p") == 0
    err = capsys.readouterr().err
    assert f"  {t}: 2 bad rows\n" in err and f"  {u}: 2 bad rows\n" in err
    assert f"  {t} row 1: field 'text' is null\n" in err
    assert f"  {t} row 2: field 'text' is an empty string\n" in err
    assert f"  {u} row 0: no field 'text'\n" in err


def test_on_bad_row_fail_stops_at_the_first_bad_row_naming_its_file_and_row(tmp_path, capsys):
    a = _write_jsonl(tmp_path / "a.jsonl", [{"text": DOCS[0]}, {"text": DOCS[1]},
                                            {"txt": DOCS[2]}, {"text": ""}])
    assert _prepare("--corpus", "jsonl", "--train", a, "--on-bad-row", "fail",
                    "--out", tmp_path / "out") == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"memtrain prepare: {a} line 3: no field 'text' (it has txt)")
    assert "--on-bad-row fail" in line
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_a_file_that_is_not_valid_jsonl_or_parquet_is_one_error_naming_the_file(tmp_path,
                                                                                capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": DOCS[0]}) + "\n\n" + '{"text": "cut off\n')
    for policy in ("skip", "fail"):   # not a bad row: the file itself is wrong
        assert _prepare("--corpus", "jsonl", "--train", bad, "--on-bad-row", policy,
                        "--out", tmp_path / "out") == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(f"memtrain prepare: {bad} line 3: not valid JSONL (")
    fake = tmp_path / "fake.parquet"
    fake.write_text("text\nhello\n")
    assert _prepare("--corpus", "parquet", "--train", fake, "--out", tmp_path / "out") == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"memtrain prepare: {fake}: not a Parquet file (")
    assert _prepare("--corpus", "datasets", "--train", tmp_path, "--out", tmp_path / "o") == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"{tmp_path}: not a folder that datasets' save_to_disk wrote" in line


def test_an_hf_tokenizer_writes_each_document_as_the_tokenizer_encodes_it_alone(
        tmp_path, tiny_tokenizer):
    from data_pipeline.hf_tokenizer import HFVocab

    src = _write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in DOCS])
    assert _prepare("--corpus", "jsonl", "--train", src, "--tokenizer",
                    f"hf:{tiny_tokenizer / 'plain'}", "--out", tmp_path / "out") == 0
    m = load_manifest(tmp_path / "out")
    vocab = HFVocab.load(str(tiny_tokenizer / "plain"))
    assert m.vocab["kind"] == "hf" and m.vocab_fingerprint == vocab.fingerprint()
    tokens, loss, _ = read_episodes(m, "train")
    for doc, ids in zip(DOCS, _documents(tokens, loss), strict=False):
        assert np.array_equal(ids, vocab.encode(doc))
    assert m.extra["max_id"] == int(tokens.max())


def test_the_chat_template_makes_context_and_question_a_user_turn_and_scores_the_answer_turn(
        tmp_path, tiny_tokenizer, capsys):
    qa = [{"c": f"mary is in room {i}.", "q": "where is mary?", "a": f"room {i}"}
          for i in range(4)]
    src = _write_jsonl(tmp_path / "qa.jsonl", qa)
    fields = ["--context-field", "c", "--question-field", "q", "--answer-field", "a"]
    src2 = _write_jsonl(tmp_path / "qa2.jsonl", qa[:2])
    src3 = _write_jsonl(tmp_path / "qa3.jsonl", qa[2:])
    assert _prepare("--corpus", "jsonl", "--train", src, "--valid", src2, "--test", src3,
                    *fields, "--chat-template", "--tokenizer", f"hf:{tiny_tokenizer}/chat",
                    "--out", tmp_path / "out") == 0
    from data_pipeline.hf_tokenizer import HFVocab

    vocab = HFVocab.load(str(tiny_tokenizer / "chat"))
    m = load_manifest(tmp_path / "out")
    assert m.extra["records"]["chat_template"] is True
    tokens, loss, _ = read_episodes(m, "train")
    for row, mask, rec in zip(tokens, loss, qa, strict=True):
        text = vocab.decode(row)
        assert f"u: {rec['c']}\n\n{rec['q']}\na: {rec['a']}\n" in text
        assert vocab.decode(row[1:][mask]) == f" {rec['a']}\n"   # the assistant's turn only
    # Refused: no hf tokenizer, an hf tokenizer without a template, and documents.
    for tokenizer, words in (("bytes", "--chat-template needs --tokenizer hf:"),
                             (f"hf:{tiny_tokenizer}/plain", "has no chat template")):
        assert _prepare("--corpus", "jsonl", "--train", src, *fields, "--chat-template",
                        "--tokenizer", tokenizer, "--out", tmp_path / "no") == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert words in line
    assert _prepare("--corpus", "jsonl", "--train", src, "--chat-template", "--tokenizer",
                    f"hf:{tiny_tokenizer}/chat", "--out", tmp_path / "no") == 2
    assert "--chat-template is for records with --context-field" in capsys.readouterr().err
