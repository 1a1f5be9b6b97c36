"""The background text that hides the facts (BABILong §2: PG19 books; here any text the user
gives, or a corpus `memtrain prepare` reads).

Each split draws from its own part of the text: a corpus's own train/valid/test files, or,
for plain text files, the train files with valid and test carved from their end
(data_pipeline/corpora.py). So train, valid and test samples share no background passage.

The text of a split becomes a pool of sentences, each tokenized once, with a leading space,
by the model's own tokenizer (so a sample's length is counted in the tokens the model will
read). A sample's background is a run of consecutive sentences from a random start in the
pool (wrapping round at its end), as BABILong reads a book from a random place; the first
sentence is cut at its front so that the run fills the requested length exactly.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import numpy as np

from ..vocab import Vocab

# A sentence ends at . ! or ? followed by white space (or a closing quote first); blank
# lines end one too. Good enough for prose; the pieces only need to be sentence-like, since
# the facts go between them.
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+|\n\s*\n")
_SPACES = re.compile(r"\s+")
MIN_SENTENCES = 2  # a pool needs at least two boundaries to place facts between


def split_sentences(text: str) -> list[str]:
    """The sentences of `text`, white space inside each collapsed to one blank."""
    out = []
    for piece in _SENTENCE_END.split(text):
        piece = _SPACES.sub(" ", piece).strip()
        if piece:
            out.append(piece)
    return out


class SentencePool:
    """The tokenized sentences of one split's background text."""

    def __init__(self, texts: Iterable[str], vocab: Vocab, where: str):
        self.where = where
        self.sentences = [s for text in texts for s in split_sentences(text)]
        if len(self.sentences) < MIN_SENTENCES:
            raise ValueError(f"{where}: the background text has {len(self.sentences)} "
                             f"sentence(s); give at least {MIN_SENTENCES}")
        self.vocab = vocab
        self._ids: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.sentences)

    def ids(self, i: int) -> np.ndarray:
        """Token ids of sentence i (with its leading blank), tokenized on first use."""
        ids = self._ids.get(i)
        if ids is None:
            ids = np.asarray(self.vocab.encode(" " + self.sentences[i]), dtype=np.int64)
            self._ids[i] = ids
        return ids

    def draw(self, rng: np.random.Generator, n_tokens: int) -> list[np.ndarray]:
        """Consecutive sentences from a random start whose tokens add up to exactly
        `n_tokens`: the first is cut at its front where needed (the text opens mid-sentence,
        as a book opened at a random place), so the last one before the question is whole.
        [] for 0."""
        out: list[np.ndarray] = []
        if n_tokens <= 0:
            return out
        i, have = int(rng.integers(len(self))), 0
        start = i
        while have < n_tokens:
            ids = self.ids(i)
            out.append(ids)
            have += ids.size
            i = (i + 1) % len(self)
            if i == start and have == 0:
                raise ValueError(f"{self.where}: the background sentences encode to no tokens")
        excess = have - n_tokens           # < the last sentence's size: cut from the front
        while excess >= out[0].size:
            excess -= out.pop(0).size
        out[0] = out[0][excess:]
        return [ids for ids in out if ids.size]


def corpus_pools(corpus, splits: Iterable[str]) -> dict[str, SentencePool]:
    """One SentencePool per split of a data_pipeline.corpora.Corpus (its own files, or the
    text carved into splits), read whole: background texts are books, not web crawls."""
    pools = {}
    for split in splits:
        data = b"".join(corpus.raw_chunks(split))
        files = ", ".join(str(p) for p in corpus.files(split))
        where = f"{corpus.name} {split} split ({files})"
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"{where}: not UTF-8 text ({err})") from None
        pools[split] = SentencePool([text], corpus.vocab, where)
    return pools
