"""`memtrain tasks babilong`: BABILong-style samples, generated offline and seeded.

    memtrain tasks babilong --tasks qa1,qa2 --lengths 0,1k,4k --seg-len 128 \\
        --background 'books/*.txt' --out data/babilong
    memtrain tasks babilong --corpus wt103 --data-dir data/raw --tokenizer hf:ckpt/gpt2 ...
    memtrain tasks babilong --official hub/RMT-team/babilong --lengths 0k,1k --out ...

One data set per length in <out>/<length>/ (see build.py), or with --together one data set
holding every length for a length curriculum. Sizes are per task. The same seed writes the
same bytes. Background: plain text files (valid and test carved from the end of the train
text unless given), or any corpus `memtrain prepare` reads; BABILong's own is PG19
(`--background 'pg19/train/*.txt' --background-valid 'pg19/validation/*.txt'
--background-test 'pg19/test/*.txt'`). --official reads BABILong's published files from
local disk instead of generating (test split only: they are test sets).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from memtrain.command_line import CommandParser, error_line

from ..tasks import split_seed
from .assemble import Layout, Row, assemble
from .build import (
    Sample,
    check_lengths,
    filled_length,
    length_label,
    parse_length,
    seq_len_of,
    story_rows,
    write_dataset,
)

SPLITS = ("train", "valid", "test")
DEFAULT_SIZES = {"train": 1000, "valid": 100, "test": 100}   # per task; BABILong tests 100


def _parser() -> argparse.ArgumentParser:
    p = CommandParser(prog="memtrain tasks babilong", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--tasks", default="qa1", help="comma-separated, of qa1..qa5 (default "
                   "qa1; with --official qa1..qa20)")
    p.add_argument("--lengths", required=True,
                   help="sample lengths in the model's tokens, e.g. 0,1k,4k (k = 1024; 0 = "
                        "the story alone)")
    p.add_argument("--seg-len", type=int, required=True,
                   help="the model's segment length: lengths must be whole segments")
    src = p.add_argument_group("background text (not with --official)")
    src.add_argument("--background", nargs="+", metavar="FILE_OR_GLOB",
                     help="plain text files: the train split's background")
    src.add_argument("--background-valid", nargs="+", metavar="FILE_OR_GLOB")
    src.add_argument("--background-test", nargs="+", metavar="FILE_OR_GLOB")
    src.add_argument("--corpus", help="instead: a corpus memtrain prepare reads (wt103, wt2, "
                     "ptb, enwik8, text8), its own splits")
    src.add_argument("--data-dir", default=".", help="where --corpus files are / relative "
                     "--background globs start (default: here)")
    p.add_argument("--tokenizer", default="bytes",
                   help="bytes (default), chars, bpe or hf:<checkpoint>: the model's tokens")
    p.add_argument("--tokenizer-revision", default="")
    p.add_argument("--tokenizer-gguf-file", default="",
                   help="with hf:<directory>: read the tokenizer from this GGUF file in it")
    p.add_argument("--bpe-vocab-size", type=int, default=1000,
                   help="with --tokenizer bpe: merges learned from the train background")
    p.add_argument("--official", metavar="DIR", help="BABILong's published files on disk")
    p.add_argument("--together", action="store_true",
                   help="one data set holding every length (a length curriculum trains on "
                        "it: curriculum.segments)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-facts", type=int,
                   help="cap the facts per story (default: the original tasks' ranges, "
                        "qa1 2-10 ... qa5 2-126; see data_pipeline/babilong/babi.py)")
    for split in SPLITS:
        p.add_argument(f"--{split}-size", type=int, default=DEFAULT_SIZES[split],
                       help=f"samples per task (default {DEFAULT_SIZES[split]})")
    p.add_argument("--samples-per-shard", type=int, default=1000)
    return p


def main_babilong(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        build(args)
    except (OSError, ValueError, KeyError) as err:
        return error_line("memtrain tasks babilong", err)
    return 0


def _open_background(args):
    from ..corpora import open_corpus
    if args.corpus:
        if args.background or args.background_valid or args.background_test:
            raise ValueError("give --corpus or --background, not both")
        name, files = args.corpus, None
    else:
        if not args.background:
            raise ValueError("lengths above 0 need background text: --background FILES "
                             "(or --corpus NAME)")
        name = "text"
        files = {"train": args.background, "valid": args.background_valid,
                 "test": args.background_test}
        files = {k: v for k, v in files.items() if v}
    if args.tokenizer == "words" or (args.corpus in ("wt103", "wt2", "ptb")
                                     and not args.tokenizer.startswith("hf:")):
        raise ValueError("a word vocabulary cannot write the tasks' sentences; use "
                         "--tokenizer bytes, chars, bpe or hf:<checkpoint>")
    return open_corpus(name, args.data_dir, tokenizer=args.tokenizer, files=files,
                       bpe_vocab_size=args.bpe_vocab_size,
                       valid_fraction=0.1, test_fraction=0.1, progress=False,
                       tokenizer_revision=args.tokenizer_revision,
                       tokenizer_gguf_file=args.tokenizer_gguf_file)


def _tasks(text: str) -> list[str]:
    from .babi import TASKS
    tasks = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in tasks if t not in TASKS]
    if bad or not tasks:
        raise ValueError(f"--tasks {text!r}: choose from {', '.join(TASKS)}")
    return tasks


def build(args) -> list[Path]:
    out = Path(args.out)
    for split in SPLITS:
        if getattr(args, f"{split}_size") < 0:
            raise ValueError(f"--{split}-size must be >= 0")
    if args.official:
        return _build_official(args, out)
    from .background import corpus_pools
    from .labels import TASK_LABELS

    tasks = _tasks(args.tasks)
    lengths = [parse_length(x) for x in args.lengths.split(",") if x.strip()]
    check_lengths(lengths, args.seg_len)
    pools = None
    if any(lengths):
        pools = corpus_pools(_open_background(args), SPLITS)
        vocab = next(iter(pools.values())).vocab
    else:
        vocab = _vocab_only(args)
    layout = Layout.build(vocab, {t: tuple(TASK_LABELS[t]) for t in tasks})
    stories = {s: {t: _stories(t, getattr(args, f"{s}_size"), split_seed(args.seed, s) + i,
                               args.max_facts)
                   for i, t in enumerate(tasks)} for s in SPLITS}
    samples = {s: [Sample(t, st.question, st.answer, tuple(st.facts))
                   for t in tasks for st in stories[s][t]] for s in SPLITS}
    rows = {n: {s: [(n, r) for i, t in enumerate(tasks)
                    for r in story_rows(layout, stories[s][t], n,
                                        pools[s] if pools else None, args.seed, s, i)]
                for s in SPLITS}
            for n in lengths}
    meta = {"tasks": tasks, "source": "generated", "seed": args.seed,
            "background": _describe_background(args)}
    written = []
    if args.together:
        seq_len = max(seq_len_of([r for s in SPLITS for _, r in rows[n][s]], n, args.seg_len)
                      for n in lengths)
        split_rows, split_samples = {}, {}
        for s in SPLITS:
            # Rows of one length in order; the stories alone (0) grouped by the segments
            # they fill (a stable sort), so that each count is one run of length_rows.
            picked = sorted(((i, n, pair, sample) for i, n in enumerate(lengths)
                             for pair, sample in zip(rows[n][s], samples[s], strict=True)),
                            key=lambda x: (x[0], filled_length(x[1], x[2][1], args.seg_len)))
            split_rows[s] = [pair for _, _, pair, _ in picked]
            split_samples[s] = [sample for _, _, _, sample in picked]
        m = write_dataset(out, layout, split_rows, split_samples, seq_len, args.seg_len,
                          {**meta, "lengths": lengths}, args.samples_per_shard, together=True)
        written.append(out)
        print(f"wrote {out}: lengths {lengths} in rows of {seq_len} positions "
              f"({m.extra['n_segments']} x {args.seg_len})")
        return written
    for n in lengths:
        seq_len = seq_len_of([r for s in SPLITS for _, r in rows[n][s]], n, args.seg_len)
        where = out / length_label(n)
        write_dataset(where, layout, rows[n], samples, seq_len, args.seg_len,
                      {**meta, "length": n}, args.samples_per_shard)
        written.append(where)
        print(f"wrote {where}: {len(tasks)} task(s) x "
              f"{'/'.join(str(len(rows[n][s])) for s in SPLITS)} train/valid/test rows of "
              f"{seq_len} positions ({seq_len // args.seg_len} x {args.seg_len})")
    return written


def _stories(task: str, n: int, seed: int, max_facts: int | None):
    """n stories; with max_facts, each story's fact count is drawn uniformly from the task's
    range cut at max_facts (a departure from bAbI's story lengths, for short contexts)."""
    import numpy as np

    from .babi import FACT_RANGES, MIN_FACTS, generate_stories, generate_story
    if max_facts is None:
        return generate_stories(task, n, seed)
    if max_facts < MIN_FACTS[task]:
        raise ValueError(f"--max-facts {max_facts}: {task} stories need at least "
                         f"{MIN_FACTS[task]} facts")
    lo, hi = FACT_RANGES[task]
    hi = min(hi, max_facts)
    lo = min(lo, hi)
    rng = np.random.default_rng(seed)
    return [generate_story(task, rng, int(rng.integers(lo, hi + 1))) for _ in range(n)]


def _vocab_only(args):
    """The tokenizer alone, for data sets of length 0 (no background text is read)."""
    from ..hf_tokenizer import HFVocab, hf_name
    from ..vocab import ByteVocab
    checkpoint = hf_name(args.tokenizer)
    if checkpoint is not None:
        return HFVocab.load(checkpoint, args.tokenizer_revision, args.tokenizer_gguf_file)
    if args.tokenizer == "bytes":
        return ByteVocab()
    if args.background or args.corpus:
        return _open_background(args).vocab
    raise ValueError(f"--tokenizer {args.tokenizer} is built from background text: give "
                     "--background (or use bytes or hf:<checkpoint>)")


def _describe_background(args) -> dict:
    if args.corpus:
        return {"corpus": args.corpus}
    return {"train": args.background or [], "valid": args.background_valid or "carved",
            "test": args.background_test or "carved"}


def _build_official(args, out: Path) -> list[Path]:
    """BABILong's published test samples in this project's rows: the context as published
    (facts already inside), re-tokenized by the model's tokenizer; T is the longest row of
    each length rounded up to whole segments."""
    import numpy as np

    from .labels import TASK_LABELS, target_labels
    from .official import read_official

    if args.background or args.corpus or args.together:
        raise ValueError("--official reads published samples: no --background, --corpus or "
                         "--together")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    labels = [x.strip() for x in args.lengths.split(",") if x.strip()]
    found = read_official(Path(args.official), tasks=tasks, lengths=labels,
                          limit=args.test_size or None)
    vocab = _vocab_only(args)
    # Scoring looks for the task's official labels (labels.py), never for the distinct
    # targets: a comma-joined target (qa8 "apple,milk") is its parts, each a label.
    answers = {t: TASK_LABELS[t] for t in tasks}
    for s in found:
        try:
            target_labels(s.target, answers[s.task])
        except ValueError as err:
            raise ValueError(f"{args.official}: {s.task} at {s.length}: {err}") from None
    spelled = {x for ls in answers.values() for x in ls}
    layout = Layout.build(vocab, answers, tuple(sorted({s.target for s in found} - spelled)))
    written = []
    for label in labels:
        picked = [s for s in found if s.length == label]
        rows: list[Row] = [assemble(layout, [s.context], s.question, s.target, 0, None,
                                    np.random.default_rng(0)) for s in picked]
        seq_len = seq_len_of(rows, 0, args.seg_len)
        samples = [Sample(s.task, s.question, s.target) for s in picked]
        where, n = out / label, parse_length(label)
        write_dataset(where, layout, {"test": [(n, r) for r in rows]}, {"test": samples},
                      seq_len, args.seg_len,
                      {"tasks": tasks, "source": "official", "length": n,
                       "length_label": label, "official": str(args.official)},
                      args.samples_per_shard)
        written.append(where)
        print(f"wrote {where}: {len(rows)} published samples in rows of {seq_len} positions")
    return written
