"""Bytes a stream row reads from its shard to reach its start: seek (chunk offsets in the
manifest) vs the linear scan of manifests written without them (BENCHMARKS.md,
"Data pipeline: bytes a row reads to reach its start").

    python benchmarks/bench_shard_seek.py                  # 2 shards of 64 x 1M-token chunks
    python benchmarks/bench_shard_seek.py --chunk-tokens 262144 --rows 64   # quicker

Writes a byte-level corpus as `memtrain prepare` does (uint8 ids, 64 chunks per shard), then
reads one segment per row:
  1. one row starting in chunk 48 of a shard (mid-chunk);
  2. every row of a global batch of `--rows` streams (what each start / resume / epoch reads),
with the manifest as written (seek) and with its chunk offsets removed (an older manifest:
linear scan). Bytes are counted twice: the bytes Python read from .tar files (a counting
file wrapper), and the bytes the process read from the kernel (/proc/self/io rchar, which
includes buffering read-ahead).
"""

from __future__ import annotations

import argparse
import builtins
import json
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
from common import write_json

from data_pipeline.shard_writer import write_manifest, write_token_split
from data_pipeline.shards import Manifest, id_dtype, load_manifest
from data_pipeline.streams import _RowReader


class _Counting:
    def __init__(self, f, counter):
        self._f, self._counter = f, counter

    def read(self, *a):
        data = self._f.read(*a)
        self._counter[0] += len(data)
        return data

    def readinto(self, b):
        n = self._f.readinto(b)
        self._counter[0] += n or 0
        return n

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise RuntimeError("rchar not in /proc/self/io")


def measure(manifest: Manifest, starts: list[int], seg: int) -> dict:
    counter = [0]
    real_open = builtins.open

    def counting_open(file, mode="r", *a, **kw):
        f = real_open(file, mode, *a, **kw)
        return _Counting(f, counter) if str(file).endswith(".tar") else f

    builtins.open = counting_open
    try:
        k0, t0 = rchar(), time.perf_counter()
        for start in starts:
            reader = _RowReader(manifest, "train", start, None)
            reader.take(seg + 1, seg)
            reader._chunks.close()
        secs = time.perf_counter() - t0
        kernel = rchar() - k0
    finally:
        builtins.open = real_open
    return {"python_bytes": counter[0], "kernel_bytes": kernel, "seconds": round(secs, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunk-tokens", type=int, default=1 << 20)
    p.add_argument("--chunks-per-shard", type=int, default=64)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--rows", type=int, default=256, help="global batch (stream rows)")
    p.add_argument("--seg", type=int, default=512, help="segment length read per row")
    p.add_argument("--start-chunk", type=int, default=48, help="case 1: chunk in the shard")
    p.add_argument("--out", default="benchmarks/results/shard_seek.json")
    args = p.parse_args()
    c, per = args.chunk_tokens, args.chunks_per_shard
    n = c * per * args.shards
    dtype = id_dtype(256)

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        pieces = (np.random.default_rng(i).integers(0, 256, c, dtype=np.uint8)
                  for i in range(n // c))
        info = write_token_split(root, "train", pieces, dtype, c, per)
        m = Manifest(kind="tokens", source="bench", vocab={"kind": "bytes"},
                     vocab_fingerprint="0" * 64, vocab_size=256, dtype=str(dtype),
                     chunk_tokens=c, splits={"train": info})
        write_manifest(root, m)
        seek = load_manifest(root)
        old = load_manifest(root)
        for shard in old.split("train").shards:
            shard.chunk_offsets = None
        shard_bytes = (root / info.shards[0].path).stat().st_size
        offs = info.shards[0].chunk_offsets
        chunk_bytes = offs[1] - offs[0]

        one = [args.start_chunk * c + c // 2]
        stream_len = n // args.rows
        rows = [g * stream_len for g in range(args.rows)]
        results = {"layout": {"chunk_tokens": c, "chunks_per_shard": per,
                              "shards": args.shards, "dtype": str(dtype),
                              "shard_bytes": shard_bytes, "chunk_group_bytes": chunk_bytes,
                              "rows": args.rows, "seg": args.seg}}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the old manifest's one-time warning
            for case, starts in ((f"one row from chunk {args.start_chunk}", one),
                                 (f"{args.rows} rows, epoch start", rows)):
                before = measure(old, starts, args.seg)
                after = measure(seek, starts, args.seg)
                results[case] = {"linear": before, "seek": after}
                print(f"{case}: linear {before['python_bytes'] / 1e6:,.1f} MB "
                      f"(kernel {before['kernel_bytes'] / 1e6:,.1f} MB, {before['seconds']} s)"
                      f" -> seek {after['python_bytes'] / 1e6:,.2f} MB "
                      f"(kernel {after['kernel_bytes'] / 1e6:,.2f} MB, {after['seconds']} s)")
    print(f"one chunk = {chunk_bytes:,} bytes; shard = {shard_bytes:,} bytes")
    write_json(args.out, results)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
