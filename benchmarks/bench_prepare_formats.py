"""`memtrain prepare` throughput on the same documents as a text file, JSONL, Parquet and a
`datasets` folder (docs/data-formats.md; results in BENCHMARKS.md, "Preparing JSONL, Parquet
and datasets folders").

    python benchmarks/bench_prepare_formats.py              # 16 MB of documents, 3 rounds
    python benchmarks/bench_prepare_formats.py --mb 4 --rounds 1

The documents are generated words, 1,000 to 3,000 bytes each. The text corpus reads them as
one file (a token stream: no boundaries); the record corpora read one document per row and
write one episode per document (segments of --seg-len, padded to the longest document).
Every run prepares all three splits (valid and test carved from train) with the byte
tokenizer, so the figures are the formats' reading and the writing, not a tokenizer's speed.
The rounds alternate the formats, and the median of each is reported with its ratio to the
text path: on a shared machine the ratios hold better than the absolute figures. "read" is
iterating the rows (data_pipeline/records.py) alone; "read+encode" adds checking each row
and encoding it (record_samples.read_split); the rest of a record run is laying out the
episodes and writing them (shard_writer.write_episode_split, four tar members per episode).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from data_pipeline.prepare import prepare_corpus
from data_pipeline.record_samples import BadRows, Encoder, Fields, read_split
from data_pipeline.records import Input, read_rows
from data_pipeline.vocab import ByteVocab

FORMATS = ("text", "jsonl", "parquet", "datasets")


def make_documents(mb: float, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    words = np.array(["the", "memory", "segment", "token", "of", "a", "reads", "model",
                      "and", "writes", "long", "context", "café", "über", "net", "in"])
    docs, total = [], 0
    while total < mb * 1e6:
        n = int(rng.integers(1000, 3000))
        text = " ".join(words[rng.integers(0, words.size, n // 5)])[:n] + "\n"
        docs.append(text)
        total += len(text.encode())
    return docs


def write_inputs(docs: list[str], folder: Path) -> dict[str, Path]:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = {f: folder / name for f, name in (("text", "docs.txt"), ("jsonl", "docs.jsonl"),
                                              ("parquet", "docs.parquet"),
                                              ("datasets", "docs-ds"))}
    paths["text"].write_text("".join(docs))
    with open(paths["jsonl"], "w") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    pq.write_table(pa.table({"text": docs}), paths["parquet"])
    datasets.disable_progress_bars()
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(paths["datasets"]))
    return paths


def namespace(fmt: str, src: Path, out: Path, seg_len: int) -> argparse.Namespace:
    ns = argparse.Namespace(corpus=fmt, data_dir=None, out=str(out), download=False,
                            tokenizer="bytes", tokenizer_revision="", bpe_vocab_size=0,
                            train=[str(src)], valid=None, test=None, chunk_tokens=1 << 20,
                            chunks_per_shard=64, verify=False, quiet=True)
    if fmt != "text":
        ns.seg_len, ns.field = seg_len, "text"
    return ns


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=16.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seg-len", type=int, default=512)
    args = p.parse_args(argv)
    docs = make_documents(args.mb)
    text_mb = sum(len(d.encode()) for d in docs) / 1e6
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        paths = write_inputs(docs, tmp)
        sizes = {f: (Input(f, str(paths[f])).size() if f != "text"
                     else paths[f].stat().st_size) / 1e6 for f in FORMATS}
        print(f"{len(docs)} documents, {text_mb:.1f} MB of text; files: "
              + ", ".join(f"{f} {sizes[f]:.1f} MB" for f in FORMATS))
        times: dict[str, list[float]] = {f: [] for f in FORMATS}
        reads: dict[str, list[float]] = {f: [] for f in FORMATS[1:]}
        encodes: dict[str, list[float]] = {f: [] for f in FORMATS[1:]}
        encoder = Encoder(ByteVocab(), Fields())
        for _ in range(args.rounds):
            for fmt in FORMATS:
                out = tmp / f"out-{fmt}"
                start = time.perf_counter()
                prepare_corpus(namespace(fmt, paths[fmt], out, args.seg_len))
                times[fmt].append(time.perf_counter() - start)
                shutil.rmtree(out)
            for fmt in reads:
                start = time.perf_counter()
                for _ in read_rows(Input(fmt, str(paths[fmt])), ["text"]):
                    pass
                reads[fmt].append(time.perf_counter() - start)
                rows = read_split([Input(fmt, str(paths[fmt]))], encoder, BadRows())
                encodes[fmt].append(rows.seconds)
    base = statistics.median(times["text"])
    print(f"\nmedian of {args.rounds} rounds, MB of document text per second (byte tokenizer, "
          f"all splits, shards written and hashed):")
    for fmt in FORMATS:
        secs = statistics.median(times[fmt])
        read = (f"; read {text_mb / statistics.median(reads[fmt]):.0f} MB/s, read+encode "
                f"{text_mb / statistics.median(encodes[fmt]):.0f} MB/s" if fmt in reads else "")
        print(f"  {fmt:9s} {secs:6.2f} s  {text_mb / secs:6.1f} MB/s  "
              f"{base / secs:4.2f}x the text path{read}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
