"""`memtrain prepare --corpus jsonl|parquet|datasets`: record files -> episodic shards + manifest.

    memtrain prepare --corpus jsonl --train 'docs/*.jsonl' --field text --seg-len 128 --out d
    memtrain prepare --corpus parquet --train data/train --valid data/valid.parquet \\
        --context-field context --question-field question --answer-field answer \\
        --tokenizer hf:ckpt/gpt2 --chat-template --seg-len 512 --out qa

Reading: data_pipeline/records.py; rows -> samples: data_pipeline/record_samples.py. Every
split is read and encoded first, because every sample of a data set has one length T (the
trainer cuts samples into equal segments of the run's model.tgt_len, train/regime.py): T is
--seq-len, or the longest row's positions rounded up to whole --seg-len segments. Then each
split is laid out and written with the episode writer every task uses
(shard_writer.write_episode_split). A split not given is carved from the end of train:
VALID_FRACTION of its rows each for valid and test, at least one (train | valid | test, as
the text corpus carves, data_pipeline/corpora.py). docs/data-formats.md has the walkthrough.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from .record_samples import (
    PAD_ID,
    BadRows,
    Encoder,
    Fields,
    SplitRows,
    episode_arrays,
    plain_texts,
    positions,
    read_split,
    row_values,
)
from .records import FORMATS, Input, dict_companions, read_rows, resolve_inputs
from .shard_writer import write_episode_split, write_manifest
from .shards import Manifest, id_dtype, verify_split

SPLITS = ("train", "valid", "test")
TOKENIZERS = ("bytes", "chars", "bpe")      # and hf:<checkpoint>
VALID_FRACTION = 0.05                       # of train's rows, for a valid or test not given
DEFAULT_SAMPLES_PER_SHARD = 10_000


def record_fields(args) -> Fields:
    """The fields the options name; ValueError naming the option when they do not fit."""
    qa = {k: getattr(args, f"{k}_field", None) for k in ("context", "question", "answer")}
    given = [k for k, v in qa.items() if v]
    text = getattr(args, "field", None)
    if given and len(given) < 3:
        missing = ", ".join(f"--{k}-field" for k in qa if k not in given)
        raise ValueError(f"--context-field, --question-field and --answer-field go together; "
                         f"{missing} missing")
    if given and text:
        raise ValueError("--field names a document's text; with --context-field, "
                         "--question-field and --answer-field it has no use: give one or "
                         "the other")
    if given:
        if len(set(qa.values())) < 3:
            raise ValueError(f"--context-field, --question-field and --answer-field name "
                             f"the same field twice ({', '.join(qa.values())})")
        return Fields(context=qa["context"], question=qa["question"], answer=qa["answer"])
    return Fields(text=text or "text")


def _open_vocab(args, fields: Fields, train: list[Input], policy: str):
    """The vocabulary: bytes (default), chars or bpe learned from the train rows (every
    --train row: valid and test carved from them share it), or hf:<checkpoint>."""
    from .bpe import BPEVocab
    from .hf_tokenizer import HFVocab, hf_name
    from .vocab import ByteVocab, SymbolVocab

    tokenizer = args.tokenizer or "bytes"
    revision = getattr(args, "tokenizer_revision", "")
    checkpoint = hf_name(tokenizer)
    if checkpoint is None and tokenizer not in TOKENIZERS:
        raise ValueError(f"--corpus {args.corpus}: unknown tokenizer {tokenizer!r}; choose "
                         "from bytes, chars, bpe, hf:<checkpoint>")
    if revision and checkpoint is None:
        raise ValueError("--tokenizer-revision is for --tokenizer hf:<checkpoint>")
    if getattr(args, "chat_template", False):
        if not fields.qa:
            raise ValueError("--chat-template is for records with --context-field, "
                             "--question-field and --answer-field (a document has no turns)")
        if checkpoint is None:
            raise ValueError(f"--chat-template needs --tokenizer hf:<checkpoint> whose "
                             f"tokenizer has a chat template; {tokenizer!r} has none")
    if checkpoint is not None:
        vocab = HFVocab.load(checkpoint, revision)
        if getattr(args, "chat_template", False) and not getattr(vocab.tokenizer,
                                                                  "chat_template", None):
            raise ValueError(f"--chat-template: the tokenizer of {vocab.name} has no chat "
                             "template (none in its tokenizer_config.json or "
                             "chat_template.jinja); leave the option out")
        return vocab
    if tokenizer == "bytes":
        return ByteVocab()
    texts = _train_texts(train, fields, policy)
    if tokenizer == "chars":
        return SymbolVocab.build_chars(texts)
    return BPEVocab.build(texts, vocab_size=args.bpe_vocab_size, progress=False)


def _train_texts(train: list[Input], fields: Fields, policy: str):
    """The texts of the good train rows, for learning a vocabulary. Bad rows are reported by
    the pass that encodes (with --on-bad-row fail the first one stops this pass already)."""
    bad = BadRows(policy)
    for inp in train:
        for where, row in read_rows(inp, fields.names):
            values, why = row_values(row, fields.names)
            if values is None:
                bad.add(where, why)
                continue
            yield from plain_texts(fields, values)


def _inputs(args, data_dir: Path) -> dict[str, list[Input]]:
    patterns = {s: getattr(args, s) for s in SPLITS if getattr(args, s, None)}
    if "train" not in patterns:
        raise ValueError(f"--corpus {args.corpus} needs --train FILE_OR_GLOB ... (--valid "
                         "and --test are optional: they are carved from the end of train)")
    inputs = {s: resolve_inputs(args.corpus, data_dir, p, s) for s, p in patterns.items()}
    if args.corpus == "datasets":
        for role, found in dict_companions(inputs["train"]).items():
            inputs.setdefault(role, found)
    seen: dict[Input, str] = {}
    for split, found in inputs.items():
        for inp in found:
            if inp in seen:
                raise ValueError(f"--corpus {args.corpus}: {inp.name} is in both the "
                                 f"{seen[inp]} and the {split} split")
            seen[inp] = split
    return inputs


def _carve(rows: dict[str, SplitRows]) -> list[str]:
    """Valid and test not given: the last rows of train (train | valid | test)."""
    carve = [s for s in ("valid", "test") if s not in rows]
    if not carve:
        return []
    train = rows["train"]
    n = len(train)
    k = max(1, int(n * VALID_FRACTION))
    if n - k * len(carve) < 1:
        raise ValueError(f"train has {n} good rows: too few to carve "
                         f"{' and '.join(carve)} from ({k} each); give --valid/--test files "
                         "or more rows")
    lo = n - k * len(carve)
    for i, split in enumerate(carve):
        rows[split] = train.cut(lo + i * k, lo + (i + 1) * k)
    rows["train"] = train.cut(0, lo)
    rows["train"].file_bytes, rows["train"].seconds = train.file_bytes, train.seconds
    return carve


def _seq_len(rows: dict[str, SplitRows], bads: dict[str, BadRows], seg_len: int,
             seq_len: int | None, answer_tokens: int) -> int:
    """T: --seq-len (longer rows are bad rows), or the longest row in whole segments."""
    if seq_len is None:
        longest = max((int(positions(r, answer_tokens).max()) for r in rows.values() if len(r)),
                      default=0)
        return max(1, -(-longest // seg_len)) * seg_len
    for split, r in rows.items():
        fill = positions(r, answer_tokens)
        too_long = fill > seq_len
        for i in map(int, too_long.nonzero()[0]):
            bads[split].add(r.wheres[i], f"{int(fill[i])} positions, more than --seq-len "
                            f"{seq_len}")
        r.keep((~too_long).tolist())
    return seq_len


def _check_lengths(args) -> tuple[int, int | None]:
    seg_len, seq_len = getattr(args, "seg_len", None), getattr(args, "seq_len", None)
    if seg_len is None:
        raise ValueError(f"--corpus {args.corpus} writes every row as an episode cut into "
                         "segments: give --seg-len (the run's model.tgt_len)")
    if seg_len < 1:
        raise ValueError(f"--seg-len must be >= 1, got {seg_len}")
    if seq_len is not None and (seq_len < seg_len or seq_len % seg_len):
        raise ValueError(f"--seq-len {seq_len} must be whole segments of --seg-len {seg_len} "
                         f"(e.g. {max(1, seq_len // seg_len) * seg_len})")
    return seg_len, seq_len


def prepare_records(args, make_out=None) -> Manifest:
    """Shards and manifest of args' records; `make_out(path)` creates the --out folder once
    the inputs are read (memtrain prepare's, with its error wording; default mkdir)."""
    if args.corpus not in FORMATS:
        raise ValueError(f"--corpus {args.corpus!r} is not a record format ({', '.join(FORMATS)})")
    seg_len, seq_len = _check_lengths(args)
    policy = getattr(args, "on_bad_row", None) or "skip"
    per_shard = getattr(args, "samples_per_shard", None)
    per_shard = DEFAULT_SAMPLES_PER_SHARD if per_shard is None else per_shard
    if per_shard < 1:
        raise ValueError(f"--samples-per-shard must be >= 1, got {per_shard}")
    fields = record_fields(args)
    inputs = _inputs(args, Path(args.data_dir or "."))
    vocab = _open_vocab(args, fields, inputs["train"], policy)
    encoder = Encoder(vocab, fields, getattr(args, "chat_template", False))
    bads = {s: BadRows(policy) for s in inputs}
    rows = {s: read_split(found, encoder, bads[s]) for s, found in inputs.items()}
    answer_tokens = max((a.size for r in rows.values() for a in r.answers), default=0)
    seq_len = _seq_len(rows, bads, seg_len, seq_len, answer_tokens)
    for split, bad in bads.items():
        for line in bad.report(split):
            print(f"memtrain prepare: {line}", file=sys.stderr)
    for split in inputs:
        if not len(rows[split]):
            raise ValueError(f"--corpus {args.corpus}: the {split} split has no good rows "
                             f"({bads[split].total} bad)")
    carved = _carve(rows)
    out = make_out(args.out) if make_out else Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = id_dtype(vocab.size)
    splits, top = {}, -1
    for split in SPLITS:
        r = rows[split]
        start = time.perf_counter()
        tokens, loss, answer = episode_arrays(r, seq_len, answer_tokens, encoder, dtype)
        top = max(top, int(tokens.max()))
        info = write_episode_split(out, split, tokens, loss, answer, per_shard)
        info.raw_bytes = sum(r.text_bytes)
        secs = r.seconds + time.perf_counter() - start   # reading + encoding, then writing
        rate = (f"{info.raw_bytes / 1e6 / max(secs, 1e-9):.1f} MB/s of text, "
                f"{r.file_bytes / 1e6 / max(secs, 1e-9):.1f} MB/s of files"
                if split not in carved else "carved from the end of train")
        what = "samples" if fields.qa else "documents"
        print(f"{split}: {len(r)} {what}, {int(loss.sum())} tokens with loss in "
              f"{len(info.shards)} shards, {rate}")
        splits[split] = info
    records = {"format": args.corpus, "fields": fields.names, "seg_len": seg_len,
               "rows": {s: len(rows[s]) for s in SPLITS}, "carved": carved,
               "bad_rows": {s: dict(b.per_file) for s, b in bads.items() if b.total},
               "on_bad_row": policy}
    if fields.qa:
        records.update(layout="babilong", answer_tokens=answer_tokens,
                       stop_id=encoder.stop_id, filler_id=encoder.filler_id,
                       chat_template=bool(getattr(args, "chat_template", False)))
    else:
        records.update(layout="documents", pad_id=PAD_ID)
    extra = {"task": "records_qa" if fields.qa else "documents", "seq_len": seq_len,
             "n_segments": seq_len // seg_len, "records": records}
    if vocab.kind == "hf":
        extra["max_id"] = top
    manifest = Manifest(kind="episodes", source=args.corpus, vocab=vocab.to_dict(),
                        vocab_fingerprint=vocab.fingerprint(), vocab_size=vocab.size,
                        dtype=str(dtype), chunk_tokens=seq_len + 1, splits=splits,
                        extra=extra)
    path = write_manifest(out, manifest)
    manifest.location = str(out)
    if getattr(args, "verify", False):
        for split in splits:
            verify_split(manifest, split)
    print(f"wrote {path} (samples of {seq_len} positions: {seq_len // seg_len} segments of "
          f"{seg_len})")
    return manifest

