"""A pretrained checkpoint's own tokenizer (transformers' AutoTokenizer) as a vocabulary, kind
"hf": `memtrain prepare --tokenizer hf:<dir or hub name>` and `memtrain tasks ... --tokenizer
hf:...` write ids that a pretrained model (`model.backbone: hf`) reads as its own tokens
(docs/pretrained_data_notes.md).

Identity. Whether data fit a model depends on what each id means, so the fingerprint of an "hf"
vocabulary hashes the token -> id map (every entry, added tokens included) and the id range,
not where the tokenizer was loaded from: the same tokenizer read from a hub name and from a
local copy has one fingerprint; two tokenizers of one size that differ in a single token have
two. The manifest's `vocab` also records the name (a local directory as an absolute path) and
the revision, to reload the tokenizer (`vocab_by_kind.vocab_from_dict`).

Size. `size` is the number of ids the tokenizer can produce, max(len(tokenizer), largest id
+ 1). It may differ from the checkpoint config's `vocab_size` (the embedding rows): larger
when tokens were added without resizing the embedding, smaller when the embedding was padded
to a round number. So the data record the largest id they contain (`extra["max_id"]`) and the
trainer refuses ids the embedding does not have, whatever `size` says.

Streaming. A corpus is tokenized as one text per split without special tokens (no BOS/EOS:
the other kinds add none either), in pieces cut at newlines between printable characters
(bpe.LineCutVocab). A piece after a cut is encoded behind a newline anchor whose tokens are
then dropped, because some tokenizers treat the start of an encode call specially (a
SentencePiece-style "▁" prepended to the first word) and a cut must not look like a start.
When loading, a probe text is encoded whole and cut at every line end; a tokenizer that gives
different ids is refused (its ids would depend on where the corpus was cut).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from memtrain.extras import missing_extra

from .bpe import LineCutVocab, safe_pieces
from .vocab import fingerprint

PREFIX = "hf:"      # --tokenizer hf:<checkpoint directory or hub name>
_ANCHOR = "\n"      # what precedes every cut (bpe._safe_newline), and every piece after one
# Letters, digits, spaces, punctuation and three cuts between printable characters.
_PROBE = "the cat sat on a mat.\nit is 12 + 3 = 15, ok?\n(yes)\nthe end\n"


def hf_name(tokenizer: str | None) -> str | None:
    """The checkpoint named by an `hf:<name>` tokenizer option, else None."""
    if tokenizer and tokenizer.startswith(PREFIX):
        name = tokenizer[len(PREFIX):]
        if not name:
            raise ValueError("--tokenizer hf: needs a checkpoint directory or hub name, e.g. "
                             "--tokenizer hf:checkpoints/gpt2")
        return name
    return None


def load_tokenizer(name: str, revision: str = "", gguf_file: str = ""):
    """AutoTokenizer of a checkpoint: a local directory loads with no network; any other name
    is a hub name (transformers' cache, and the network unless HF_HUB_OFFLINE=1). ValueError
    names the checkpoint when it cannot load."""
    from transformers import AutoTokenizer

    local = Path(name).expanduser()
    kwargs: dict = {}
    if local.is_dir():
        name, kwargs["local_files_only"] = str(local.resolve()), True
    elif name.startswith((".", "/", "~")) or local.exists():
        raise ValueError(f"{name} is not a directory (a local checkpoint is the directory "
                         "save_pretrained writes)")
    if revision:
        kwargs["revision"] = revision
    if gguf_file:
        problem = missing_extra("gguf")
        if problem:
            raise ValueError(problem)
        kwargs["gguf_file"] = gguf_file
    try:
        return AutoTokenizer.from_pretrained(name, **kwargs)
    except (OSError, ValueError, TypeError, KeyError) as err:
        first = (str(err).splitlines() or [type(err).__name__])[0]
        raise ValueError(f"cannot load the tokenizer of {name!r}: {first}") from err


def identity(d: dict) -> dict:
    """What makes two "hf" vocabularies the same: the token map and the id range."""
    return {"kind": "hf", "size": int(d["size"]), "token_map_sha256": d["token_map_sha256"]}


def identity_fingerprint(d: dict) -> str:
    """Fingerprint of an "hf" vocabulary description (a manifest's `vocab`)."""
    return fingerprint(identity(d))


class HFVocab(LineCutVocab):
    """A transformers tokenizer behind the `Vocab` interface (module docstring)."""

    kind = "hf"

    def __init__(self, tokenizer, name: str, revision: str = "", gguf_file: str = ""):
        self.tokenizer, self.name, self.revision, self.gguf_file = (tokenizer, name,
                                                                     revision, gguf_file)
        token_map = tokenizer.get_vocab()
        self.size = max(len(tokenizer), max(token_map.values(), default=-1) + 1)
        canon = json.dumps(token_map, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        self.token_map_sha256 = hashlib.sha256(canon.encode("ascii")).hexdigest()
        # The Rust tokenizer behind a fast transformers tokenizer encodes about 1.5x faster
        # than the transformers call around it; used only where both agree on the probe.
        self._backend = None
        backend = getattr(tokenizer, "backend_tokenizer", None) if tokenizer.is_fast else None
        if backend is not None:
            probe = [_PROBE, _ANCHOR + _PROBE]
            if [e.ids for e in backend.encode_batch_fast(probe, add_special_tokens=False)] \
                    == self._ids(probe):
                self._backend = backend
        self._anchor = self._ids([_ANCHOR])[0]
        self._check_pieces()

    @classmethod
    def load(cls, name: str, revision: str = "", gguf_file: str = "") -> HFVocab:
        local = Path(name).expanduser()
        where = str(local.resolve()) if local.is_dir() else name
        return cls(load_tokenizer(name, revision, gguf_file), where, revision, gguf_file)

    def _ids(self, texts: list[str]) -> list[list[int]]:
        if self._backend is not None:
            return [e.ids for e in self._backend.encode_batch_fast(texts,
                                                                   add_special_tokens=False)]
        # verbose=False: a 64k-character piece is longer than model_max_length, which only
        # matters for the model's positions, not for tokenizing a corpus.
        return self.tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]

    def _encode_pieces(self, pieces: list[str], starts_text: bool) -> np.ndarray:
        pieces = [p for p in pieces if p]
        if not pieces:
            return np.zeros(0, dtype=self.id_dtype)
        lead = 1 if starts_text else 0   # pieces[0] begins the text: encoded as it is
        batch = self._ids(pieces[:lead] + [_ANCHOR + p for p in pieces[lead:]])
        k = len(self._anchor)
        for ids in batch[lead:]:
            if ids[:k] != self._anchor:
                raise ValueError(f"the tokenizer of {self.name} merges a line end with the "
                                 "text after it; it cannot tokenize a corpus in pieces")
        parts = batch[:lead] + [ids[k:] for ids in batch[lead:]]
        n = sum(map(len, parts))
        return np.fromiter((i for ids in parts for i in ids), dtype=self.id_dtype, count=n)

    def _check_pieces(self) -> None:
        whole = self._encode_pieces([_PROBE], True)
        if whole.size == 0:
            raise ValueError(f"{self.name} has no tokenizer (loading it gives "
                             f"{type(self.tokenizer).__name__} with {len(self.tokenizer)} "
                             "tokens, which encodes text to nothing); save the tokenizer "
                             "next to the model (tokenizer.save_pretrained)")
        pieces, rest = safe_pieces(_PROBE, 1)
        if not np.array_equal(self._encode_pieces(pieces + [rest], True), whole):
            raise ValueError(f"the tokenizer of {self.name} gives other ids for text cut at "
                             "line ends than for the whole text; memtrain cannot tokenize a "
                             "corpus with it in pieces")

    def decode(self, ids) -> str:
        return self.tokenizer.decode(np.asarray(ids).tolist(), skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)

    def to_dict(self) -> dict:
        d = {"kind": self.kind, "name": self.name, "revision": self.revision,
             "size": self.size, "token_map_sha256": self.token_map_sha256}
        return {**d, "gguf_file": self.gguf_file} if self.gguf_file else d

    def fingerprint(self) -> str:
        return identity_fingerprint(self.to_dict())

    def describe(self) -> str:
        return f"{self.name} ({self.size} ids, {self.fingerprint()[:12]})"

    def single_token_ids(self, symbols: list[str]) -> np.ndarray:
        """For each symbol (one character of an algorithmic task, tasks.symbol_chars) the id
        of the one token that reads as exactly that symbol: the vocabulary entry spelled so,
        else the single id the tokenizer encodes it to. Special tokens never serve. Raises
        ValueError naming a symbol without such a token, or two symbols on one id."""
        token_map = self.tokenizer.get_vocab()
        special = set(self.tokenizer.all_special_ids)

        def reads_as(i, s) -> bool:
            return i is not None and i not in special and self.decode([i]) == s

        ids = []
        for s in symbols:
            i = token_map.get(s)
            if not reads_as(i, s):
                enc = self._ids([s])[0]
                i = enc[0] if len(enc) == 1 and reads_as(enc[0], s) else None
            if i is None:
                raise ValueError(f"the tokenizer of {self.name} has no single token that "
                                 f"reads as the task symbol {s!r}")
            ids.append(i)
        if len(set(ids)) != len(ids):
            raise ValueError(f"the tokenizer of {self.name} reads two task symbols as one "
                             f"token ({dict(zip(symbols, ids, strict=True))})")
        return np.asarray(ids, dtype=np.int64)
