"""One BABILong sample as a row of token ids: the facts of a bAbI story scattered through
background text, the question at the end, then the answer (BABILong §2, Fig. 1).

    row (T + 1 ids) = [filler][background with the facts between its sentences]
                      [question prompt][answer][stop][stop ...]
                      '--------------- prompt: T + 1 - A ---------------''-- answer field: A --'

Every row of a data set has the same T (the trainer cuts rows into equal segments) and its
answer field is the last A ids, A = the longest answer of the task's label set + the stop.
So every prompt of a data set has the same length, and generation is batched.

- `length` is the sample's length in the model's tokens, T: the context, question and
  answer together. 0 is BABILong's "0k": the story alone; such rows are padded at the front
  with filler (a blank) up to the data set's T.
- The facts keep their order and go between background sentences at random boundaries
  (BABILong inserts each fact at a random place in the noise, in order).
- The training loss and the scored positions are the answer and its stop: the model also
  learns to end its answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..vocab import Vocab
from .background import SentencePool

QUESTION_PROMPT = "\nQuestion: {question}\nAnswer:"
ANSWER_TEXT = " {answer}"
STOP_TEXT = "\n"
FILLER_TEXT = " "


@dataclass(frozen=True)
class Layout:
    """The fixed pieces of a data set's rows, in one tokenizer's ids."""
    vocab: Vocab
    labels: dict[str, tuple[str, ...]]     # task -> its answer labels
    answer_ids: dict[str, np.ndarray]       # label -> ids of ANSWER_TEXT
    stop_id: int
    filler_id: int
    answer_tokens: int                      # A

    @classmethod
    def build(cls, vocab: Vocab, labels: dict[str, tuple[str, ...]],
              targets: tuple[str, ...] = ()) -> Layout:
        """`labels`: each task's answer labels (what scoring looks for); `targets`: answers
        that are no label of their own but labels joined by commas (qa8 "apple,milk"),
        written as answers without joining the label sets."""
        stop, filler = vocab.encode(STOP_TEXT), vocab.encode(FILLER_TEXT)
        for name, ids in (("stop (a newline)", stop), ("filler (a blank)", filler)):
            if len(ids) != 1:
                raise ValueError(f"the tokenizer writes the {name} as {len(ids)} tokens; "
                                 "BABILong rows need it as one")
        spelled = [label for task_labels in labels.values() for label in task_labels]
        answers = {label: np.asarray(vocab.encode(ANSWER_TEXT.format(answer=label)), np.int64)
                   for label in [*spelled, *targets]}
        longest = max(a.size for a in answers.values())
        return cls(vocab, labels, answers, int(stop[0]), int(filler[0]), longest + 1)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.vocab.encode(text), dtype=np.int64)

    def question_ids(self, question: str) -> np.ndarray:
        return self.encode(QUESTION_PROMPT.format(question=question))

    def fact_ids(self, facts) -> list[np.ndarray]:
        return [self.encode(" " + fact) for fact in facts]

    def answer_field(self, answer: str) -> tuple[np.ndarray, int]:
        """(the A ids of the answer field, how many of them are answer + stop)."""
        ids = self.answer_ids.get(answer)
        if ids is None:
            raise ValueError(f"answer {answer!r} is not a label of the tasks "
                             f"({sorted(self.answer_ids)})")
        field = np.full(self.answer_tokens, self.stop_id, dtype=np.int64)
        field[:ids.size] = ids
        return field, ids.size + 1


@dataclass
class Row:
    ids: np.ndarray          # [n] ids without front filler (n <= T + 1)
    scored: int              # answer + stop ids at the start of the answer field
    background_tokens: int


def story_tokens(layout: Layout, facts, question: str) -> int:
    """Ids the story takes in a row besides background: facts, question, answer field."""
    return (sum(f.size for f in layout.fact_ids(facts)) + layout.question_ids(question).size
            + layout.answer_tokens)


def assemble(layout: Layout, facts, question: str, answer: str, length: int,
             pool: SentencePool | None, rng: np.random.Generator) -> Row:
    """The row of one story at `length` tokens (0: the story alone). Raises ValueError when
    the story alone is longer than `length`."""
    fact_ids = layout.fact_ids(facts)
    question_ids = layout.question_ids(question)
    field, scored = layout.answer_field(answer)
    story = sum(f.size for f in fact_ids) + question_ids.size + field.size
    pieces: list[np.ndarray]
    n_background = 0
    if length == 0:
        pieces = fact_ids
    else:
        # T positions are T + 1 ids: input = row[:-1], target = row[1:].
        n_background = length + 1 - story
        if n_background < 0:
            raise ValueError(f"a story of {story} tokens does not fit in {length} tokens")
        if pool is None:
            raise ValueError("a length above 0 needs background text")
        sentences = pool.draw(rng, n_background)
        # Facts go between sentences: boundary j is before sentence j; len(sentences) means
        # just before the question. Not before the first piece, which may start mid-sentence.
        first = min(1, len(sentences))
        where = np.sort(rng.integers(first, len(sentences) + 1, size=len(fact_ids)))
        pieces, f = [], 0
        for j in range(len(sentences) + 1):
            while f < len(fact_ids) and where[f] == j:
                pieces.append(fact_ids[f])
                f += 1
            if j < len(sentences):
                pieces.append(sentences[j])
    ids = np.concatenate([*pieces, question_ids, field]) if pieces else \
        np.concatenate([question_ids, field])
    return Row(ids, scored, n_background)


def to_arrays(layout: Layout, rows: list[Row], seq_len: int):
    """(tokens [N, T+1], loss_mask [N, T], answer_mask [N, T]) with each row right-aligned
    (filler in front)."""
    n = len(rows)
    tokens = np.full((n, seq_len + 1), layout.filler_id, dtype=np.int64)
    loss = np.zeros((n, seq_len), dtype=bool)
    a = layout.answer_tokens
    for i, row in enumerate(rows):
        if row.ids.size > seq_len + 1:
            raise ValueError(f"row {i} has {row.ids.size} ids, more than {seq_len + 1}")
        tokens[i, seq_len + 1 - row.ids.size:] = row.ids
        # Target position t predicts id t + 1: the answer field starts at target T - A.
        loss[i, seq_len - a:seq_len - a + row.scored] = True
    return tokens, loss, loss.copy()
