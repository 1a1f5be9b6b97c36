"""Every vocabulary kind by name: rebuild a vocabulary from its `to_dict()` (what the shard
manifest stores). An "hf" vocabulary is reloaded from the checkpoint it names
(hf_tokenizer.py)."""

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
    if kind == "hf":
        # The tokenizer is not in the manifest: reload it where the data were prepared with
        # it, and check it is still that tokenizer.
        from .hf_tokenizer import HFVocab, identity_fingerprint
        vocab = HFVocab.load(d["name"], d.get("revision", ""), d.get("gguf_file", ""))
        if vocab.fingerprint() != identity_fingerprint(d):
            raise ValueError(f"the tokenizer at {d['name']} is no longer the one the data "
                             f"were prepared with ({vocab.describe()})")
        return vocab
    raise ValueError(f"unknown vocabulary kind {kind!r}; known: bytes, symbols, words, bpe, "
                     "hf")
