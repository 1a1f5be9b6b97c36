"""BABILong's published test sets, read from local disk (this module never downloads).

The authors publish the benchmark on the Hugging Face hub as RMT-team/babilong (100 samples
per task and length) and RMT-team/babilong-1k-samples (1000); see the README of
github.com/booydar/babilong. Every record has three string fields:

    "input"     the context: background text with the task's facts inside
    "question"  e.g. "Where is Mary?"
    "target"    the answer label, e.g. "bathroom"

(the datasets' cards list these features; the authors' scripts/run_model_on_babilong.py reads
sample['input'], ['question'], ['target']). A dataset config is a length ("0k", "1k", "2k",
"4k", ... "128k", "256k", "512k", "1M", "10M") and a split is a task ("qa1" .. "qa20"):
`datasets.load_dataset("RMT-team/babilong", "4k")["qa1"]`. On disk the files have been laid
out in several ways over the repositories' history, and all of them are accepted here:

    data/qa1/4k.json                      RMT-team/babilong today, and babilong-train-5k-samples
                                          (the authors' data/create_tasks.py writes
                                          <task>/<length>.json: a JSON list of records)
    4k/qa1-00000-of-00001.parquet         RMT-team/babilong-1k-samples (larger lengths come in
                                          several shards, 128k/qa1-00000-of-00002.parquet ...),
                                          and earlier revisions of RMT-team/babilong
    qa1/4k-00000-of-00001.parquet         earlier revisions of RMT-team/babilong
    4k/qa1/0000.parquet                   the hub's automatic parquet conversion

that is: a file named by the task inside a folder named by the length, or the other way round,
with an optional "-NNNNN-of-NNNNN" shard suffix, or numbered files inside <length>/<task>/ or
<task>/<length>/. Files are .parquet (read with pyarrow), .json (a JSON list, or one record a
line) or .jsonl. The root may be a hub snapshot (…/snapshots/<revision>/) or any folder above
the files; other files (README.md, .gitattributes, the hub's .cache/) are ignored. A split
held in several layouts of one snapshot is read from the one `datasets.load_dataset` reads
(find_official).

Length labels are kept as written ("4k"): BABILong's k is 1000 GPT-2 tokens, less about 300
for the prompt (data/create_tasks.py), not this project's tokens.
"""

from __future__ import annotations

import fnmatch
import json
import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

FIELDS = ("input", "question", "target")
SUFFIXES = (".parquet", ".json", ".jsonl")

_TASK = re.compile(r"qa(?:[1-9]|1\d|20)")
_LENGTH = re.compile(r"(\d+)([kM])")
_SHARD = re.compile(r"(?P<base>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})")


class OfficialDataError(ValueError):
    """BABILong's files are missing, incomplete or not in a format this reader knows."""


@dataclass(frozen=True)
class OfficialSample:
    """One published sample; `context` is the record's "input" field."""
    task: str
    length: str
    context: str
    question: str
    target: str


def _order(length: str) -> tuple[int, str]:
    """Sort key of a length label: by size ("2k" before "16k" before "1M")."""
    m = _LENGTH.fullmatch(length)
    return (int(m.group(1)) * (1000 if m.group(2) == "k" else 1_000_000), length) if m \
        else (-1, length)


def _task_order(task: str) -> int:
    return int(task[2:])


def _key(path: Path) -> tuple[str, str, str] | None:
    """(length, task, group) of a data file, or None when its place in the tree names no
    length and task. Files of one group are the shards of one split."""
    name = path.name[: -len(path.suffix)]
    shard = _SHARD.fullmatch(name)
    base = shard.group("base") if shard else name
    parent, grand = path.parent.name, path.parent.parent.name
    if base.isdigit():  # the hub's conversion: <config>/<split>/0000.parquet
        first, second = grand, parent
    else:
        first, second = parent, base
    for length, task in ((first, second), (second, first)):
        if _LENGTH.fullmatch(length) and _TASK.fullmatch(task):
            group = str(path.parent / base) if not base.isdigit() else str(path.parent)
            return length, task, group + path.suffix
    return None


def find_official(root: Path) -> dict[tuple[str, str], tuple[Path, ...]]:
    """(length, task) -> the file(s) holding that split under `root`, in shard order.

    A split comes in one file, or in shards "-00000-of-0000N" that must all be present.
    A split found in several layouts of one snapshot is read from the one
    `datasets.load_dataset(<snapshot>, length)[task]` reads (`_as_datasets_reads`); found in
    two hub revisions under one root (…/snapshots/<a>/ and …/snapshots/<b>/), or where no
    rule tells the layouts apart, it is an error that names every copy."""
    root = Path(root)
    if not root.is_dir():
        raise OfficialDataError(f"BABILong files: {root} is not a folder")
    groups: dict[tuple[str, str], dict[str, list[Path]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).parts
        if path.suffix not in SUFFIXES or any(p.startswith(".") for p in rel) \
                or not path.is_file():
            continue
        key = _key(path)
        if key is not None:
            groups[key[:2]][key[2]].append(path)
    if not groups:
        raise OfficialDataError(
            f"no BABILong files under {root}: expected <length>/<task>*.parquet, "
            f"data/<task>/<length>.json or the like (length 0k..10M, task qa1..qa20; "
            f"{', '.join(SUFFIXES)})")
    found = {}
    for (length, task), by_group in groups.items():
        if len(by_group) > 1:
            by_group = _as_datasets_reads(root, length, task, by_group, groups)
        if len(by_group) > 1:
            where = "; ".join(str(p) for files in by_group.values() for p in files)
            raise OfficialDataError(f"{task} at length {length} is under {root} more than "
                                    f"once: {where} (point at one copy)")
        (files,) = by_group.values()
        found[(length, task)] = tuple(_check_shards(sorted(files)))
    return dict(sorted(found.items(), key=lambda kv: (_order(kv[0][0]), _task_order(kv[0][1]))))


def _snapshot(root: Path, path: Path) -> Path:
    """The hub snapshot a file belongs to (…/snapshots/<revision>), else `root`."""
    parts = path.relative_to(root).parts
    for i, part in enumerate(parts[:-2]):
        if part == "snapshots":
            return root.joinpath(*parts[:i + 2])
    return root


def _as_datasets_reads(root: Path, length: str, task: str, by_group: dict,
                       groups: dict) -> dict:
    """Of the groups holding one split in several layouts, the one `datasets` (5.x,
    datasets/load.py) reads for `load_dataset(<snapshot>, length)[task]`:

    1. The dataset card's `configs` (README.md front matter) decide when they name the
       split: config `length`, split `task`, whose `path` patterns (relative to the card)
       match a group's files. RMT-team/babilong's card names data/<task>/<length>.json
       today; earlier revisions held <length>/<task>-*.parquet and <task>/<length>-*.parquet
       side by side, the card naming the first for config <length>.
    2. Otherwise datasets infers one format for the whole folder: the file extension most
       common among its data files, a tie going to .parquet, then .jsonl, then .json
       (`infer_module_for_data_files_list`), and reads only the files of that format
       (.json and .jsonl are one format, its json loader).

    Groups in different hub revisions are left as they are (the caller refuses them), as
    are groups no rule tells apart."""
    snapshots = {_snapshot(root, files[0]) for files in by_group.values()}
    if len(snapshots) > 1:
        return by_group
    (snapshot,) = snapshots
    declared = {g: files for g, files in by_group.items()
                if _card_names(snapshot, length, task, files)}
    if len(declared) == 1:
        return declared
    formats = Counter(p.suffix for gs in groups.values() for fs in gs.values() for p in fs
                      if _snapshot(root, p) == snapshot)
    rank = {".parquet": 2, ".jsonl": 1, ".json": 0}
    best = max(formats, key=lambda ext: (formats[ext], rank[ext]))
    module = _FORMAT[best]
    chosen = {g: files for g, files in by_group.items() if _FORMAT[files[0].suffix] == module}
    return chosen or by_group


_FORMAT = {".parquet": "parquet", ".json": "json", ".jsonl": "json"}


def _card_names(snapshot: Path, length: str, task: str, files: list[Path]) -> bool:
    """Whether the dataset card nearest above `files` (a README.md between their folder and
    the snapshot) names them as split `task` of config `length`."""
    folder = files[0].parent
    while not (folder / "README.md").is_file() and folder != snapshot \
            and snapshot in folder.parents:
        folder = folder.parent
    for pattern in _card_patterns(folder / "README.md", length, task):
        if all(fnmatch.fnmatchcase(f.relative_to(folder).as_posix(), pattern)
               for f in files):
            return True
    return False


def _card_patterns(card: Path, length: str, task: str) -> list[str]:
    """The data_files path patterns a dataset card gives split `task` of config `length`
    ([] without a card, a front matter or such a split)."""
    try:
        text = card.read_text(encoding="utf-8")
    except OSError:
        return []
    if not text.startswith("---"):
        return []
    import yaml
    try:
        meta = yaml.safe_load(text.split("---", 2)[1]) or {}
    except (yaml.YAMLError, IndexError):
        return []
    configs = meta.get("configs") if isinstance(meta, dict) else None
    for config in configs if isinstance(configs, list) else []:
        if not isinstance(config, dict) or config.get("config_name") != length:
            continue
        for split in config.get("data_files") or []:
            if isinstance(split, dict) and split.get("split") == task:
                paths = split.get("path")
                return [paths] if isinstance(paths, str) else [str(p) for p in paths or []]
    return []


def _check_shards(files: list[Path]) -> list[Path]:
    shards = [_SHARD.fullmatch(f.name[: -len(f.suffix)]) for f in files]
    if not any(shards):
        return files
    count = int(shards[0].group("count"))
    have = {int(m.group("index")) for m in shards if m}
    missing = sorted(set(range(count)) - have)
    if missing or len(files) != count:
        raise OfficialDataError(f"{files[0].parent}: shards of {files[0].name} incomplete: "
                                f"{len(have)} of {count} present, missing {missing}")
    return files


def _records_json(path: Path):
    """A .json file holds a JSON list of records (what data/create_tasks.py writes), or, like
    a .jsonl file, one record a line (also accepted by `datasets`' json loader)."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            pass  # not one JSON value: read it as one record a line
        else:
            if isinstance(data, list):
                return data
            if isinstance(data, dict):
                return [data]
            raise OfficialDataError(f"{path}: expected a JSON list of records, found "
                                    f"{type(data).__name__}")
    records = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise OfficialDataError(f"{path}, line {n}: not JSON ({e.msg})") from None
    return records


def _records_parquet(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise OfficialDataError(f"reading {path} needs pyarrow (pip install pyarrow)") \
            from None
    file = pq.ParquetFile(path)
    names = file.schema_arrow.names
    absent = [f for f in FIELDS if f not in names]
    if absent:
        raise OfficialDataError(f"{path}: no column {', '.join(map(repr, absent))} "
                                f"(columns: {names}); BABILong records have {list(FIELDS)}")
    for batch in file.iter_batches(batch_size=64, columns=list(FIELDS)):
        yield from batch.to_pylist()


def _read_split(files: tuple[Path, ...], length: str, task: str, limit: int | None):
    out: list[OfficialSample] = []
    for path in files:
        records = _records_parquet(path) if path.suffix == ".parquet" else _records_json(path)
        for n, rec in enumerate(records):
            if limit is not None and len(out) >= limit:
                return out
            if not isinstance(rec, dict):
                raise OfficialDataError(f"{path}, record {n}: not an object")
            for f in FIELDS:
                if not isinstance(rec.get(f), str):
                    what = "lacks field" if f not in rec else "has a non-text field"
                    raise OfficialDataError(f"{path}, record {n} {what} {f!r} "
                                            f"(fields: {sorted(rec)})")
            out.append(OfficialSample(task, length, rec["input"], rec["question"],
                                      rec["target"]))
    return out


def read_official(root: Path, tasks=None, lengths=None, limit: int | None = None
                  ) -> list[OfficialSample]:
    """The published samples of `tasks` x `lengths` (default: all found), length by length
    and task by task in the order asked, each split's records in file order; `limit` takes
    at most that many records of each (length, task). Every split asked for must be there."""
    root = Path(root)
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, not {limit}")
    found = find_official(root)
    have_lengths = sorted({k[0] for k in found}, key=_order)
    have_tasks = sorted({k[1] for k in found}, key=_task_order)
    lengths = list(dict.fromkeys(lengths)) if lengths is not None else have_lengths
    tasks = list(dict.fromkeys(tasks)) if tasks is not None else have_tasks
    for length in lengths:
        if length not in have_lengths:
            raise OfficialDataError(f"no length {length!r} under {root}; lengths there: "
                                    f"{', '.join(have_lengths)}")
        there = [t for t in have_tasks if (length, t) in found]
        absent = [t for t in tasks if (length, t) not in found]
        if absent:
            raise OfficialDataError(f"no {', '.join(absent)} at length {length} under {root};"
                                    f" tasks there at {length}: {', '.join(there)}")
    samples = []
    for length in lengths:
        for task in tasks:
            samples += _read_split(found[(length, task)], length, task, limit)
    return samples
