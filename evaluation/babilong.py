"""`memtrain eval --babilong DIR`: accuracy per bAbI task and context length, BABILong's table.

BABILong (Kuratov et al. 2024, §3 and Fig. 1) hides the facts of the bAbI tasks (Weston et
al. 2015) in long background text and reports the accuracy of each task at each length. DIR
holds one episodic data set per length (DIR/<label>/manifest.json with
extra["babilong"], and <split>.samples.jsonl with each row's task, question and target, as
`memtrain tasks babilong` writes them). For every length and task:

- the prompt is each row's first T + 1 - A ids (the answer field is the last A ids: the
  answer, its stop, more stops), the same length for every row of a folder, so rows go
  through the model in batches;
- the prompt is read with the memory carried from segment to segment at the evaluation
  segment length, and up to A ids are generated greedily (model/generate.py
  stream_generate with top_k = 1, exactly as `memtrain generate` reads a long prompt), for
  any mechanism through the memory-state protocol;
- the generated ids are decoded with the data's vocabulary, cut at the first stop, and
  scored with BABILong's rule (evaluation/babilong_score.py is_correct).

Rows are read shard member by shard member, a batch at a time, so a 64k folder never sits
in memory whole: peak memory follows the batch and the model's memory, not the length.
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from data_pipeline.shards import (
    MANIFEST,
    Manifest,
    ShardError,
    content_sha256,
    iter_shard_members,
    load_manifest,
)
from data_pipeline.vocab_by_kind import vocab_from_dict
from model import stream_generate
from train.regime import regime_of

# What ends an answer in a row (data_pipeline/babilong/assemble.py: the stop after the
# answer is a newline, and the rest of the answer field repeats it).
STOP_TEXT = "\n"
EXAMPLES_PER_CELL = 3    # outputs kept in the report per (task, length), to read what failed


@dataclass
class LengthFolder:
    """One length of a BABILong data set: its manifest and per-row records."""
    path: Path
    manifest: Manifest
    label: str              # the folder's name, e.g. "4k"
    length: int             # tokens, manifest.extra["babilong"]["length"]
    tasks: list[str]
    labels: dict[str, list[str]]
    answer_tokens: int      # A

    def samples_path(self, split: str) -> Path:
        return self.path / f"{split}.samples.jsonl"


@dataclass
class Cell:
    """The score of one task at one length."""
    task: str
    length: int
    label: str
    n: int = 0
    correct: int = 0
    chance: float = 0.0
    examples: list[dict] = field(default_factory=list)

    @property
    def accuracy(self) -> float:
        return self.correct / self.n if self.n else float("nan")

    def as_dict(self) -> dict:
        return {"task": self.task, "length": self.length, "label": self.label, "n": self.n,
                "correct": self.correct, "accuracy": self.accuracy, "chance": self.chance,
                "examples": self.examples}


# ---------------------------------------------------------------------------- the folders
def _read_folder(path: Path) -> LengthFolder:
    manifest = load_manifest(path)
    info = regime_of(manifest).task_spec("babilong")   # None: not task samples
    if not isinstance(info, dict):
        raise ValueError(f"{path} is not a BABILong length folder: its manifest holds "
                         f"{manifest.kind!r} data of {manifest.source!r} without "
                         "extra.babilong (write one with `memtrain tasks babilong`)")
    try:
        labels = {t: [str(x) for x in ls] for t, ls in info["labels"].items()}
        folder = LengthFolder(path, manifest, path.name, int(info["length"]),
                              [str(t) for t in info["tasks"]], labels,
                              int(info["answer_tokens"]))
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise ValueError(f"{path}/{MANIFEST}: extra.babilong lacks or garbles {err} (needs "
                         "tasks, length, answer_tokens, labels)") from None
    if not 1 <= folder.answer_tokens < manifest.chunk_tokens:
        raise ValueError(f"{path}: answer_tokens {folder.answer_tokens} leaves no prompt in "
                         f"rows of {manifest.chunk_tokens} ids")
    return folder


def find_folders(root: str | Path, split: str, tasks: list[str] | None = None,
                 lengths: list[str] | None = None) -> tuple[list[LengthFolder], list[str]]:
    """(the length folders to score, sorted by length; the tasks to score). Refuses (with
    ValueError naming what is wrong) a root without length folders, a folder in another
    format, a task or length the data do not have, and folders of different vocabularies."""
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"--babilong {root}: not a directory")
    subdirs = sorted(p for p in root.iterdir() if p.is_dir())
    if not subdirs:
        raise ValueError(f"--babilong {root}: no length folders (expected {root}/<length>/"
                         f"{MANIFEST}, as `memtrain tasks babilong --out {root}` writes)")
    others = [p.name for p in subdirs if not (p / MANIFEST).is_file()]
    if others:
        raise ValueError(f"--babilong {root}: {', '.join(others)} holds no {MANIFEST}: not a "
                         "BABILong length folder")
    folders = sorted((_read_folder(p) for p in subdirs), key=lambda f: (f.length, f.label))
    if lengths:
        known = {f.label: f for f in folders} | {str(f.length): f for f in folders}
        missing = [x for x in lengths if x not in known]
        if missing:
            raise ValueError(f"--lengths {','.join(missing)}: not in {root} (it has "
                             f"{', '.join(f.label for f in folders)})")
        wanted = {id(known[x]) for x in lengths}
        folders = [f for f in folders if id(f) in wanted]
    have = list(dict.fromkeys(t for f in folders for t in f.tasks))
    if tasks:
        missing = [t for t in tasks if t not in have]
        if missing:
            raise ValueError(f"--tasks {','.join(missing)}: not in the data at {root} (it has "
                             f"{', '.join(have)})")
    prints = {f.manifest.vocab_fingerprint for f in folders}
    if len(prints) > 1:
        raise ValueError(f"--babilong {root}: the length folders were written with different "
                         "vocabularies; score each tokenizer's data separately")
    for f in folders:
        f.manifest.split(split)  # ShardError naming the splits it has
        if not f.samples_path(split).is_file():
            raise ValueError(f"{f.path}: no {split}.samples.jsonl (the per-row task, question "
                             "and target BABILong scores with)")
    return folders, list(tasks or have)


# ---------------------------------------------------------------------------- the rows
def _npy(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


def iter_batches(folder: LengthFolder, split: str, batch: int, tasks: list[str],
                 samples: int = 0, url_template: str | None = None
                 ) -> Iterator[tuple[np.ndarray, list[dict]]]:
    """(tokens [b, T + 1], their records) of the rows of `tasks`, at most `samples` per task
    (0: all), `batch` at a time in row order. Shards are read member by member, checked as
    data_pipeline/shards.py read_episodes checks them, and never held whole."""
    manifest, wanted = folder.manifest, set(tasks)
    taken = dict.fromkeys(tasks, 0)
    toks: list[np.ndarray] = []
    recs: list[dict] = []
    index = 0
    with open(folder.samples_path(split), encoding="utf-8") as lines:
        for shard in manifest.split(split).shards:
            url = manifest.shard_url(shard, url_template)
            for member in iter_shard_members(url):
                line = lines.readline()
                if not line:
                    raise ValueError(f"{folder.samples_path(split)}: {index} records for more "
                                     "rows in the shards")
                rec = json.loads(line)
                task = rec.get("task")
                if task not in wanted or (samples and taken[task] >= samples):
                    index += 1
                    continue
                meta = json.loads(member["meta.json"])
                arrays = [_npy(member[k]) for k in ("tokens.npy", "loss_mask.npy",
                                                           "answer_mask.npy")]
                if meta.get("index") != index or content_sha256(*arrays) != meta.get("sha256"):
                    raise ShardError(f"{url}: sample {index} is corrupted or out of place")
                taken[task] += 1
                toks.append(arrays[0].astype(np.int64))
                recs.append(rec)
                index += 1
                if len(toks) == batch:
                    yield np.stack(toks), recs
                    toks, recs = [], []
                if samples and all(n >= samples for n in taken.values()):
                    break  # every task has its samples: the rest of the split is not read
            else:
                continue
            break
    if toks:
        yield np.stack(toks), recs


# ---------------------------------------------------------------------------- scoring
def _score_fn():
    # BABILong's correctness rule lives beside this module (evaluation/babilong_score.py).
    from .babilong_score import is_correct
    return is_correct


def stop_text(folder: LengthFolder) -> str:
    """What ends an answer: the data set's stop as its manifest records it, else a newline."""
    layout = folder.manifest.extra["babilong"].get("layout")
    stop = layout.get("stop") if isinstance(layout, dict) else None
    return stop if isinstance(stop, str) and stop else STOP_TEXT


def decode_answer(vocab, ids: list[int], stop: str = STOP_TEXT) -> str:
    """The generated answer as text, up to its stop."""
    return vocab.decode(ids).split(stop, 1)[0]


@torch.no_grad()
def generate_answers(model, prompt: torch.Tensor, max_new: int, seg_len: int) -> torch.Tensor:
    """[B, max_new] greedy continuations of prompt [B, P], the memory carried segment by
    segment (model/generate.py: whole segments committed, the open one read per token:
    re-run by the native stack, extended through a KV cache by a pretrained backbone)."""
    # top_k = 1 keeps only the most likely id (ties aside, which a seeded draw settles).
    gen = torch.Generator(device=prompt.device).manual_seed(0)
    out = list(stream_generate(model, prompt, max_new, top_k=1, seg_len=seg_len,
                               generator=gen))
    return torch.stack(out, dim=1)


def score_folder(model, folder: LengthFolder, split: str, tasks: list[str], *, seg_len: int,
                 batch: int, device: torch.device, vocab=None, samples: int = 0,
                 score: Callable | None = None, url_template: str | None = None
                 ) -> tuple[dict[str, Cell], int]:
    """({task: Cell} of one length folder, ids read and generated)."""
    score = score or _score_fn()
    vocab = vocab or vocab_from_dict(folder.manifest.vocab)
    a, stop = folder.answer_tokens, stop_text(folder)
    cells = {t: Cell(t, folder.length, folder.label,
                     chance=1 / len(folder.labels[t]) if folder.labels.get(t) else float("nan"))
             for t in tasks if t in folder.tasks}
    n_ids = 0
    for toks, recs in iter_batches(folder, split, batch, list(cells), samples, url_template):
        prompt = torch.from_numpy(toks[:, :-a]).to(device)
        new = generate_answers(model, prompt, a, seg_len).tolist()
        n_ids += prompt.numel() + len(recs) * a
        for rec, ids in zip(recs, new, strict=True):
            cell = cells[rec["task"]]
            output = decode_answer(vocab, ids, stop)
            ok = bool(score(output, rec["target"], rec["question"], folder.labels[cell.task]))
            cell.n += 1
            cell.correct += ok
            if len(cell.examples) < EXAMPLES_PER_CELL:
                cell.examples.append({"question": rec["question"], "target": rec["target"],
                                      "output": output, "correct": ok})
    return cells, n_ids


def evaluate_babilong(model, folders: list[LengthFolder], split: str, tasks: list[str], *,
                      seg_len: int, batch: int, device: torch.device, samples: int = 0,
                      score: Callable | None = None, url_template: str | None = None,
                      progress: Callable[[str], None] | None = None) -> dict:
    """Every (task, length) cell of `folders`; the model is switched to eval mode and back."""
    was_training = model.training
    model.eval()
    cells: list[Cell] = []
    start, n_ids = time.perf_counter(), 0
    vocab = vocab_from_dict(folders[0].manifest.vocab)
    try:
        for folder in folders:
            t0 = time.perf_counter()
            got, ids = score_folder(model, folder, split, tasks, seg_len=seg_len, batch=batch,
                                    device=device, vocab=vocab, samples=samples, score=score,
                                    url_template=url_template)
            n_ids += ids
            cells += [got[t] for t in tasks if t in got]
            if progress:
                progress(f"{folder.label} ({folder.length} tokens): " + ", ".join(
                    f"{c.task} {c.accuracy:.3f} (n={c.n})" for c in got.values())
                    + f" [{time.perf_counter() - t0:.1f} s]")
    finally:
        model.train(was_training)
    seconds = time.perf_counter() - start
    return {"split": split, "tasks": tasks, "seg_len": seg_len, "batch": batch,
            "samples_per_task": samples,
            "lengths": [{"label": f.label, "length": f.length, "folder": str(f.path)}
                        for f in folders],
            "cells": [c.as_dict() for c in cells], "ids": n_ids, "seconds": seconds,
            "ids_per_s": n_ids / seconds if seconds > 0 else float("nan")}
