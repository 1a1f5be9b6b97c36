"""Every vocabulary kind by name: rebuild a vocabulary from its `to_dict()` (what the shard
manifest stores)."""

from __future__ import annotations

from .bpe import BPEVocab
from .vocab import EOS, ByteVocab, SymbolVocab, Vocab, WordVocab


def vocab_from_dict(d: dict) -> Vocab:
    kind = d.get("kind")
    if kind == "bytes":
        return ByteVocab()
    if kind == "symbols":
        return SymbolVocab(d["symbols"], unit=d.get("unit", "bytes"))
    if kind == "words":
        return WordVocab(d["words"], d.get("specials", (EOS,)), eos=d.get("eos", EOS))
    if kind == "bpe":
        return BPEVocab(d["tokenizer"])
    raise ValueError(f"unknown vocabulary kind {kind!r}; known: bytes, symbols, words, bpe")
