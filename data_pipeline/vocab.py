"""Vocabularies: text -> token ids in corpus order, and back.

Five kinds, one interface (`Vocab`):
- `ByteVocab`   ids are the raw byte values (256 ids).
- `SymbolVocab` the distinct bytes (enwik8: 204 once newlines are dropped as Transformer-XL does;
                text8: 27) or the distinct characters occurring, ids in sorted symbol order.
- `WordVocab`   Transformer-XL's word level: whitespace split, "<eos>" at every line end (empty
                lines too), specials first, then words by descending train frequency (ties: first
                occurrence) -- the adaptive-softmax cutoffs assume that order (model/adaptive.py;
                Grave et al. 2016 §3.3 cluster the vocabulary by frequency).
- `BPEVocab`    byte-level BPE trained with the `tokenizers` library (bpe.py).
- `HFVocab`     a pretrained checkpoint's own tokenizer, kind "hf" (hf_tokenizer.py).

`to_dict()` is complete (the shard manifest stores it and `vocab_by_kind.vocab_from_dict`
rebuilds the same vocabulary; an "hf" one names the checkpoint to reload its tokenizer from);
`fingerprint(d)` hashes a vocabulary description's canonical JSON, and `Vocab.fingerprint()`
is that of `to_dict()`, except for "hf", where it is that of the token map and size alone
(not where the tokenizer was loaded from). `encode_stream` tokenizes a byte stream given in
arbitrary chunks and yields exactly what `encode` gives for the whole stream: every kind keeps
what a chunk boundary would cut (a multi-byte character, a line, a BPE pre-token) for the next
chunk.
"""

from __future__ import annotations

import codecs
import hashlib
import json
from collections import Counter
from collections.abc import Iterable, Iterator
from itertools import repeat

import numpy as np

EOS = "<eos>"
UNK = "<unk>"


def dtype_for(size: int) -> np.dtype:
    """Smallest unsigned dtype holding ids 0 .. size-1."""
    if size <= 1 << 8:
        return np.dtype(np.uint8)
    if size <= 1 << 16:
        return np.dtype(np.uint16)
    if size <= 1 << 32:
        return np.dtype(np.uint32)
    raise ValueError(f"vocabulary of {size} ids does not fit in uint32")


def fingerprint(vocab: dict) -> str:
    """sha256 of the vocabulary description's canonical JSON (sorted keys, no spaces, ASCII):
    equal for equal dicts whatever their key order. Every manifest's `vocab_fingerprint` is
    this of its `vocab` (a `Vocab.to_dict()` or a synthetic/task description), or for an "hf"
    vocabulary this of its identity (`hf_tokenizer.identity`).

    Manifests keep the fingerprint they were written with and nothing recomputes it when
    loading: streams and checkpoints compare stored fingerprints. So data prepared before
    this was the only form (synthetic and task manifests hashed `json.dumps(vocab,
    sort_keys=True)`, with spaces) still load, and runs on them still resume."""
    canon = json.dumps(vocab, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canon.encode("ascii")).hexdigest()


def _as_bytes(text: str | bytes | bytearray | memoryview) -> bytes:
    return text.encode("utf-8") if isinstance(text, str) else bytes(text)


def as_text(text: str | bytes | bytearray | memoryview, where: str = "") -> str:
    if isinstance(text, str):
        return text
    try:
        return bytes(text).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{where or 'input'}: invalid UTF-8 at byte {e.start}: {e.reason}") from e


def located(where: str) -> str:
    return f" in {where}" if where else ""


class Vocab:
    """Base class. Subclasses set `kind` and `size` and implement encode/decode/to_dict."""

    kind: str = ""
    size: int = 0

    @property
    def id_dtype(self) -> np.dtype:
        return dtype_for(self.size)

    def __len__(self) -> int:
        return self.size

    def encode(self, text: str | bytes) -> np.ndarray:
        raise NotImplementedError

    def decode(self, ids) -> str:
        raise NotImplementedError

    def to_dict(self) -> dict:
        raise NotImplementedError

    def encode_stream(self, chunks: Iterable[bytes], where: str = "") -> Iterator[np.ndarray]:
        """Tokenize the concatenation of `chunks`; the pieces concatenate to `encode(whole)`.
        `where` names the stream (corpus, split, file) in error messages."""
        for chunk in chunks:
            if chunk:
                yield self.encode(chunk)

    def fingerprint(self) -> str:
        return fingerprint(self.to_dict())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Vocab) and self.to_dict() == other.to_dict()

    __hash__ = None  # mutable-looking value objects: compare by content, do not hash

    def __repr__(self) -> str:
        return f"{type(self).__name__}(size={self.size})"


# --------------------------------------------------------------------------- bytes / symbols
class ByteVocab(Vocab):
    """ids = byte values of the UTF-8 (or raw) bytes; 256 ids, uint8."""

    kind = "bytes"
    size = 256

    def encode(self, text: str | bytes) -> np.ndarray:
        return np.frombuffer(_as_bytes(text), dtype=np.uint8).copy()

    def decode_bytes(self, ids) -> bytes:
        arr = np.asarray(ids)
        if arr.size and (arr.min() < 0 or arr.max() > 255):
            raise ValueError("byte ids must lie in 0..255")
        return arr.astype(np.uint8).tobytes()

    def decode(self, ids) -> str:
        # A slice of a byte stream may cut a multi-byte character: show it, do not fail.
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def to_dict(self) -> dict:
        return {"kind": self.kind, "size": self.size}


class SymbolVocab(Vocab):
    """The distinct symbols occurring, sorted; unit "bytes" (enwik8, text8) or "chars".

    Encoding is a numpy table lookup (no per-symbol Python): bytes index a 256-entry table;
    characters go through UTF-32 code points into a dense table up to the largest symbol.
    """

    kind = "symbols"

    def __init__(self, symbols: Iterable[int], unit: str = "bytes"):
        if unit not in ("bytes", "chars"):
            raise ValueError(f"unit must be 'bytes' or 'chars', got {unit!r}")
        syms = sorted({int(s) for s in symbols})
        if not syms:
            raise ValueError("a symbol vocabulary needs at least one symbol")
        top = 0xFF if unit == "bytes" else 0x10FFFF
        if syms[0] < 0 or syms[-1] > top:
            raise ValueError(f"symbols must lie in 0..{top:#x} for unit {unit!r}")
        self.unit = unit
        self.symbols = np.asarray(syms, dtype=np.uint32)
        self.size = len(syms)
        # -1 marks a symbol outside the vocabulary.
        self._table = np.full(syms[-1] + 1 if unit == "chars" else 256, -1, dtype=np.int32)
        self._table[self.symbols] = np.arange(self.size, dtype=np.int32)

    @classmethod
    def build(cls, data: bytes | Iterable[bytes]) -> SymbolVocab:
        """Distinct bytes of `data` (bytes, or an iterable of byte chunks)."""
        chunks = [data] if isinstance(data, (bytes, bytearray, memoryview)) else data
        counts = np.zeros(256, dtype=np.int64)
        for c in chunks:
            counts += np.bincount(np.frombuffer(c, dtype=np.uint8), minlength=256)
        return cls(np.flatnonzero(counts), unit="bytes")

    @classmethod
    def build_chars(cls, text: str | Iterable[str]) -> SymbolVocab:
        """Distinct characters of `text` (a str, or an iterable of str chunks)."""
        seen: set[str] = set()
        for piece in [text] if isinstance(text, str) else text:
            seen.update(piece)
        return cls((ord(c) for c in seen), unit="chars")

    def _codes(self, text: str | bytes, where: str) -> np.ndarray:
        if self.unit == "bytes":
            return np.frombuffer(_as_bytes(text), dtype=np.uint8)
        s = as_text(text, where)
        return np.frombuffer(s.encode("utf-32-le"), dtype=np.uint32)

    def _symbol_repr(self, code: int) -> str:
        return f"byte {code} ({bytes([code])!r})" if self.unit == "bytes" else (
            f"character {chr(code)!r} (U+{code:04X})")

    def _lookup(self, codes: np.ndarray, where: str, base: int) -> np.ndarray:
        """ids of `codes`; an unknown symbol is reported at position `base` + its index."""
        if codes.size == 0:
            return np.zeros(0, dtype=self.id_dtype)
        if self.unit == "chars" and int(codes.max()) >= self._table.size:
            ids = np.full(codes.shape, -1, dtype=np.int32)
            ok = codes < self._table.size
            ids[ok] = self._table[codes[ok]]
        else:
            ids = self._table[codes]
        if int(ids.min()) < 0:
            bad = int(np.flatnonzero(ids < 0)[0])
            unit = "byte offset" if self.unit == "bytes" else "character"
            raise ValueError(f"{self._symbol_repr(int(codes[bad]))} at {unit} {base + bad}"
                             f"{located(where)} is not in the symbol vocabulary")
        return ids.astype(self.id_dtype)

    def encode(self, text: str | bytes, where: str = "") -> np.ndarray:
        return self._lookup(self._codes(text, where), where, 0)

    def encode_stream(self, chunks: Iterable[bytes], where: str = "") -> Iterator[np.ndarray]:
        done = 0  # symbols already encoded, for error positions in the whole stream
        if self.unit == "bytes":
            for chunk in chunks:
                if chunk:
                    yield self._lookup(np.frombuffer(chunk, dtype=np.uint8), where, done)
                    done += len(chunk)
            return
        # chars: a chunk boundary may cut a UTF-8 sequence; the incremental decoder keeps it.
        dec = codecs.getincrementaldecoder("utf-8")()
        offset = 0
        try:
            for chunk in chunks:
                text = dec.decode(chunk)
                offset += len(chunk)
                if text:
                    yield self._lookup(self._codes(text, where), where, done)
                    done += len(text)
            tail = dec.decode(b"", final=True)
        except UnicodeDecodeError as e:
            raise ValueError(f"invalid UTF-8{located(where)} in the chunk ending at byte {offset}: "
                             f"{e.reason}") from None
        if tail:
            yield self._lookup(self._codes(tail, where), where, done)

    def decode_bytes(self, ids) -> bytes:
        if self.unit != "bytes":
            return self.decode(ids).encode("utf-8")
        return self.symbols[np.asarray(ids, dtype=np.int64)].astype(np.uint8).tobytes()

    def decode(self, ids) -> str:
        codes = self.symbols[np.asarray(ids, dtype=np.int64)]
        if self.unit == "bytes":
            return codes.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
        return codes.astype("<u4").tobytes().decode("utf-32-le")

    def to_dict(self) -> dict:
        return {"kind": self.kind, "unit": self.unit, "symbols": [int(s) for s in self.symbols]}

    def __repr__(self) -> str:
        return f"SymbolVocab(unit={self.unit!r}, size={self.size})"


# --------------------------------------------------------------------------- words
class WordVocab(Vocab):
    """Word level as in Transformer-XL: each line -> line.split() + ["<eos>"].

    Ids: the specials first (in the given order), then words by descending frequency in the
    text the vocabulary was built from, ties by first occurrence. Unknown words map to "<unk>"
    when the vocabulary has it (WikiText and PTB carry it in train); otherwise they are an error
    naming the word, its line and the stream.
    """

    kind = "words"

    def __init__(self, words: Iterable[str], specials: Iterable[str] = (EOS,),
                 eos: str | None = EOS):
        self.words = list(words)
        self.specials = list(specials)
        self.eos = eos
        self.index = {w: i for i, w in enumerate(self.words)}
        if len(self.index) != len(self.words):
            dup = next(w for w, c in Counter(self.words).items() if c > 1)
            raise ValueError(f"word {dup!r} occurs twice in the vocabulary")
        missing = [s for s in self.specials if s not in self.index]
        if missing:
            raise ValueError(f"specials {missing} are not in the word list")
        if eos is not None and eos not in self.index:
            raise ValueError(f"end-of-line token {eos!r} is not in the word list")
        self.size = len(self.words)
        self.unk_id = self.index.get(UNK)
        self.eos_id = None if eos is None else self.index[eos]

    @classmethod
    def build(cls, lines: Iterable[str], specials: Iterable[str] = (EOS,)) -> WordVocab:
        counts: Counter[str] = Counter()
        for line in lines:
            counts.update(line.split())
        return cls.from_counts(counts, specials)

    @classmethod
    def from_counts(cls, counts: Counter[str], specials: Iterable[str] = (EOS,)) -> WordVocab:
        """Specials, then `counts` by descending count; `sorted` is stable and a Counter keeps
        first-insertion order, so ties stay in order of first occurrence."""
        specials = list(specials)
        sp = set(specials)
        ranked = sorted((w for w in counts if w not in sp), key=lambda w: -counts[w])
        return cls(specials + ranked, specials, eos=specials[0] if specials else None)

    # -- encoding
    def _line_tokens(self, lines: Iterable[str]) -> list[str]:
        toks: list[str] = []
        for line in lines:
            toks.extend(line.split())
            if self.eos is not None:
                toks.append(self.eos)
        return toks

    def _unknown_error(self, lines: list[str], first_line: int, where: str) -> ValueError:
        for n, line in enumerate(lines):
            for w in line.split():
                if w not in self.index:
                    return ValueError(f"unknown word {w!r} at line {first_line + n}"
                                      f"{located(where)} (the vocabulary has no <unk>)")
        return ValueError(f"unknown word{located(where)}")  # pragma: no cover - unreachable

    def encode_lines(self, lines: Iterable[str], where: str = "",
                     first_line: int = 1) -> np.ndarray:
        """ids of the lines, each followed by <eos>. `first_line` numbers the first line in
        error messages."""
        lines = list(lines)
        toks = self._line_tokens(lines)
        if self.unk_id is not None:
            ids = map(self.index.get, toks, repeat(self.unk_id))
        else:
            try:
                ids = [self.index[t] for t in toks]
            except KeyError:
                raise self._unknown_error(lines, first_line, where) from None
        return np.fromiter(ids, dtype=self.id_dtype, count=len(toks))

    @staticmethod
    def split_lines(text: str) -> list[str]:
        """Lines end at "\\n"; a final line without one is still a line; "" has none."""
        if not text:
            return []
        lines = text.split("\n")
        return lines[:-1] if text.endswith("\n") else lines

    def encode(self, text: str | bytes, where: str = "") -> np.ndarray:
        return self.encode_lines(self.split_lines(as_text(text, where)), where)

    def encode_stream(self, chunks: Iterable[bytes], where: str = "") -> Iterator[np.ndarray]:
        carry = b""
        line_no = 1
        for chunk in chunks:
            buf = carry + chunk if carry else chunk
            cut = buf.rfind(b"\n") + 1
            carry = buf[cut:]
            if cut:
                lines = as_text(buf[: cut - 1], f"{where} line {line_no}").split("\n")
                yield self.encode_lines(lines, where, line_no)
                line_no += len(lines)
        if carry:
            yield self.encode_lines([as_text(carry, f"{where} line {line_no}")], where, line_no)

    def decode(self, ids) -> str:
        """Words joined by spaces, <eos> as a line end (inverse of encode on text whose lines
        are single-space separated without leading or trailing blanks)."""
        out: list[str] = []
        line: list[str] = []
        for i in np.asarray(ids).tolist():
            if i == self.eos_id:
                out.append(" ".join(line) + "\n")
                line = []
            else:
                line.append(self.words[i])
        if line:
            out.append(" ".join(line))
        return "".join(out)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "specials": self.specials, "eos": self.eos, "words": self.words}

    def __repr__(self) -> str:
        return f"WordVocab(size={self.size}, unk={self.unk_id is not None})"
