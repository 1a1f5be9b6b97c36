"""Rows of record files as people hold them, for `memtrain prepare --corpus jsonl|parquet|
datasets` (data_pipeline/record_samples.py turns the rows into episodes; docs/data-formats.md).

    jsonl     one JSON object per line (standard-library json); blank lines are no rows
    parquet   read with pyarrow in row batches (a file is never loaded whole), only the
              columns asked for
    datasets  a folder `datasets.save_to_disk` wrote (a Dataset, or a DatasetDict whose
              split of the same role is taken), or `hub:<name>[:<split>]` with network

Each row comes with where it is (`Where`): "FILE line N" for JSONL (lines from 1, as an
editor shows them) and "FILE row N" for Parquet and datasets (rows from 0, as `ds[N]` and
pyarrow index them), so a bad row can be named in a report. A file that is not what its
format says (a line that is not JSON, a file that is not Parquet) raises RecordFileError, a
ValueError: one line naming the file, exit code 2 in `memtrain prepare`.

Relative paths and globs are found from --data-dir (default: the working directory), as the
text corpus finds its files (find_files.expand_globs). A folder given to jsonl or parquet
stands for the *.jsonl / *.parquet files under it, in sorted order.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from memtrain.extras import missing_extra

from .find_files import check_file

FORMATS = ("jsonl", "parquet", "datasets")
SUFFIX = {"jsonl": ".jsonl", "parquet": ".parquet"}
HUB = "hub:"
BATCH_ROWS = 1024   # Parquet / datasets rows per batch read
# The split of a DatasetDict each role reads (datasets' own names first).
DICT_SPLITS = {"train": ("train",), "valid": ("validation", "valid", "dev"),
               "test": ("test",)}


class RecordFileError(ValueError):
    """A file that is not valid JSONL or Parquet, or a folder that is no saved dataset."""


@dataclass(frozen=True)
class Where:
    """Where a row is: FILE line N (JSONL, from 1) or FILE row N (Parquet, datasets, from 0)."""

    file: str
    index: int
    unit: str = "row"

    def __str__(self) -> str:
        return f"{self.file} {self.unit} {self.index}"


@dataclass(frozen=True)
class Input:
    """One thing a split reads: a file, a saved dataset folder (with the DatasetDict split to
    take, or "" for a Dataset), or a hub name."""

    fmt: str
    path: str
    dict_split: str = ""

    @property
    def name(self) -> str:
        return f"{self.path}[{self.dict_split}]" if self.dict_split else self.path

    def size(self) -> int:
        """Bytes on disk (0 for a hub data set): what the MB/s of files counts."""
        p = Path(self.path)
        if self.fmt != "datasets":
            return p.stat().st_size
        if self.path.startswith(HUB):
            return 0
        folder = p / self.dict_split if self.dict_split else p
        return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _datasets():
    problem = missing_extra("datasets")
    if problem:
        raise ValueError(problem)
    # Imported here, not at the top: `datasets` is a heavy optional dependency (it pulls in
    # pyarrow, fsspec and pandas), needed only for --corpus datasets.
    import datasets
    return datasets


def _pyarrow_parquet():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError("--corpus parquet needs the package 'pyarrow': pip install "
                         "pyarrow") from None
    return pq


def _matches(data_dir: Path, pattern: str) -> tuple[str, list[str]]:
    full = pattern if os.path.isabs(pattern) else str(data_dir / pattern)
    return full, sorted(glob.glob(full, recursive=True))


def _no_match(fmt: str, role: str, pattern: str, data_dir: Path, what: str):
    where = "" if os.path.isabs(pattern) else f" (relative to {data_dir.absolute()})"
    return FileNotFoundError(f"--corpus {fmt}, --{role}: no {what} matches {pattern!r}{where}")


def resolve_inputs(fmt: str, data_dir: Path, patterns: list[str], role: str) -> list[Input]:
    """The inputs one split's --train/--valid/--test arguments name, in order, each once."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown record format {fmt!r}; choose from {', '.join(FORMATS)}")
    found: list[Input] = []
    for pattern in patterns:
        if fmt == "datasets" and pattern.startswith(HUB):
            found.append(_hub_input(pattern, role))
            continue
        full, hits = _matches(data_dir, pattern)
        if fmt == "datasets":
            folders = [h for h in hits if os.path.isdir(h)]
            if not folders:
                raise _no_match(fmt, role, pattern, data_dir, "folder")
            found.extend(_dataset_input(Path(f), role) for f in folders)
            continue
        files = []
        for hit in hits:
            if os.path.isdir(hit):  # a folder: the format's files under it
                files.extend(sorted(str(p) for p in Path(hit).rglob(f"*{SUFFIX[fmt]}")
                                    if p.is_file()))
            elif os.path.isfile(hit):
                files.append(hit)
        if not files:
            raise _no_match(fmt, role, pattern, data_dir, f"file (or folder of "
                            f"*{SUFFIX[fmt]} files)")
        found.extend(Input(fmt, str(check_file(Path(f)))) for f in files)
    return list(dict.fromkeys(found))


def _hub_input(pattern: str, role: str) -> Input:
    name, _, split = pattern[len(HUB):].partition(":")
    if not name:
        raise ValueError(f"--{role} {pattern!r}: write hub:<owner/name>[:<split>]")
    return Input("datasets", HUB + name, split or DICT_SPLITS[role][0])


def _load_folder(folder: Path):
    datasets = _datasets()
    try:
        return datasets.load_from_disk(str(folder))
    except (FileNotFoundError, ValueError, KeyError) as err:
        first = (str(err).splitlines() or [type(err).__name__])[0]
        raise RecordFileError(f"{folder}: not a folder that datasets' save_to_disk wrote "
                              f"({first})") from None


def _dataset_input(folder: Path, role: str) -> Input:
    ds = _load_folder(folder)
    if not hasattr(ds, "keys"):   # a Dataset
        return Input("datasets", str(folder))
    for name in DICT_SPLITS[role]:
        if name in ds:
            return Input("datasets", str(folder), name)
    raise ValueError(f"--{role} {folder}: a DatasetDict without a {' or '.join(DICT_SPLITS[role])}"
                     f" split (it has {', '.join(ds.keys())})")


def dict_companions(train: list[Input]) -> dict[str, list[Input]]:
    """valid/test splits of a single DatasetDict named by --train (its validation and test),
    for the roles given no inputs of their own."""
    if len(train) != 1 or not train[0].dict_split or train[0].path.startswith(HUB):
        return {}
    ds = _load_folder(Path(train[0].path))
    out = {}
    for role in ("valid", "test"):
        name = next((n for n in DICT_SPLITS[role] if n in ds), None)
        if name is not None:
            out[role] = [Input("datasets", train[0].path, name)]
    return out


# ----------------------------------------------------------------------------- reading
def read_rows(inp: Input, columns: list[str]) -> Iterator[tuple[Where, object]]:
    """(where, row) of every row of `inp`, in order. A JSONL row is whatever JSON its line
    holds (the caller checks that it is an object); a Parquet or datasets row is a dict of
    the `columns` the file has (a column it lacks is absent from every row)."""
    if inp.fmt == "jsonl":
        return _jsonl_rows(inp.path)
    if inp.fmt == "parquet":
        return _parquet_rows(inp.path, columns)
    return _dataset_rows(inp, columns)


def _jsonl_rows(path: str) -> Iterator[tuple[Where, object]]:
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise RecordFileError(f"{path} line {number}: not valid JSONL (invalid UTF-8 "
                                      f"at byte {e.start} of the line)") from None
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                # json's messages that name a place end in "at" ("Unterminated string
                # starting at"); the others do not ("Expecting value", "Extra data").
                at = "" if e.msg.endswith(" at") else " at"
                raise RecordFileError(f"{path} line {number}: not valid JSONL ({e.msg}{at} "
                                      f"column {e.colno})") from None
            yield Where(path, number, "line"), row


def _columns_dicts(batch: dict, present: list[str], n: int) -> Iterator[dict]:
    cols = [batch[c] for c in present]
    for i in range(n):
        yield {c: col[i] for c, col in zip(present, cols, strict=True)}


def _parquet_rows(path: str, columns: list[str]) -> Iterator[tuple[Where, dict]]:
    pq = _pyarrow_parquet()
    import pyarrow as pa

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise RecordFileError(f"{path}: not a Parquet file ({err})") from None
    names = set(pf.schema_arrow.names)
    present = [c for c in columns if c in names]
    row = 0
    if not present:   # no column asked for is there: every row lacks them all
        for row in range(pf.metadata.num_rows):
            yield Where(path, row), {}
        return
    try:
        for batch in pf.iter_batches(batch_size=BATCH_ROWS, columns=present):
            for values in _columns_dicts(batch.to_pydict(), present, batch.num_rows):
                yield Where(path, row), values
                row += 1
    except pa.ArrowException as err:
        raise RecordFileError(f"{path}: cannot read Parquet data after row {row} "
                              f"({err})") from None


def _dataset_rows(inp: Input, columns: list[str]) -> Iterator[tuple[Where, dict]]:
    if inp.path.startswith(HUB):
        # Needs network (or the datasets cache); not exercised by the tests (no network).
        try:
            ds = _datasets().load_dataset(inp.path[len(HUB):], split=inp.dict_split)
        except Exception as err:  # datasets raises many kinds for a name it cannot fetch
            first = (str(err).splitlines() or [type(err).__name__])[0]
            raise ValueError(f"cannot load the hub data set {inp.name}: {first}") from None
    else:
        ds = _load_folder(Path(inp.path))
        if inp.dict_split:
            ds = ds[inp.dict_split]
    present = [c for c in columns if c in ds.column_names]
    if not present:
        for row in range(len(ds)):
            yield Where(inp.name, row), {}
        return
    row = 0
    for batch in ds.select_columns(present).iter(batch_size=BATCH_ROWS):
        n = len(batch[present[0]])
        for values in _columns_dicts(batch, present, n):
            yield Where(inp.name, row), values
            row += 1
