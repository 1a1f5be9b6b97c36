"""BABILong data sets on disk: one episodic manifest per length, or one holding every
length for a length curriculum (`together`).

    DIR/<length>/manifest.json, shards, <split>.samples.jsonl     (one per length)
    DIR/manifest.json, shards, <split>.samples.jsonl               (together)

Rows and their masks are data_pipeline/babilong/assemble.py's; the samples file has one
JSON object per row, in row order: task, question, target, length (tokens), facts. The
trainer reads the manifest like any task's; `memtrain eval --babilong` also reads the
samples file to score the generated answers.

Seeds. A split's stories depend on (seed, split, task) and not on the length, so every
length of a data set asks the same questions about the same stories (as BABILong adds noise
of growing length to the same bAbI samples): accuracy changes across lengths come from the
length alone. The background drawn for a story depends on the length too.

`together` stores every row right-aligned in the longest length's T; manifest
extra.babilong.length_rows lists, per split, the row range of each length, so a stream can
train on the rows of one length at a time (data_pipeline/streams.py, EpisodeStream). Rows of
length 0 (the story alone) count there by the whole segments they fill, 1, 2, ... (their
rows grouped by that count), so a curriculum stage of n segments also draws the stories
that fill n segments.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..atomic import atomic_write_text
from ..shard_writer import write_episode_split, write_manifest
from ..shards import Manifest, id_dtype
from ..tasks import split_seed
from .assemble import ANSWER_TEXT, QUESTION_PROMPT, STOP_TEXT, Layout, Row, assemble, to_arrays

K = 1024  # "1k" = 1024 tokens: lengths are whole segments of power-of-two sizes


def parse_length(text: str) -> int:
    """'0', '512', '1k', '64k', '1M' -> tokens (k = 1024, M = 1024k). BABILong's published
    lengths are thousands of GPT-2 tokens; its files keep their own labels
    (`--official`)."""
    t = text.strip().lower()
    scale = {"k": K, "m": K * K}.get(t[-1:], 1)
    try:
        n = int(t[:-1] if scale > 1 else t) * scale
    except ValueError:
        raise ValueError(f"length {text!r}: write tokens as 512, 1k, 64k, 1M "
                         "(k = 1024)") from None
    if n < 0:
        raise ValueError(f"length {text!r} is negative")
    return n


def length_label(n: int) -> str:
    """The folder name of a length: 0k, 1k, 64k, or the tokens when not whole k."""
    return f"{n // K}k" if n % K == 0 else str(n)


@dataclass(frozen=True)
class Sample:
    """What one row asks, kept beside the shards for scoring."""
    task: str
    question: str
    target: str
    facts: tuple[str, ...] = ()

    def record(self, length: int) -> dict:
        return {"task": self.task, "question": self.question, "target": self.target,
                "length": length, "facts": list(self.facts)}


def seq_len_of(rows: list[Row], length: int, seg_len: int) -> int:
    """T of a length's rows: the length itself, or for 0 (and the published files, whose
    lengths are in another tokenizer's tokens) the longest row rounded up to whole segments."""
    return length or max(filled_length(0, r, seg_len) for r in rows)


def filled_length(length: int, row: Row, seg_len: int) -> int:
    """The positions a row fills in whole segments: its length, or for 0 (the story alone,
    padded in front) its own positions rounded up to whole segments."""
    return length or -(-(row.ids.size - 1) // seg_len) * seg_len


def check_lengths(lengths: list[int], seg_len: int) -> None:
    if seg_len < 1:
        raise ValueError(f"--seg-len must be >= 1, got {seg_len}")
    if not lengths:
        raise ValueError("give at least one length (--lengths 0,1k,4k)")
    if len(set(lengths)) != len(lengths):
        raise ValueError(f"lengths repeat: {lengths}")
    bad = [n for n in lengths if n % seg_len]
    if bad:
        hints = ", ".join(f"{n} -> {n - n % seg_len} or {n - n % seg_len + seg_len}"
                          for n in bad)
        raise ValueError(f"lengths must be whole segments of --seg-len {seg_len} (the trainer "
                         f"cuts rows into equal segments): {hints}")


def story_rows(layout: Layout, stories, length: int, pool, seed: int, split: str,
               task_index: int) -> list[Row]:
    rng = np.random.default_rng([split_seed(seed, split), task_index, length])
    rows = []
    for i, s in enumerate(stories):
        try:
            rows.append(assemble(layout, s.facts, s.question, s.answer, length, pool, rng))
        except ValueError as err:
            raise ValueError(f"{split} story {i} of {s.task}: {err}; use a longer length or "
                             "0 (the story alone)") from None
    return rows


def write_dataset(out: Path, layout: Layout, split_rows: dict[str, list[tuple[int, Row]]],
                  split_samples: dict[str, list[Sample]], seq_len: int, seg_len: int,
                  meta: dict, samples_per_shard: int, together: bool = False) -> Manifest:
    """Shards, samples files and manifest of one data set in `out`. split_rows[split] is
    the (length, row) of every row in order; split_samples[split] what each asks.
    `together`: length_rows counts each row by the positions it fills (`filled_length`: a
    story alone by its whole segments, not as 0), the buckets a length curriculum draws
    from."""
    out.mkdir(parents=True, exist_ok=True)
    vocab = layout.vocab
    dtype = id_dtype(vocab.size)
    splits, length_rows, top = {}, {}, -1
    for split, pairs in split_rows.items():
        tokens, loss, answer = to_arrays(layout, [r for _, r in pairs], seq_len)
        top = max(top, int(tokens.max()) if tokens.size else -1)
        splits[split] = write_episode_split(out, split, tokens.astype(dtype), loss, answer,
                                            samples_per_shard)
        records = [s.record(n) for s, (n, _) in zip(split_samples[split], pairs, strict=True)]
        atomic_write_text(out / f"{split}.samples.jsonl",
                          "".join(json.dumps(r) + "\n" for r in records))
        length_rows[split] = _ranges([filled_length(n, r, seg_len) if together else n
                                      for n, r in pairs])
    babilong = {**meta, "seg_len": seg_len, "answer_tokens": layout.answer_tokens,
                "labels": {t: list(v) for t, v in layout.labels.items()},
                "layout": {"question_prompt": QUESTION_PROMPT, "answer_text": ANSWER_TEXT,
                           "stop": STOP_TEXT},
                "length_rows": length_rows}
    extra = {"task": "babilong", "seq_len": seq_len, "n_segments": seq_len // seg_len,
             "babilong": babilong}
    if vocab.kind == "hf":
        extra["max_id"] = top
    manifest = Manifest(kind="episodes", source="babilong", vocab=vocab.to_dict(),
                        vocab_fingerprint=vocab.fingerprint(), vocab_size=vocab.size,
                        dtype=str(dtype), chunk_tokens=seq_len + 1, splits=splits,
                        extra=extra)
    write_manifest(out, manifest)
    manifest.location = str(out)
    return manifest


def _ranges(lengths: list[int]) -> list[list[int]]:
    """[[length, first row, end row], ...] of runs of equal lengths."""
    out: list[list[int]] = []
    for i, n in enumerate(lengths):
        if out and out[-1][0] == n and out[-1][2] == i:
            out[-1][2] = i + 1
        else:
            out.append([n, i, i + 1])
    return out


def read_samples(location: str | Path, split: str) -> list[dict]:
    """The samples file of a split, one dict per row."""
    path = Path(location) / f"{split}.samples.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no BABILong samples file (write the data with "
                                "`memtrain tasks babilong`)")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
