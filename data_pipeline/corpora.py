"""Language-modelling benchmarks with their standard splits, as token ids in corpus order.

    corpus = open_corpus("enwik8", "data/enwik8", download=True)
    for ids in corpus.iter_tokens("train"):      # numpy pieces, concatenating to the split
        ...

Splits (LaMemo §4.1 and Transformer-XL's data scripts, the authors' code):
- enwik8, text8: one 100 MB file; the last 2 x 5,000,000 bytes are valid then test, the rest
  train (90M/5M/5M). `heldout_bytes` overrides 5,000,000 (tiny test files).
- wt103, wt2: wiki.{train,valid,test}.tokens (flat in data_dir or in the zip's wikitext-103/ or
  wikitext-2/ folder); ptb: ptb.{train,valid,test}.txt. Word vocabulary from train.
- text: your own files, `files={"train": [globs], "valid": [...], "test": [...]}`; a missing
  valid/test is carved from the end of train (train | valid | test), like enwik8.

`xl_compat=True` (default) reproduces Transformer-XL's symbol streams, whose counts are the
ones papers report (LaMemo Table 4): enwik8 drops every newline byte (its prep script turns
bytes into one number per token per line and the reader keeps no end-of-line symbol), giving
204 symbols and 88,982,818 / 4,945,742 / 4,943,417 tokens; text8 strips blanks at both ends
of each split (89,999,999 / 4,999,999 / 5,000,000). With `xl_compat=False`, or with
tokenizer="bytes", every byte of the split is a token (enwik8 then has 205 symbols).
`raw_size` is always the split's byte count in the file.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from .bpe import BPEVocab
from .find_files import expand_globs, resolve_files
from .hf_tokenizer import HFVocab, hf_name
from .vocab import ByteVocab, SymbolVocab, Vocab, WordVocab

CORPORA = ("enwik8", "text8", "wt103", "wt2", "ptb", "text")
SPLITS = ("train", "valid", "test")
HELDOUT_BYTES = 5_000_000  # enwik8 / text8: size of valid and of test
# "hf" is `hf:<checkpoint>`, a pretrained model's own tokenizer (hf_tokenizer.py). Not for
# enwik8/text8: their splits are cut at byte offsets that may fall inside a UTF-8 character,
# and their published results are bits per character over their own symbols.
TOKENIZERS = {
    "enwik8": ("symbols", "bytes"),
    "text8": ("symbols", "bytes"),
    "wt103": ("words", "hf"),
    "wt2": ("words", "hf"),
    "ptb": ("words", "hf"),
    "text": ("bytes", "chars", "bpe", "hf"),
}
_WIKITEXT_DIR = {"wt103": "wikitext-103", "wt2": "wikitext-2"}
_BLANKS = b" \t\n\r\x0b\x0c"


@dataclass(frozen=True)
class Span:
    """Bytes [start, stop) of one file."""

    path: Path
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


def _read_spans(spans: Iterable[Span], chunk_bytes: int) -> Iterator[bytes]:
    for sp in spans:
        with open(sp.path, "rb") as f:
            f.seek(sp.start)
            left = sp.size
            while left > 0:
                block = f.read(min(chunk_bytes, left))
                if not block:
                    raise ValueError(f"{sp.path} ended at byte {sp.stop - left}, expected "
                                     f"{sp.stop} (was it truncated or changed while reading?)")
                left -= len(block)
                yield block


def _cut(spans: list[Span], lo: int, hi: int) -> list[Span]:
    """The sub-spans covering global offsets [lo, hi) of the concatenation of `spans`."""
    out, base = [], 0
    for sp in spans:
        a, b = max(lo, base), min(hi, base + sp.size)
        if a < b:
            out.append(Span(sp.path, sp.start + a - base, sp.start + b - base))
        base += sp.size
    return out


def _byte_at(spans: list[Span], pos: int) -> int:
    (sp,) = _cut(spans, pos, pos + 1)
    with open(sp.path, "rb") as f:
        f.seek(sp.start)
        return f.read(1)[0]


def _char_boundary(spans: list[Span], pos: int, total: int) -> int:
    """Move `pos` forward past UTF-8 continuation bytes, so a split starts on a character."""
    while 0 < pos < total and 0x80 <= _byte_at(spans, pos) < 0xC0:
        pos += 1
    return pos


def _strip_span(sp: Span) -> Span:
    """Span without blank bytes at either end (Transformer-XL's `part.strip()` for text8)."""
    window = 4096
    start, stop = sp.start, sp.stop
    with open(sp.path, "rb") as f:
        while start < stop:
            f.seek(start)
            head = f.read(min(window, stop - start))
            kept = head.lstrip(_BLANKS)
            start += len(head) - len(kept)
            if kept:
                break
        while stop > start:
            n = min(window, stop - start)
            f.seek(stop - n)
            tail = f.read(n)
            kept = tail.rstrip(_BLANKS)
            stop -= len(tail) - len(kept)
            if kept:
                break
    return Span(sp.path, start, stop)


def _drop_newlines(chunks: Iterable[bytes]) -> Iterator[bytes]:
    for c in chunks:
        yield c.replace(b"\n", b"")


def _line_chunks(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """Re-cut a byte stream so every piece ends at a line end (the last one may not)."""
    carry = b""
    for chunk in chunks:
        buf = carry + chunk if carry else chunk
        cut = buf.rfind(b"\n") + 1
        carry = buf[cut:]
        if cut:
            yield buf[:cut]
    if carry:
        yield carry


def _decoded(chunks: Iterable[bytes], where: str) -> Iterator[str]:
    offset = 0
    for chunk in _line_chunks(chunks):
        try:
            yield chunk.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"invalid UTF-8 in {where} near byte {offset + e.start}: "
                             f"{e.reason}") from None
        offset += len(chunk)


def _progress(chunks: Iterable[bytes], total: int, desc: str, enabled: bool) -> Iterator[bytes]:
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
              disable=not enabled) as bar:
        for c in chunks:
            bar.update(len(c))
            yield c


class Corpus:
    """A tokenized benchmark: `vocab`, and per split the byte spans it reads, in order."""

    splits: tuple[str, ...] = SPLITS

    def __init__(self, name: str, vocab: Vocab, spans: dict[str, list[Span]], tokenizer: str,
                 transform: Callable[[Iterable[bytes]], Iterable[bytes]] | None = None,
                 xl_compat: bool = False):
        self.name = name
        self.vocab = vocab
        self.tokenizer = tokenizer
        self.xl_compat = xl_compat
        self._spans = spans
        self._transform = transform  # applied to the raw bytes before tokenizing
        for split in self.splits:
            if self.raw_size(split) == 0:
                files = ", ".join(str(p) for p in self.files(split)) or "(no files)"
                raise ValueError(f"{name}: the {split} split is empty ({files})")

    def _check(self, split: str) -> list[Span]:
        if split not in self._spans:
            raise ValueError(f"{self.name} has no split {split!r}; splits: {self.splits}")
        return self._spans[split]

    def raw_size(self, split: str) -> int:
        """Bytes of raw text in the split (before tokenization and any xl_compat filtering)."""
        return sum(sp.size for sp in self._check(split))

    def files(self, split: str) -> list[Path]:
        return list(dict.fromkeys(sp.path for sp in self._check(split)))

    def raw_chunks(self, split: str, chunk_bytes: int = 1 << 24) -> Iterator[bytes]:
        """The split's bytes, in order, as the tokenizer sees them (xl_compat applied)."""
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
        chunks = _read_spans(self._check(split), chunk_bytes)
        return iter(self._transform(chunks)) if self._transform else chunks

    def iter_tokens(self, split: str, chunk_bytes: int = 1 << 24) -> Iterator[np.ndarray]:
        """ids of the split in corpus order, in pieces of about `chunk_bytes` raw bytes each
        (1-D arrays of `vocab.id_dtype`); their concatenation is `vocab.encode(split text)`."""
        where = f"{self.name} {split} split ({', '.join(str(p) for p in self.files(split))})"
        for ids in self.vocab.encode_stream(self.raw_chunks(split, chunk_bytes), where):
            if ids.size:
                yield ids

    def info(self) -> dict:
        """JSON-serialisable description (for a manifest; the vocabulary is `vocab.to_dict()`)."""
        return {
            "name": self.name,
            "tokenizer": self.tokenizer,
            "xl_compat": self.xl_compat,
            "vocab_kind": self.vocab.kind,
            "vocab_size": self.vocab.size,
            "vocab_fingerprint": self.vocab.fingerprint(),
            "splits": {s: {"raw_bytes": self.raw_size(s),
                           "spans": [[str(sp.path), sp.start, sp.stop] for sp in self._spans[s]]}
                       for s in self.splits},
        }

    def __repr__(self) -> str:
        sizes = ", ".join(f"{s}={self.raw_size(s):,} B" for s in self.splits)
        return f"Corpus({self.name!r}, {self.vocab!r}, {sizes})"


# --------------------------------------------------------------------------- the benchmarks
def _heldout_spans(path: Path, heldout: int, name: str) -> dict[str, list[Span]]:
    """Transformer-XL's enwik8/text8 rule: test = last `heldout` bytes, valid = the `heldout`
    before them, train = the rest."""
    if heldout <= 0:
        raise ValueError(f"heldout_bytes must be > 0, got {heldout}")
    total = path.stat().st_size
    if total <= 2 * heldout:
        raise ValueError(f"{name}: {path} has {total:,} bytes, fewer than the "
                         f"{2 * heldout:,} held out for valid+test (+ at least 1 for train)")
    return {"train": [Span(path, 0, total - 2 * heldout)],
            "valid": [Span(path, total - 2 * heldout, total - heldout)],
            "test": [Span(path, total - heldout, total)]}


def _open_char_benchmark(name, data_dir, download, tokenizer, heldout, xl_compat, progress):
    (path,) = resolve_files(name, data_dir, [[name]], download, progress)
    if heldout is None:
        heldout = HELDOUT_BYTES
        if path.stat().st_size != 100_000_000:
            warnings.warn(f"{path} has {path.stat().st_size:,} bytes; the standard {name} file "
                          "has 100,000,000 (truncated or a different file?)", stacklevel=3)
    spans = _heldout_spans(path, heldout, name)
    xl = xl_compat and tokenizer == "symbols"
    transform = None
    if xl and name == "text8":
        spans = {s: [_strip_span(sp) for sp in v] for s, v in spans.items()}
    if xl and name == "enwik8":
        transform = _drop_newlines
    if tokenizer == "bytes":
        vocab: Vocab = ByteVocab()
    else:
        # Transformer-XL counts symbols over train+valid+test for enwik8/text8 [C].
        every = [sp for s in SPLITS for sp in spans[s]]
        chunks = _progress(_read_spans(every, 1 << 24), sum(sp.size for sp in every),
                           f"{name} symbols", progress)
        vocab = SymbolVocab.build(transform(chunks) if transform else chunks)
    return Corpus(name, vocab, spans, tokenizer, transform, xl_compat=xl)


def _open_word_benchmark(name, data_dir, download, progress, hf_vocab=None):
    if name == "ptb":
        candidates = [[f"ptb.{s}.txt"] for s in SPLITS]
    else:
        sub = _WIKITEXT_DIR[name]
        candidates = [[f"wiki.{s}.tokens", f"{sub}/wiki.{s}.tokens"] for s in SPLITS]
    paths = resolve_files(name, data_dir, candidates, download, progress)
    spans = {s: [Span(p, 0, p.stat().st_size)] for s, p in zip(SPLITS, paths, strict=True)}
    if hf_vocab is not None:  # the raw text, "<unk>" and " @-@ " included, as the model reads it
        return Corpus(name, hf_vocab, spans, "hf")
    counts: Counter[str] = Counter()
    where = f"{name} train split ({paths[0]})"
    chunks = _progress(_read_spans(spans["train"], 1 << 24), spans["train"][0].size,
                       f"{name} vocabulary", progress)
    for text in _decoded(chunks, where):
        counts.update(text.split())  # whitespace split of whole lines == per-line split
    vocab = WordVocab.from_counts(counts, specials=("<eos>",))
    return Corpus(name, vocab, spans, "words")


def _open_text(data_dir, files, tokenizer, bpe_vocab_size, valid_fraction, test_fraction,
               progress, hf_vocab=None):
    if not files or not files.get("train"):
        raise ValueError('the "text" corpus needs files={"train": [globs], "valid": [...], '
                         '"test": [...]} (valid and test optional)')
    unknown = set(files) - set(SPLITS)
    if unknown:
        raise ValueError(f"text corpus: unknown split(s) {sorted(unknown)}; splits: {SPLITS}")
    paths = {s: expand_globs(data_dir, files[s], s) for s in SPLITS if files.get(s)}
    seen: dict[Path, str] = {}
    for s, ps in paths.items():
        for p in ps:
            if p.resolve() in seen:
                raise ValueError(f"text corpus: {p} is in both the {seen[p.resolve()]} and the "
                                 f"{s} split")
            seen[p.resolve()] = s
    spans = {s: [Span(p, 0, p.stat().st_size) for p in ps] for s, ps in paths.items()}
    carve = [s for s in ("valid", "test") if s not in spans]
    if carve:
        frac = {"valid": valid_fraction, "test": test_fraction}
        for s in carve:
            if not 0.0 < frac[s] < 1.0:
                raise ValueError(f"text corpus: no {s} files, and {s}_fraction={frac[s]} cannot "
                                 "carve one from train (need 0 < fraction < 1)")
        train = spans["train"]
        total = sum(sp.size for sp in train)
        sizes = [int(total * frac[s]) for s in carve]
        bounds = [total - sum(sizes)]
        for n in sizes:
            bounds.append(bounds[-1] + n)
        if tokenizer != "bytes":  # a split must start on a whole UTF-8 character
            bounds = [_char_boundary(train, b, total) for b in bounds[:-1]] + [total]
        spans["train"] = _cut(train, 0, bounds[0])
        for i, s in enumerate(carve):
            spans[s] = _cut(train, bounds[i], bounds[i + 1])
            if not spans[s]:
                raise ValueError(f"text corpus: carving {s} ({frac[s]:.3g} of {total} train "
                                 "bytes) leaves it empty; give files or a larger fraction")
        if not spans["train"]:
            raise ValueError("text corpus: carving valid/test leaves train empty")
    train_bytes = sum(sp.size for sp in spans["train"])
    where = "text train split"
    if hf_vocab is not None:
        vocab: Vocab = hf_vocab
    elif tokenizer == "bytes":
        vocab = ByteVocab()
    elif tokenizer == "chars":
        chunks = _progress(_read_spans(spans["train"], 1 << 24), train_bytes, "text characters",
                           progress)
        vocab = SymbolVocab.build_chars(_decoded(chunks, where))
    else:
        chunks = _progress(_read_spans(spans["train"], 1 << 20), train_bytes, "text BPE", progress)
        vocab = BPEVocab.build(_decoded(chunks, where), vocab_size=bpe_vocab_size,
                               progress=False)
    return Corpus("text", vocab, spans, tokenizer)


def open_corpus(name: str, data_dir: str | Path, *, download: bool = False,
                tokenizer: str | None = None, bpe_vocab_size: int = 32000,
                files: dict[str, list[str]] | None = None,
                valid_fraction: float = 0.05, test_fraction: float = 0.05,
                progress: bool = True, heldout_bytes: int | None = None,
                xl_compat: bool = True, tokenizer_revision: str = "",
                tokenizer_gguf_file: str = "") -> Corpus:
    """Open benchmark `name` in `data_dir` (see the module docstring for layouts and splits).

    tokenizer: enwik8/text8 "symbols" (default) or "bytes"; wt103/wt2/ptb "words"; text
    "bytes" (default), "chars" or "bpe" (trained on train with `bpe_vocab_size`); text and
    wt103/wt2/ptb also "hf:<checkpoint dir or hub name>", a pretrained model's own tokenizer
    (at `tokenizer_revision`, or from the GGUF file `tokenizer_gguf_file` in that
    directory; hf_tokenizer.py).
    heldout_bytes: enwik8/text8 size of valid and of test (default 5,000,000).
    xl_compat: Transformer-XL's enwik8/text8 symbol streams (module docstring).
    Relative globs in `files` are taken relative to `data_dir`.
    """
    if name not in CORPORA:
        raise ValueError(f"unknown corpus {name!r}; known corpora: {', '.join(CORPORA)}")
    tokenizer = tokenizer or TOKENIZERS[name][0]
    checkpoint = hf_name(tokenizer)
    if (tokenizer if checkpoint is None else "hf") not in TOKENIZERS[name]:
        known = (t.replace("hf", "hf:<checkpoint>") for t in TOKENIZERS[name])
        raise ValueError(f"{name}: unknown tokenizer {tokenizer!r}; choose from "
                         f"{', '.join(known)}")
    if name != "text" and files:
        raise ValueError(f"files= is for the 'text' corpus; {name} has fixed files")
    if tokenizer_revision and checkpoint is None:
        raise ValueError("a tokenizer revision is for --tokenizer hf:<checkpoint>")
    hf_vocab = None if checkpoint is None else HFVocab.load(checkpoint, tokenizer_revision,
                                                             tokenizer_gguf_file)
    data_dir = Path(data_dir)
    if name in ("enwik8", "text8"):
        return _open_char_benchmark(name, data_dir, download, tokenizer, heldout_bytes,
                                    xl_compat, progress)
    if name in ("wt103", "wt2", "ptb"):
        return _open_word_benchmark(name, data_dir, download, progress, hf_vocab)
    return _open_text(data_dir, files, tokenizer, bpe_vocab_size, valid_fraction, test_fraction,
                      progress, hf_vocab)
