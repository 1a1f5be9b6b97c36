"""Benchmark readers and vocabularies on tiny files of the real formats (no network).

Each test's name states the property it checks. enwik8/text8 use `heldout_bytes` to scale the
standard 5M/5M held-out rule down to a few dozen bytes.
"""

from __future__ import annotations

import hashlib
import time
import zipfile

import numpy as np
import pytest

from data_pipeline import bpe as bpe_mod
from data_pipeline.bpe import BPEVocab
from data_pipeline.corpora import CORPORA, HELDOUT_BYTES, open_corpus
from data_pipeline.download import SOURCES, ChecksumError, Remote, extract_member, fetch
from data_pipeline.vocab import ByteVocab, SymbolVocab, WordVocab, dtype_for
from data_pipeline.vocab_by_kind import vocab_from_dict

H = 64  # held-out bytes (valid and test each) in the tiny enwik8/text8 files

# enwik8 is XML with newlines and multi-byte UTF-8; byte-level splits may cut characters.
ENWIK8_PIECES = [b"<page>\n", b"  <title>Caf\xc3\xa9</title>\n", b"[[Link|text]] ",
                 b"\xe2\x80\x94 dash ", b"&amp;", b"'''bold''' ", b"{{cite}}\n", b"\n"]


def _enwik8_like(n_pieces: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    return b"".join(ENWIK8_PIECES[i] for i in rng.integers(0, len(ENWIK8_PIECES), n_pieces))


def _concat(corpus, split: str, chunk_bytes: int = 1 << 24) -> np.ndarray:
    pieces = list(corpus.iter_tokens(split, chunk_bytes))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=corpus.vocab.id_dtype)


def _write_wikitext(d, train: str, valid: str, test: str, layout: str = "") -> None:
    base = d / layout if layout else d
    base.mkdir(parents=True, exist_ok=True)
    for split, text in (("train", train), ("valid", valid), ("test", test)):
        (base / f"wiki.{split}.tokens").write_text(text, encoding="utf-8")


WT_TRAIN = " = Title = \n \n the cat sat on the mat . \n the <unk> ran , the cat sat . \n"
WT_VALID = " the cat ran . \n \n a zebra sat . \n"
WT_TEST = " the mat . \n"


# --------------------------------------------------------------------------- split rules
def test_enwik8_splits_hold_out_last_two_blocks_as_valid_then_test(tmp_path):
    data = _enwik8_like(60)
    (tmp_path / "enwik8").write_bytes(data)
    c = open_corpus("enwik8", tmp_path, tokenizer="bytes", heldout_bytes=H, progress=False)
    assert c.splits == ("train", "valid", "test")
    expect = {"train": data[: -2 * H], "valid": data[-2 * H: -H], "test": data[-H:]}
    for split, raw in expect.items():
        assert c.raw_size(split) == len(raw)
        assert _concat(c, split).tobytes() == raw  # ByteVocab ids are the bytes themselves


def test_enwik8_default_heldout_is_five_million_bytes(tmp_path):
    data = np.frombuffer(_enwik8_like(4000), np.uint8)
    blob = np.resize(data, 2 * HELDOUT_BYTES + 1234).tobytes()
    (tmp_path / "enwik8").write_bytes(blob)
    with pytest.warns(UserWarning, match="100,000,000"):  # not the real 10^8-byte file
        c = open_corpus("enwik8", tmp_path, tokenizer="bytes", progress=False)
    assert [c.raw_size(s) for s in c.splits] == [1234, 5_000_000, 5_000_000]


def test_enwik8_xl_compat_symbols_drop_newlines_and_plain_symbols_keep_them(tmp_path):
    data = _enwik8_like(60)
    (tmp_path / "enwik8").write_bytes(data)
    xl = open_corpus("enwik8", tmp_path, heldout_bytes=H, progress=False)
    plain = open_corpus("enwik8", tmp_path, heldout_bytes=H, progress=False, xl_compat=False)
    assert ord("\n") not in xl.vocab.symbols and ord("\n") in plain.vocab.symbols
    assert xl.vocab.size == plain.vocab.size - 1
    for split, raw in {"train": data[: -2 * H], "valid": data[-2 * H: -H],
                       "test": data[-H:]}.items():
        assert xl.vocab.decode_bytes(_concat(xl, split)) == raw.replace(b"\n", b"")
        assert plain.vocab.decode_bytes(_concat(plain, split)) == raw
        assert xl.raw_size(split) == plain.raw_size(split) == len(raw)


def test_text8_splits_first_train_then_valid_then_test_and_xl_strips_split_ends(tmp_path):
    rng = np.random.default_rng(1)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", np.uint8)
    body = rng.choice(np.concatenate([letters, np.full(8, ord(" "), np.uint8)]), 400)
    body[:26] = letters  # every letter occurs
    data = bytearray(b" " + body.tobytes())  # text8 starts with a space
    n = len(data)
    data[n - 2 * H] = ord(" ")  # valid starts with a blank
    data[n - H - 1] = ord(" ")  # valid ends with a blank
    data = bytes(data)
    (tmp_path / "text8").write_bytes(data)
    plain = open_corpus("text8", tmp_path, heldout_bytes=H, progress=False, xl_compat=False)
    xl = open_corpus("text8", tmp_path, heldout_bytes=H, progress=False)
    parts = {"train": data[: n - 2 * H], "valid": data[n - 2 * H: n - H], "test": data[n - H:]}
    assert xl.vocab.size == plain.vocab.size == 27
    for split, raw in parts.items():
        assert plain.vocab.decode_bytes(_concat(plain, split)) == raw
        assert xl.vocab.decode_bytes(_concat(xl, split)) == raw.strip(b" ")
    assert len(_concat(xl, "train")) == len(parts["train"]) - 1  # like XL's 89,999,999


# --------------------------------------------------------------------------- vocabularies
def test_symbol_vocab_ids_follow_sorted_symbols_and_cover_bytes_of_every_split(tmp_path):
    data = bytearray(_enwik8_like(60))
    data[-2 * H + 3] = ord("#")  # occurs only in valid
    data[-5] = ord("~")  # occurs only in test
    assert data[: -2 * H].count(b"#") == 0 and data[: -H].count(b"~") == 0
    (tmp_path / "enwik8").write_bytes(bytes(data))
    c = open_corpus("enwik8", tmp_path, heldout_bytes=H, progress=False, xl_compat=False)
    syms = c.vocab.symbols.tolist()
    assert syms == sorted(set(data))
    assert ord("#") in syms and ord("~") in syms
    ids = c.vocab.encode(b"#~")
    assert ids.tolist() == [syms.index(ord("#")), syms.index(ord("~"))]
    assert all(len(_concat(c, s)) == c.raw_size(s) for s in c.splits)


def test_symbol_vocab_rejects_symbol_it_never_saw():
    v = SymbolVocab.build(b"abc")
    with pytest.raises(ValueError, match=r"byte 122 .* at byte offset 2 is not in the symbol"):
        v.encode(b"abz")
    cv = SymbolVocab.build_chars("abc")
    with pytest.raises(ValueError, match=r"'é' \(U\+00E9\) at character 1 is not in the"):
        cv.encode("aé")


def _bpe_text() -> str:
    lines = ["The cat sat on the mat.", "  indented  line", "", "it's 42 -- naïve café ☕",
             "tabs\there", "end."]
    return "\n".join(lines * 6) + "\n"


@pytest.mark.parametrize("kind", ["bytes", "symbols", "chars", "words", "bpe"])
def test_encode_decode_round_trip_for_every_vocab_kind(kind):
    text = "a naïve café ☕\nsecond line\n\nthird\n"
    if kind == "bytes":
        v = ByteVocab()
    elif kind == "symbols":
        v = SymbolVocab.build(text.encode())
    elif kind == "chars":
        v = SymbolVocab.build_chars(text)
    elif kind == "words":
        v = WordVocab.build(text.splitlines())
    else:
        v = BPEVocab.build([_bpe_text(), text], vocab_size=300)
    ids = v.encode(text)
    assert ids.dtype == v.id_dtype and ids.ndim == 1
    assert v.decode(ids) == text
    assert np.array_equal(v.encode(text.encode("utf-8")), ids)  # str and bytes agree
    v2 = vocab_from_dict(v.to_dict())
    assert type(v2) is type(v) and np.array_equal(v2.encode(text), ids)


def test_word_vocab_orders_by_train_frequency_with_eos_at_every_line_end():
    lines = ["b a b", "", "c a b", "y x"]  # b:3, a:2, then c, y, x once each
    v = WordVocab.build(lines)
    assert v.words == ["<eos>", "b", "a", "c", "y", "x"]  # ties keep first-occurrence order
    eos = 0
    assert v.encode("b a\n\nc\n").tolist() == [1, 2, eos, eos, 3, eos]  # empty line -> <eos>
    assert v.encode("x y").tolist() == [5, 4, eos]  # a last line without "\n" is a line too
    assert v.encode_lines(["  a   b ", ""]).tolist() == [2, 1, eos, eos]


def test_word_vocab_maps_unknown_words_to_unk_when_train_has_it(tmp_path):
    _write_wikitext(tmp_path, WT_TRAIN, WT_VALID, WT_TEST, layout="wikitext-2")
    c = open_corpus("wt2", tmp_path, progress=False)
    v = c.vocab
    assert v.words[0] == "<eos>" and v.words[1] == "the" and v.unk_id is not None
    valid = _concat(c, "valid")
    words = [v.words[i] for i in valid]
    assert words == ["the", "cat", "ran", ".", "<eos>", "<eos>", "<unk>", "<unk>", "sat", ".",
                     "<eos>"]  # "a" and "zebra" never occur in train


def test_word_vocab_without_unk_raises_naming_word_line_and_split(tmp_path):
    (tmp_path / "ptb.train.txt").write_text(" the cat sat \n the dog ran \n")
    (tmp_path / "ptb.valid.txt").write_text(" the cat \n the dog \n a zebra ran \n")
    (tmp_path / "ptb.test.txt").write_text(" the cat \n")
    c = open_corpus("ptb", tmp_path, progress=False)
    assert c.vocab.unk_id is None
    with pytest.raises(ValueError, match=r"'a'.*line 3.*valid.*ptb\.valid\.txt"):
        _concat(c, "valid", chunk_bytes=4)
    assert len(_concat(c, "test")) == 3


def test_bpe_vocab_round_trips_through_to_dict_and_encodes_identically():
    v = BPEVocab.build([_bpe_text()], vocab_size=320)
    d = v.to_dict()
    assert d["kind"] == "bpe" and isinstance(d["tokenizer"], str)
    v2 = vocab_from_dict(d)
    assert v2.to_dict() == d and v2.fingerprint() == v.fingerprint() and v2.size == v.size
    probe = "unseen words: zyzzyva! café\n\n  spaced"
    assert np.array_equal(v.encode(probe), v2.encode(probe))
    assert v2.decode(v2.encode(probe)) == probe


def test_bpe_cuts_at_safe_newlines_give_the_unsplit_encoding(monkeypatch):
    v = BPEVocab.build([_bpe_text()], vocab_size=320)
    text = _bpe_text() * 3
    whole = v.tokenizer.encode(text, add_special_tokens=False).ids
    monkeypatch.setattr(bpe_mod, "_BPE_PIECE_CHARS", 17)  # force many encode_batch pieces
    assert v.encode(text).tolist() == whole
    raw = text.encode()
    stream = v.encode_stream(raw[i:i + 5] for i in range(0, len(raw), 5))
    assert np.concatenate(list(stream)).tolist() == whole


def test_fingerprint_is_stable_and_differs_between_vocabularies():
    a1 = WordVocab.build(["a b b"])
    a2 = vocab_from_dict(a1.to_dict())
    b = WordVocab.build(["a a b"])  # same words, other frequency order
    fps = {a1.fingerprint(), b.fingerprint(), ByteVocab().fingerprint(),
           SymbolVocab.build(b"ab").fingerprint(), SymbolVocab.build_chars("ab").fingerprint()}
    assert a1.fingerprint() == a2.fingerprint() == WordVocab.build(["a b b"]).fingerprint()
    assert len(fps) == 5
    assert len(a1.fingerprint()) == 64 and int(a1.fingerprint(), 16) >= 0


def test_id_dtype_is_smallest_unsigned_type_holding_every_id():
    assert dtype_for(256) == np.uint8 and dtype_for(257) == np.uint16
    assert dtype_for(65536) == np.uint16 and dtype_for(65537) == np.uint32
    assert ByteVocab().id_dtype == np.uint8
    assert WordVocab([f"w{i}" for i in range(300)], specials=(), eos=None).id_dtype == np.uint16


# --------------------------------------------------------------------------- chunked reading
def _corpus_for(kind: str, d):
    if kind == "enwik8-symbols":
        (d / "enwik8").write_bytes(_enwik8_like(80))
        return open_corpus("enwik8", d, heldout_bytes=H, progress=False)
    if kind == "words":
        _write_wikitext(d, WT_TRAIN * 3, WT_VALID, WT_TEST)
        return open_corpus("wt103", d, progress=False)
    (d / "t.txt").write_text(_bpe_text() * 4, encoding="utf-8")
    tok = kind.split("-")[1]
    return open_corpus("text", d, files={"train": ["t.txt"]}, tokenizer=tok, bpe_vocab_size=300,
                       valid_fraction=0.2, test_fraction=0.2, progress=False)


@pytest.mark.parametrize("kind", ["enwik8-symbols", "words", "text-chars", "text-bpe",
                                  "text-bytes"])
def test_iter_tokens_in_small_chunks_equals_encoding_the_whole_split(tmp_path, kind):
    c = _corpus_for(kind, tmp_path)
    for split in c.splits:
        whole = c.vocab.encode(b"".join(c.raw_chunks(split)))
        for chunk_bytes in (1, 5, 64):  # cuts inside multi-byte characters, words and lines
            got = _concat(c, split, chunk_bytes)
            assert got.dtype == c.vocab.id_dtype
            assert np.array_equal(got, whole), (split, chunk_bytes)


# --------------------------------------------------------------------------- downloads
def _zip_with(path, member: str, payload: bytes):
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(member, payload)
    return path


def test_fetch_file_url_with_matching_sha256_installs_file(tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(b"payload" * 100)
    digest = hashlib.sha256(src.read_bytes()).hexdigest()
    dest = fetch(src.as_uri(), tmp_path / "out" / "file.bin", digest, progress=False)
    assert dest.read_bytes() == src.read_bytes()
    assert [p.name for p in dest.parent.iterdir()] == ["file.bin"]  # no temporary left


def test_fetch_with_wrong_sha256_raises_and_leaves_no_file(tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(b"payload")
    actual = hashlib.sha256(b"payload").hexdigest()
    out = tmp_path / "out"
    with pytest.raises(ChecksumError) as err:
        fetch(src.as_uri(), out / "file.bin", "0" * 64, progress=False)
    msg = str(err.value)
    assert "file.bin" in msg and "0" * 64 in msg and actual in msg
    assert list(out.iterdir()) == []


def test_fetch_without_known_checksum_prints_sha256_as_unverified(tmp_path, capsys):
    src = tmp_path / "src.bin"
    src.write_bytes(b"abc")
    fetch(src.as_uri(), tmp_path / "f.bin", None, progress=False)
    out = capsys.readouterr().out
    assert hashlib.sha256(b"abc").hexdigest() in out and "not checked" in out


def test_download_fetches_zip_by_url_verifies_and_extracts(tmp_path, monkeypatch):
    data = _enwik8_like(40)
    archive = _zip_with(tmp_path / "mirror.zip", "enwik8", data)
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    remote = Remote(urls=(archive.as_uri(),), filename="enwik8.zip", sha256=digest,
                    members={"enwik8": "enwik8"})
    monkeypatch.setitem(SOURCES, "enwik8", (remote,))
    d = tmp_path / "data"
    c = open_corpus("enwik8", d, download=True, tokenizer="bytes", heldout_bytes=H,
                    progress=False)
    assert (d / "enwik8").read_bytes() == data and (d / "enwik8.zip").is_file()
    assert sorted(p.name for p in d.iterdir()) == ["enwik8", "enwik8.zip"]
    assert _concat(c, "test").tobytes() == data[-H:]


def test_zip_already_in_data_dir_is_extracted_without_download(tmp_path, monkeypatch):
    data = _enwik8_like(40)
    _zip_with(tmp_path / "enwik8.zip", "enwik8", data)
    remote = Remote(urls=("http://invalid.example/never-used.zip",), filename="enwik8.zip",
                    members={"enwik8": "enwik8"})
    monkeypatch.setitem(SOURCES, "enwik8", (remote,))
    c = open_corpus("enwik8", tmp_path, tokenizer="bytes", heldout_bytes=H, progress=False)
    assert _concat(c, "train").tobytes() == data[: -2 * H]
    with pytest.raises(ValueError, match="no member 'missing'"):
        extract_member(tmp_path / "enwik8.zip", "missing", tmp_path / "x")


def test_download_with_bad_checksum_leaves_nothing_behind(tmp_path, monkeypatch):
    archive = _zip_with(tmp_path / "mirror.zip", "enwik8", b"x" * 500)
    remote = Remote(urls=(archive.as_uri(),), filename="enwik8.zip", sha256="f" * 64,
                    members={"enwik8": "enwik8"})
    monkeypatch.setitem(SOURCES, "enwik8", (remote,))
    d = tmp_path / "data"
    with pytest.raises(ChecksumError, match="enwik8.zip"):
        open_corpus("enwik8", d, download=True, heldout_bytes=H, progress=False)
    assert list(d.iterdir()) == []


@pytest.mark.parametrize("name,expected", [("wt103", "wiki.train.tokens"), ("enwik8", "enwik8"),
                                           ("ptb", "ptb.valid.txt"), ("text8", "text8.zip")])
def test_missing_files_error_names_expected_paths_and_download_flag(tmp_path, name, expected):
    with pytest.raises(FileNotFoundError) as err:
        open_corpus(name, tmp_path, progress=False)
    msg = str(err.value)
    assert str(tmp_path / expected) in msg and "--download" in msg


# --------------------------------------------------------------------------- text corpus
def test_text_corpus_concatenates_sorted_globs_and_carves_valid_test_from_end(tmp_path):
    parts = {"b.txt": b"second file\n" * 5, "a.txt": b"first file\n" * 5, "c.md": b"skip\n"}
    for name, payload in parts.items():
        (tmp_path / name).write_bytes(payload)
    c = open_corpus("text", tmp_path, files={"train": ["*.txt"]}, valid_fraction=0.1,
                    test_fraction=0.2, progress=False)
    whole = parts["a.txt"] + parts["b.txt"]  # sorted, .md not matched
    n_valid, n_test = int(len(whole) * 0.1), int(len(whole) * 0.2)
    assert c.files("train") == [tmp_path / "a.txt", tmp_path / "b.txt"]
    assert _concat(c, "train").tobytes() == whole[: len(whole) - n_valid - n_test]
    assert _concat(c, "valid").tobytes() == whole[len(whole) - n_valid - n_test: -n_test]
    assert _concat(c, "test").tobytes() == whole[-n_test:]
    # an explicit valid file is used as given; only test is carved
    c2 = open_corpus("text", tmp_path, files={"train": ["a.txt"], "valid": ["b.txt"]},
                     test_fraction=0.2, progress=False)
    assert _concat(c2, "valid").tobytes() == parts["b.txt"]
    assert c2.raw_size("test") == int(len(parts["a.txt"]) * 0.2)


def test_text_corpus_chars_carve_on_character_starts_and_reject_unseen_chars(tmp_path):
    (tmp_path / "t.txt").write_text("é" * 50, encoding="utf-8")  # 100 bytes, 2 per char
    c = open_corpus("text", tmp_path, files={"train": ["t.txt"]}, tokenizer="chars",
                    valid_fraction=0.15, test_fraction=0.15, progress=False)  # 15-byte cuts
    assert sum(len(_concat(c, s)) for s in c.splits) == 50
    (tmp_path / "v.txt").write_text("ab\nc☕\n" * 5, encoding="utf-8")
    c2 = open_corpus("text", tmp_path, files={"train": ["v.txt"], "valid": ["t.txt"]},
                     tokenizer="chars", test_fraction=0.3, progress=False)
    with pytest.raises(ValueError, match=r"'é' .* at character 0 in text valid split .*t\.txt"):
        _concat(c2, "valid")


# --------------------------------------------------------------------------- bad input
def test_bad_input_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="known corpora: " + ", ".join(CORPORA)):
        open_corpus("enwik9", tmp_path)
    with pytest.raises(ValueError, match="unknown tokenizer 'bpe'"):
        open_corpus("enwik8", tmp_path, tokenizer="bpe")
    (tmp_path / "ptb.train.txt").write_text("a b\n")
    (tmp_path / "ptb.valid.txt").write_text("")
    (tmp_path / "ptb.test.txt").write_text("a\n")
    with pytest.raises(ValueError, match=r"ptb\.valid\.txt is empty"):
        open_corpus("ptb", tmp_path, progress=False)
    (tmp_path / "enwik8").write_bytes(b"x" * 100)
    with pytest.raises(ValueError, match="fewer than"):
        open_corpus("enwik8", tmp_path, heldout_bytes=50, progress=False)
    with pytest.raises(FileNotFoundError, match="no file matches"):
        open_corpus("text", tmp_path, files={"train": ["nothing*.txt"]}, progress=False)
    (tmp_path / "x.txt").write_bytes(b"abc")
    with pytest.raises(ValueError, match="in both"):
        open_corpus("text", tmp_path, files={"train": ["x.txt"], "valid": ["x.txt"]},
                    progress=False)
    c = open_corpus("enwik8", tmp_path, heldout_bytes=10, progress=False)
    with pytest.raises(ValueError, match="no split 'dev'"):
        next(c.iter_tokens("dev"))


# --------------------------------------------------------------------------- throughput
def test_symbol_tokenize_throughput_report(tmp_path):
    """Prints MB/s for ~20 MB through the symbol path (file read + lookup); no assertion on
    time, which depends on the machine and its load."""
    unit = np.frombuffer(_enwik8_like(3000), np.uint8)
    (tmp_path / "enwik8").write_bytes(np.resize(unit, 20_000_000).tobytes())
    c = open_corpus("enwik8", tmp_path, heldout_bytes=1_000_000, progress=False)
    t0 = time.perf_counter()
    n = sum(ids.size for ids in c.iter_tokens("train", 1 << 22))
    dt = time.perf_counter() - t0
    mb = c.raw_size("train") / 1e6
    print(f"\nsymbol tokenize: {mb:.0f} MB in {dt:.3f} s = {mb / dt:.0f} MB/s ({n:,} tokens)")
    assert n > 0
