"""Rows of record files (data_pipeline/records.py) -> checked text -> token ids -> the arrays
of episodic samples (data_pipeline/shards.py, "episodes"), for `memtrain prepare --corpus
jsonl|parquet|datasets` (data_pipeline/prepare_records.py; docs/data-formats.md).

Two kinds of row:

- a document (`--field F`): one episode, its ids from position 0, the rest of the row padded
  with `PAD_ID`; the loss is on every target inside the document and on no pad position.
  The token-stream format has no way to mark a document boundary (its only reset is at the
  start of a stream row, data_pipeline/streams.py), so documents are episodes: the memory
  starts fresh at every document, as at every task sample.
- context, question and answer (`--context-field C --question-field Q --answer-field A`):
  BABILong's row exactly (data_pipeline/babilong/assemble.py): [filler][context][question
  prompt][answer field of A ids], right-aligned, the answer field the answer, its stop and
  more stops up to the longest answer of the data set; the loss and the scored positions
  are the answer and its stop. With `--chat-template` the prompt is the tokenizer's chat
  template over one user turn (CHAT_USER) with the generation prompt, and the answer is what
  the template adds for the assistant's turn (its end-of-turn marker included), scored whole.

A bad row (not an object, a field missing, null, not a string, or empty, text the vocabulary
cannot encode, too few tokens) is counted and named in `BadRows`: skipped and reported
(--on-bad-row skip) or the end of the run (--on-bad-row fail).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from .babilong.assemble import (
    ANSWER_TEXT,
    FILLER_TEXT,
    QUESTION_PROMPT,
    STOP_TEXT,
    Layout,
    Row,
    to_arrays,
)
from .records import Input, Where, read_rows
from .vocab import Vocab

POLICIES = ("skip", "fail")
SHOWN_BAD_ROWS = 5      # bad rows listed by name per split; every one is counted per file
PAD_ID = 0              # after a document: read by nothing the loss sees (causal, no loss)
CHAT_USER = "{context}\n\n{question}"   # the user turn of --chat-template


@dataclass(frozen=True)
class Fields:
    """The fields a row is read from: one document field, or context, question and answer."""

    text: str = "text"
    context: str = ""
    question: str = ""
    answer: str = ""

    @property
    def qa(self) -> bool:
        return bool(self.context)

    @property
    def names(self) -> list[str]:
        return [self.context, self.question, self.answer] if self.qa else [self.text]


class BadRows:
    """Bad rows of one split: counted per file, the first SHOWN_BAD_ROWS named; with policy
    "fail" the first one raises ValueError naming the file and row."""

    def __init__(self, policy: str = "skip"):
        if policy not in POLICIES:
            raise ValueError(f"--on-bad-row {policy!r}: choose skip or fail")
        self.policy = policy
        self.per_file: Counter[str] = Counter()
        self.first: list[str] = []

    def add(self, where: Where, reason: str) -> None:
        if self.policy == "fail":
            raise ValueError(f"{where}: {reason} (--on-bad-row fail; the default, skip, "
                             "skips such rows and reports them)")
        self.per_file[where.file] += 1
        if len(self.first) < SHOWN_BAD_ROWS:
            self.first.append(f"{where}: {reason}")

    @property
    def total(self) -> int:
        return sum(self.per_file.values())

    def report(self, split: str) -> list[str]:
        """Lines naming the skipped rows: the count per file, then the first few."""
        if not self.total:
            return []
        lines = [f"{split}: skipped {self.total} bad row{'s' * (self.total != 1)} "
                 "(--on-bad-row skip)"]
        lines += [f"  {name}: {n} bad row{'s' * (n != 1)}" for name, n in self.per_file.items()]
        lines += [f"  {line}" for line in self.first]
        if self.total > len(self.first):
            lines.append(f"  ... and {self.total - len(self.first)} more")
        return lines


def _kind(value) -> str:
    kinds = {dict: "an object", list: "a list", bool: "a boolean", int: "a number",
             float: "a number", str: "a string", bytes: "bytes"}
    return kinds.get(type(value), type(value).__name__)


def row_values(row, names: list[str]) -> tuple[list[str] | None, str]:
    """(the row's strings for `names`, "") or (None, why the row is bad)."""
    if not isinstance(row, dict):
        return None, f"the line holds {_kind(row)}, not a JSON object"
    values = []
    for name in names:
        if name not in row:
            have = ", ".join(sorted(map(str, row))[:8])
            return None, f"no field {name!r}" + (f" (it has {have})" if have else "")
        value = row[name]
        if value is None:
            return None, f"field {name!r} is null"
        if not isinstance(value, str):
            return None, f"field {name!r} is {_kind(value)}, not a string"
        if not value:
            return None, f"field {name!r} is an empty string"
        values.append(value)
    return values, ""


def single_id(vocab: Vocab, text: str, what: str) -> int:
    ids = vocab.encode(text)
    if len(ids) != 1:
        raise ValueError(f"the tokenizer writes the {what} as {len(ids)} tokens; records "
                         "with --context-field need it as one (BABILong's row layout)")
    return int(ids[0])


def plain_texts(fields: Fields, values: list[str]) -> list[str]:
    """The texts a row's ids are made of without a chat template (also what a chars or bpe
    vocabulary learns from): the document; or context, question prompt, answer, stop, and
    the filler that pads rows in front."""
    if not fields.qa:
        return values
    context, question, answer = values
    return [context, QUESTION_PROMPT.format(question=question),
            ANSWER_TEXT.format(answer=answer), STOP_TEXT, FILLER_TEXT]


class Encoder:
    """A row's strings -> (prompt ids, answer ids or None for a document)."""

    def __init__(self, vocab: Vocab, fields: Fields, chat_template: bool = False):
        self.vocab, self.fields, self.chat = vocab, fields, chat_template
        if fields.qa:
            self.stop_id = single_id(vocab, STOP_TEXT, "stop (a newline)")
            self.filler_id = single_id(vocab, FILLER_TEXT, "filler (a blank)")

    def texts(self, values: list[str]) -> list[str]:
        """The texts a row's ids are made of: plain_texts, or the chat template's prompt and
        answer."""
        if self.chat:
            return list(self._chat(*values))
        return plain_texts(self.fields, values)

    def _chat(self, context: str, question: str, answer: str) -> tuple[str, str]:
        tok = self.vocab.tokenizer
        user = [{"role": "user", "content": CHAT_USER.format(context=context,
                                                              question=question)}]
        prompt = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
        whole = tok.apply_chat_template(user + [{"role": "assistant", "content": answer}],
                                        tokenize=False)
        if not whole.startswith(prompt) or len(whole) == len(prompt):
            raise ValueError("--chat-template: the tokenizer's chat template does not write "
                             "a conversation as the generation prompt followed by the "
                             "assistant's turn; the answer cannot be cut from it")
        return prompt, whole[len(prompt):]

    def encode(self, values: list[str]) -> tuple[np.ndarray, np.ndarray | None]:
        texts = self.texts(values)
        if not self.fields.qa:
            return np.asarray(self.vocab.encode(texts[0])), None
        # context, question prompt and answer each encoded alone, as BABILong's pieces are
        # (one encode call per piece: no merge across them)
        parts = [np.asarray(self.vocab.encode(t)) for t in texts[:2 if self.chat else 3]]
        if self.chat:
            return parts[0], parts[1]
        context, question, answer = parts
        stop = np.asarray([self.stop_id], dtype=answer.dtype)
        return np.concatenate([context, question]), np.concatenate([answer, stop])


@dataclass
class SplitRows:
    """The rows of one split that passed, in order, with where each came from."""

    prompts: list[np.ndarray] = field(default_factory=list)
    answers: list[np.ndarray] = field(default_factory=list)   # empty for documents
    wheres: list[Where] = field(default_factory=list)
    text_bytes: list[int] = field(default_factory=list)
    file_bytes: int = 0
    seconds: float = 0.0

    def __len__(self) -> int:
        return len(self.prompts)

    def keep(self, keep: list[bool]) -> None:
        for name in ("prompts", "answers", "wheres", "text_bytes"):
            values = getattr(self, name)
            if values:
                setattr(self, name, [v for v, k in zip(values, keep, strict=True) if k])

    def cut(self, lo: int, hi: int) -> SplitRows:
        return SplitRows(self.prompts[lo:hi], self.answers[lo:hi], self.wheres[lo:hi],
                         self.text_bytes[lo:hi])


def read_split(inputs: list[Input], encoder: Encoder, bad: BadRows) -> SplitRows:
    """Every row of `inputs` checked and encoded; bad ones go to `bad`."""
    out = SplitRows()
    start = time.perf_counter()
    names = encoder.fields.names
    for inp in inputs:
        out.file_bytes += inp.size()
        for where, row in read_rows(inp, names):
            values, why = row_values(row, names)
            if values is None:
                bad.add(where, why)
                continue
            try:
                prompt, answer = encoder.encode(values)
            except ValueError as err:   # a symbol outside a chars vocabulary, bad UTF-8 ...
                bad.add(where, str(err))
                continue
            if answer is None and prompt.size < 2:
                bad.add(where, f"{prompt.size} token{'s' * (prompt.size != 1)}: "
                        "nothing to predict")
                continue
            out.prompts.append(prompt)
            if answer is not None:
                out.answers.append(answer)
            out.wheres.append(where)
            out.text_bytes.append(sum(len(v.encode("utf-8")) for v in values))
    out.seconds = time.perf_counter() - start
    return out


def positions(rows: SplitRows, answer_tokens: int) -> np.ndarray:
    """Target positions each row fills: its ids - 1 (answer field counted whole)."""
    return np.asarray([p.size + answer_tokens - 1 for p in rows.prompts], dtype=np.int64)


def episode_arrays(rows: SplitRows, seq_len: int, answer_tokens: int, encoder: Encoder,
                   dtype: np.dtype):
    """(tokens [N, T+1], loss_mask [N, T], answer_mask [N, T]) of a split's rows."""
    n = len(rows)
    if not encoder.fields.qa:
        tokens = np.full((n, seq_len + 1), PAD_ID, dtype=dtype)
        loss = np.zeros((n, seq_len), dtype=bool)
        for i, ids in enumerate(rows.prompts):
            tokens[i, :ids.size] = ids
            loss[i, :ids.size - 1] = True   # target t is id t + 1: inside the document
        return tokens, loss, loss.copy()
    layout = Layout(encoder.vocab, {}, {}, encoder.stop_id, encoder.filler_id, answer_tokens)
    built = []
    for prompt, answer in zip(rows.prompts, rows.answers, strict=True):
        answer_field = np.full(answer_tokens, encoder.stop_id, dtype=np.int64)
        answer_field[:answer.size] = answer
        built.append(Row(np.concatenate([prompt.astype(np.int64), answer_field]),
                         answer.size, 0))
    tokens, loss, answer_mask = to_arrays(layout, built, seq_len)
    return tokens.astype(dtype), loss, answer_mask
