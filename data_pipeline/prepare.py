"""`memtrain prepare` (corpora) and `memtrain tasks` (algorithmic tasks) -> shards + manifest.

    memtrain prepare --corpus enwik8 --data-dir data/raw --out data/enwik8 [--download]
    memtrain prepare --corpus text --train 'books/*.txt' --tokenizer bpe --out data/books
    memtrain prepare --corpus text --train 'books/*.txt' --tokenizer hf:ckpt/gpt2 --out data/b
    memtrain prepare --corpus jsonl --train 'docs/*.jsonl' --field text --seg-len 128 --out d
    memtrain prepare --corpus parquet --train qa.parquet --context-field context \
        --question-field question --answer-field answer --seg-len 256 --out data/qa
    memtrain tasks copy --src-len 24 --n-segments 3 --out data/copy24
    memtrain tasks copy --src-len 24 --tokenizer hf:ckpt/gpt2 --out data/copy24-gpt2
    memtrain tasks associative_rewrite --param n_pairs=4 --param n_rewrites=2 --n-segments 7 \
        --out data/ar-rewrite
    memtrain tasks babilong --tasks qa1,qa2 --lengths 0,1k --seg-len 128 --background b.txt ...

`--tokenizer hf:<checkpoint directory or hub name>` writes the ids of a pretrained model's own
tokenizer, which the manifest names and fingerprints (data_pipeline/hf_tokenizer.py); a run
with `model.backbone: hf` trains only on data of its checkpoint's tokenizer
(docs/pretrained_data_notes.md).

`--corpus jsonl|parquet|datasets` reads records, one document (or one context, question and
answer) per row, and writes them as episodes: data_pipeline/prepare_records.py,
docs/data-formats.md.

Relative --train/--valid/--test files and globs are found from the working directory (or
from --data-dir when it is given). An error prints one line and exits with code 2 (a bad
option, value or input file) or 1 (a failed download or write).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tqdm import tqdm

from memtrain.command_line import CommandParser, error_line

from .shard_writer import write_episode_split, write_manifest
from .shard_writer import write_token_split as _write_tokens
from .shards import Manifest, ShardError, id_dtype, verify_split

DEFAULT_DATA_DIR = "data/raw"  # benchmarks' raw files


def _out_dir(path: str) -> Path:
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # the bare "[Errno 2] ... '/a'" would not say it is --out
        raise type(err)(f"cannot create the --out folder {out}: {err.strerror or err}") from None
    return out


# Options of the record corpora only (data_pipeline/prepare_records.py): attribute -> option.
RECORD_OPTIONS = {"field": "--field", "context_field": "--context-field",
                  "question_field": "--question-field", "answer_field": "--answer-field",
                  "chat_template": "--chat-template", "seg_len": "--seg-len",
                  "seq_len": "--seq-len", "on_bad_row": "--on-bad-row",
                  "samples_per_shard": "--samples-per-shard"}


def prepare_corpus(args) -> Manifest:
    from .corpora import open_corpus
    from .records import FORMATS

    if args.corpus in FORMATS:
        from .prepare_records import prepare_records
        return prepare_records(args, _out_dir)
    # A Namespace built in code (benchmarks/bench_data.py) may lack these attributes.
    given = [opt for attr, opt in RECORD_OPTIONS.items() if getattr(args, attr, None)]
    if given:
        raise ValueError(f"{', '.join(given)}: for --corpus {', '.join(FORMATS)} (records), "
                         f"not {args.corpus}")
    files = {s: getattr(args, s) for s in ("train", "valid", "test") if getattr(args, s)}
    if files and args.corpus != "text":
        raise ValueError(f"--train/--valid/--test are for --corpus text; {args.corpus} has "
                         f"fixed files (in --data-dir)")
    if args.corpus == "text" and "train" not in files:
        raise ValueError("--corpus text needs --train FILE_OR_GLOB ... (--valid and --test "
                         "are optional: they are carved from the end of train)")
    # Files named on the command line are found from where the command runs, as any shell
    # user expects; benchmarks look in their data folder.
    data_dir = args.data_dir or ("." if args.corpus == "text" else DEFAULT_DATA_DIR)
    corpus = open_corpus(args.corpus, data_dir, download=args.download,
                         tokenizer=args.tokenizer, bpe_vocab_size=args.bpe_vocab_size,
                         files=files, progress=not args.quiet,
                         # a Namespace built in code (benchmarks/bench_data.py) may lack it
                         tokenizer_revision=getattr(args, "tokenizer_revision", ""))
    out = _out_dir(args.out)
    vocab = corpus.vocab
    dtype = id_dtype(vocab.size)
    splits, top = {}, [-1]
    for split in corpus.splits:
        start, raw = time.perf_counter(), corpus.raw_size(split)
        with tqdm(total=None, unit="tok", unit_scale=True, desc=f"{args.corpus}/{split}",
                  disable=args.quiet) as bar:
            info = _write_tokens(out, split, _tracked(corpus.iter_tokens(split), top), dtype,
                                 args.chunk_tokens, args.chunks_per_shard, progress=bar.update)
        info.raw_bytes = raw
        secs = time.perf_counter() - start
        print(f"{split}: {info.n_tokens} tokens in {len(info.shards)} shards, "
              f"{raw / 1e6 / max(secs, 1e-9):.1f} MB/s")
        splits[split] = info
    # A pretrained tokenizer's size need not be the model's embedding rows: the trainer
    # checks the largest id (hf_tokenizer.py, "Size").
    extra = {"max_id": top[0]} if vocab.kind == "hf" else {}
    manifest = Manifest(kind="tokens", source=corpus.name, vocab=vocab.to_dict(),
                        vocab_fingerprint=vocab.fingerprint(), vocab_size=vocab.size,
                        dtype=str(dtype), chunk_tokens=args.chunk_tokens, splits=splits,
                        extra=extra)
    path = write_manifest(out, manifest)
    manifest.location = str(out)
    if args.verify:
        for split in splits:
            verify_split(manifest, split)
    print(f"wrote {path}")
    return manifest


def _tracked(pieces, top: list[int]):
    """The id arrays of `pieces`, unchanged; top[0] becomes the largest id seen."""
    for ids in pieces:
        if ids.size:
            top[0] = max(top[0], int(ids.max()))
        yield ids


def _task_vocab(args, spec):
    """(vocab description, fingerprint, size, id table or None) of a task's data: the task's
    own ids, or with --tokenizer hf:... each symbol as the model's token of its character."""
    from .hf_tokenizer import HFVocab, hf_name
    from .tasks import symbol_chars
    from .vocab import fingerprint

    tokenizer, revision = getattr(args, "tokenizer", None), getattr(args, "tokenizer_revision", "")
    checkpoint = hf_name(tokenizer)
    if tokenizer and checkpoint is None:
        raise ValueError(f"--tokenizer {tokenizer!r}: a task has its own ids, or a "
                         "pretrained model's tokens with --tokenizer hf:<checkpoint>")
    if checkpoint is None:
        if revision:
            raise ValueError("--tokenizer-revision is for --tokenizer hf:<checkpoint>")
        vocab = {"kind": "task", "task": spec.name, "size": spec.vocab_size,
                 "pad_id": spec.pad_id}
        return vocab, fingerprint(vocab), spec.vocab_size, None
    hf = HFVocab.load(checkpoint, revision)
    chars = symbol_chars(spec)
    table = hf.single_token_ids(chars)
    vocab = {**hf.to_dict(), "task": spec.name, "pad_id": int(table[spec.pad_id]),
             "task_symbols": {c: int(i) for c, i in zip(chars, table, strict=True)}}
    return vocab, hf.fingerprint(), hf.size, table


def prepare_task(args) -> Manifest:
    from .tasks import DEFAULT_SPLIT_SIZES, generate, make_task, split_seed

    params = {}
    for kv in args.param:
        key, sep, value = kv.partition("=")
        try:
            if not sep or not key:
                raise ValueError
            params[key] = int(value)
        except ValueError:
            raise ValueError(f"--param {kv!r}: write KEY=INT, e.g. --param n_pairs=4") from None
    spec = make_task(args.name, src_len=args.src_len, n_segments=args.n_segments, **params)
    vocab, vocab_fp, size, table = _task_vocab(args, spec)
    out = _out_dir(args.out)
    sizes = {"train": args.train_size, "valid": args.valid_size, "test": args.test_size}
    splits = {}
    for split, n in sizes.items():
        n = DEFAULT_SPLIT_SIZES[split] if n is None else n
        data = generate(spec, n, split_seed(args.seed, split))
        tokens = data.tokens if table is None else table[data.tokens]
        splits[split] = write_episode_split(out, split, tokens.astype(id_dtype(size)),
                                            data.loss_mask, data.answer_mask,
                                            args.samples_per_shard)
        print(f"{split}: {n} samples of {spec.seq_len} positions ({spec.n_segments} x "
              f"{spec.segment_len})")
    extra = {"task": spec.name, "params": spec.params, "seq_len": spec.seq_len,
             "n_segments": spec.n_segments, "seed": args.seed}
    if table is not None:
        extra["max_id"] = int(table.max())
    manifest = Manifest(kind="episodes", source=spec.name, vocab=vocab,
                        vocab_fingerprint=vocab_fp, vocab_size=size,
                        dtype=str(id_dtype(size)), chunk_tokens=spec.seq_len + 1,
                        splits=splits, extra=extra)
    print(f"wrote {write_manifest(out, manifest)}")
    manifest.location = str(out)
    return manifest


def _parser(prog: str) -> argparse.ArgumentParser:
    return CommandParser(prog=prog, description=__doc__,
                         formatter_class=argparse.RawDescriptionHelpFormatter)


def main_prepare(argv: list[str] | None = None) -> int:
    p = _parser("memtrain prepare")
    p.add_argument("--corpus", required=True,
                   help="enwik8, text8, wt103, wt2, ptb, text (your own files), or jsonl, "
                   "parquet, datasets (records, one per row: docs/data-formats.md)")
    p.add_argument("--data-dir", help="benchmarks: where the raw files are / go (default "
                   f"{DEFAULT_DATA_DIR}); text: the folder relative --train/--valid/--test "
                   "paths start from (default: the working directory)")
    p.add_argument("--out", required=True, help="folder for the shards and manifest.json")
    p.add_argument("--download", action="store_true", help="fetch a missing benchmark file")
    p.add_argument("--tokenizer", help="bytes | symbols | chars | bpe (default per corpus), "
                   "or hf:<checkpoint dir or hub name> for a pretrained model's own tokenizer "
                   "(text, wt103, wt2, ptb)")
    p.add_argument("--tokenizer-revision", default="",
                   help="with hf:<hub name>: the branch, tag or commit to load")
    p.add_argument("--bpe-vocab-size", type=int, default=32000)
    p.add_argument("--train", nargs="+", help="text, jsonl, parquet: train files/globs "
                   "(quote globs; for jsonl/parquet a folder means its *.jsonl/*.parquet); "
                   "datasets: save_to_disk folders, or hub:<name>[:<split>] with network")
    p.add_argument("--valid", nargs="+", help="valid files/globs/folders (optional)")
    p.add_argument("--test", nargs="+", help="test files/globs/folders (optional)")
    rec = p.add_argument_group("records (--corpus jsonl, parquet, datasets)")
    rec.add_argument("--field", help="the field holding each document's text (default: text)")
    rec.add_argument("--context-field", help="with --question-field and --answer-field: "
                     "long-context samples, the loss on the answer only (BABILong's layout)")
    rec.add_argument("--question-field")
    rec.add_argument("--answer-field")
    rec.add_argument("--chat-template", action="store_true", help="write context+question "
                     "and answer as one user and one assistant turn of the tokenizer's chat "
                     "template (--tokenizer hf:<checkpoint> with a template only)")
    rec.add_argument("--seg-len", type=int, help="the run's segment length (model.tgt_len): "
                     "samples are whole segments (required)")
    rec.add_argument("--seq-len", type=int, help="positions per sample (whole segments); "
                     "longer rows are bad rows (default: the longest row, rounded up)")
    rec.add_argument("--on-bad-row", choices=("skip", "fail"), help="a row with a missing, "
                     "non-string or empty field: skip it and report it by file and row "
                     "(default), or stop at the first")
    rec.add_argument("--samples-per-shard", type=int, help="default 10000")
    p.add_argument("--chunk-tokens", type=int, default=1 << 20)
    p.add_argument("--chunks-per-shard", type=int, default=64)
    p.add_argument("--verify", action="store_true", help="re-hash every shard afterwards")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    if args.chunk_tokens <= 0 or args.chunks_per_shard <= 0:
        p.error("--chunk-tokens and --chunks-per-shard must be > 0")
    try:
        prepare_corpus(args)
    except (OSError, ValueError, ShardError) as err:  # a missing file, a bad value, a
        return error_line("memtrain prepare", err)    # failed download, a bad re-hash
    return 0


def main_tasks(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "babilong":   # its own options (data_pipeline/babilong/cli.py)
        from .babilong.cli import main_babilong
        return main_babilong(argv[1:])
    p = _parser("memtrain tasks")
    p.add_argument("name", help="copy, reverse, associative_retrieval, associative_rewrite "
                   "(ARMT's rewrite setting, docs/armt-tasks.md), quadratic, or babilong "
                   "(`memtrain tasks babilong --help`)")
    p.add_argument("--out", required=True)
    p.add_argument("--src-len", type=int)
    p.add_argument("--n-segments", type=int, default=1)
    p.add_argument("--param", action="append", default=[], metavar="KEY=INT",
                   help="extra task parameter: n_pairs=K (associative_retrieval, "
                   "associative_rewrite), n_rewrites=R (associative_rewrite), "
                   "no_root_percent=P (quadratic)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-size", type=int)
    p.add_argument("--valid-size", type=int)
    p.add_argument("--test-size", type=int)
    p.add_argument("--samples-per-shard", type=int, default=50_000)
    p.add_argument("--tokenizer", help="hf:<checkpoint dir or hub name>: write each task "
                   "symbol as the pretrained model's token of its character (default: the "
                   "task's own ids)")
    p.add_argument("--tokenizer-revision", default="",
                   help="with hf:<hub name>: the branch, tag or commit to load")
    args = p.parse_args(argv)
    try:
        prepare_task(args)
    except (OSError, ValueError) as err:  # a bad task parameter, an unwritable --out
        return error_line("memtrain tasks", err)
    return 0
