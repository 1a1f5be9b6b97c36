"""Byte-level BPE vocabulary (`tokenizers`), the fourth kind of `vocab.Vocab`.

Long texts are encoded in pieces cut only where the cut cannot change the result (see
`_safe_newline`), so `encode_stream` over arbitrary chunks equals `encode` of the whole.
`LineCutVocab` holds that cutting for every subword kind (BPEVocab here, the pretrained
checkpoints' tokenizers in hf_tokenizer.py).
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Iterator

import numpy as np

from .vocab import Vocab, as_text, located

# A cut right after "\n" with printable, non-space ASCII on both sides leaves the byte-level
# pre-tokenizer's pieces unchanged (GPT-2 split regex: the lone "\n" is its own piece either
# way and nothing joins across it), so encoding the two sides separately equals encoding the
# whole. Any other cut (inside a word, inside a whitespace run) may change the BPE pieces.
_BPE_PIECE_CHARS = 1 << 16  # encode_batch pieces: big enough to amortise, small enough to spread


def _safe_newline(text: str, j: int) -> bool:
    return 0 < j < len(text) - 1 and "!" <= text[j - 1] <= "~" and "!" <= text[j + 1] <= "~"


def _next_safe_cut(text: str, pos: int) -> int | None:
    while (j := text.find("\n", pos)) >= 0:
        if _safe_newline(text, j):
            return j + 1
        pos = j + 1
    return None


def _last_safe_cut(text: str, lo: int) -> int | None:
    end = len(text)
    while (j := text.rfind("\n", lo, end)) >= 0:
        if _safe_newline(text, j):
            return j + 1
        end = j
    return None


def safe_pieces(text: str, piece: int) -> tuple[list[str], str]:
    """Split text at safe cuts into pieces of about `piece` characters; return (pieces, rest)
    where `rest` (after the last safe cut) may still join with what follows."""
    pieces: list[str] = []
    start = 0
    while start + piece < len(text) and (cut := _next_safe_cut(text, start + piece)) is not None:
        pieces.append(text[start:cut])
        start = cut
    cut = _last_safe_cut(text, start + 1)
    if cut is not None:
        pieces.append(text[start:cut])
        start = cut
    return pieces, text[start:]


class LineCutVocab(Vocab):
    """A subword vocabulary that encodes long text in pieces cut at safe newlines
    (`safe_pieces`). Subclasses implement `_encode_pieces(pieces, starts_text)`: the ids of
    the pieces' concatenation, where `starts_text` says whether the first piece begins the
    text (every other piece follows a cut right after a newline)."""

    def _encode_pieces(self, pieces: list[str], starts_text: bool) -> np.ndarray:
        raise NotImplementedError

    def encode(self, text: str | bytes, where: str = "") -> np.ndarray:
        pieces, rest = safe_pieces(as_text(text, where), _BPE_PIECE_CHARS)
        return self._encode_pieces(pieces + [rest], True)

    def encode_stream(self, chunks: Iterable[bytes], where: str = "") -> Iterator[np.ndarray]:
        dec = codecs.getincrementaldecoder("utf-8")()
        carry = ""
        offset = 0
        started = False  # a piece was encoded: the next ones follow a cut
        try:
            for chunk in chunks:
                pieces, carry = safe_pieces(carry + dec.decode(chunk), _BPE_PIECE_CHARS)
                offset += len(chunk)
                if pieces:
                    yield self._encode_pieces(pieces, not started)
                    started = True
            carry += dec.decode(b"", final=True)
        except UnicodeDecodeError as e:
            raise ValueError(f"invalid UTF-8{located(where)} near byte {offset + e.start}: "
                             f"{e.reason}") from None
        if carry:
            yield self._encode_pieces([carry], not started)


class BPEVocab(LineCutVocab):
    """Byte-level BPE (`tokenizers`): GPT-2 pre-tokenization, no prefix space, no specials, so
    decode(encode(text)) == text for any text. `to_dict` keeps the tokenizer's own JSON."""

    kind = "bpe"

    def __init__(self, tokenizer_json: str):
        from tokenizers import Tokenizer

        self.tokenizer_json = tokenizer_json
        self.tokenizer = Tokenizer.from_str(tokenizer_json)
        self.size = self.tokenizer.get_vocab_size(with_added_tokens=True)

    @classmethod
    def build(cls, texts: Iterable[str], vocab_size: int = 32000, min_frequency: int = 2,
              progress: bool = False) -> BPEVocab:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        if vocab_size <= 256:
            raise ValueError(f"byte-level BPE needs vocab_size > 256 (the byte alphabet), "
                             f"got {vocab_size}")
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                      show_progress=progress, special_tokens=[],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator([texts] if isinstance(texts, str) else texts, trainer=trainer)
        return cls(tok.to_str())

    def _encode_pieces(self, pieces: list[str], starts_text: bool = True) -> np.ndarray:
        # A byte-level BPE piece after a safe cut encodes as it does inside the whole text.
        pieces = [p for p in pieces if p]
        if not pieces:
            return np.zeros(0, dtype=self.id_dtype)
        encs = self.tokenizer.encode_batch_fast(pieces, add_special_tokens=False)
        n = sum(len(e.ids) for e in encs)
        return np.fromiter((i for e in encs for i in e.ids), dtype=self.id_dtype, count=n)

    def decode(self, ids) -> str:
        return self.tokenizer.decode(np.asarray(ids).tolist(), skip_special_tokens=False)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "tokenizer": self.tokenizer_json}
