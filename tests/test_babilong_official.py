"""The reader of BABILong's published files (data_pipeline/babilong/official.py): small files
written here in each of the hub's layouts are found and read back; each error names the
path and what is there. Nothing is downloaded."""

from __future__ import annotations

import json
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_pipeline.babilong.official import (
    OfficialDataError,
    OfficialSample,
    find_official,
    read_official,
)


def _records(task: str, length: str, n: int) -> list[dict]:
    return [{"input": f"ctx {task} {length} {i}. Mary went to the kitchen.",
             "question": f"Where is Mary? ({i})", "target": "kitchen"} for i in range(n)]


def _expected(task, length, n, start=0):
    return [OfficialSample(task, length, r["input"], r["question"], r["target"])
            for r in _records(task, length, start + n)[start:]]


def _json(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(records))


def _jsonl(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _parquet(path, records, columns=("target", "question", "input")):
    # the hub's files order the columns differently from split to split; any order reads
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({c: [r[c] for r in records] for c in columns}), path)


# ------------------------------------------------------------------------- the layouts
def test_json_lists_in_data_task_length_layout_are_read(tmp_path):
    # RMT-team/babilong today: data/<task>/<length>.json, a JSON list of records
    for task in ("qa1", "qa2"):
        for length in ("0k", "4k"):
            _json(tmp_path / "data" / task / f"{length}.json", _records(task, length, 3))
    (tmp_path / "README.md").write_text("---\nconfigs: []\n---\n")
    assert sorted(find_official(tmp_path)) == [("0k", "qa1"), ("0k", "qa2"),
                                               ("4k", "qa1"), ("4k", "qa2")]
    got = read_official(tmp_path, tasks=["qa2", "qa1"], lengths=["4k"])
    assert got == _expected("qa2", "4k", 3) + _expected("qa1", "4k", 3)


def test_parquet_in_length_task_layout_with_shards_is_read_in_shard_order(tmp_path):
    # RMT-team/babilong-1k-samples: <length>/<task>-NNNNN-of-NNNNN.parquet
    recs = _records("qa3", "128k", 5)
    _parquet(tmp_path / "128k" / "qa3-00001-of-00002.parquet", recs[3:])
    _parquet(tmp_path / "128k" / "qa3-00000-of-00002.parquet", recs[:3])
    _parquet(tmp_path / "8k" / "qa3-00000-of-00001.parquet", _records("qa3", "8k", 2))
    found = find_official(tmp_path)
    assert [p.name for p in found[("128k", "qa3")]] == ["qa3-00000-of-00002.parquet",
                                                        "qa3-00001-of-00002.parquet"]
    assert list(found) == [("8k", "qa3"), ("128k", "qa3")]  # lengths by size, not by name
    assert read_official(tmp_path, lengths=["128k"]) == _expected("qa3", "128k", 5)


def test_parquet_in_task_length_layout_is_read(tmp_path):
    # earlier revisions of RMT-team/babilong: <task>/<length>-00000-of-00001.parquet
    _parquet(tmp_path / "qa5" / "1M-00000-of-00001.parquet", _records("qa5", "1M", 2))
    assert read_official(tmp_path) == _expected("qa5", "1M", 2)


def test_the_hubs_parquet_conversion_layout_is_read(tmp_path):
    # refs/convert/parquet: <config>/<split>/0000.parquet, numbered files in order
    recs = _records("qa4", "2k", 4)
    _parquet(tmp_path / "2k" / "qa4" / "0000.parquet", recs[:2])
    _parquet(tmp_path / "2k" / "qa4" / "0001.parquet", recs[2:])
    assert read_official(tmp_path) == _expected("qa4", "2k", 4)


def test_json_lines_are_read_from_jsonl_and_from_json(tmp_path):
    _jsonl(tmp_path / "qa1" / "1k.jsonl", _records("qa1", "1k", 3))
    _jsonl(tmp_path / "qa2" / "1k.json", _records("qa2", "1k", 2))  # one record a line
    assert read_official(tmp_path) == _expected("qa1", "1k", 3) + _expected("qa2", "1k", 2)


def test_a_hub_snapshot_folder_and_a_folder_above_it_read_the_same(tmp_path):
    snap = tmp_path / "datasets--RMT-team--babilong" / "snapshots" / "abc123"
    _json(snap / "data" / "qa1" / "0k.json", _records("qa1", "0k", 2))
    # the hub client's bookkeeping mirrors the tree under a hidden folder: not data
    hidden = snap / ".cache" / "huggingface" / "download" / "data" / "qa1" / "0k.json"
    hidden.parent.mkdir(parents=True)
    hidden.write_text("not data")
    assert read_official(snap) == read_official(tmp_path) == _expected("qa1", "0k", 2)


def test_a_root_at_one_length_folder_still_knows_the_length(tmp_path):
    _parquet(tmp_path / "16k" / "qa1-00000-of-00001.parquet", _records("qa1", "16k", 1))
    assert read_official(tmp_path / "16k") == _expected("qa1", "16k", 1)


def test_limit_takes_the_first_records_of_each_split(tmp_path):
    recs = _records("qa1", "4k", 6)
    _parquet(tmp_path / "4k" / "qa1-00000-of-00002.parquet", recs[:2])
    _parquet(tmp_path / "4k" / "qa1-00001-of-00002.parquet", recs[2:])
    _json(tmp_path / "4k" / "qa2.json", _records("qa2", "4k", 6))
    got = read_official(tmp_path, limit=3)
    assert got == _expected("qa1", "4k", 3) + _expected("qa2", "4k", 3)
    assert read_official(tmp_path, limit=0) == []
    assert len(read_official(tmp_path, limit=100)) == 12
    with pytest.raises(ValueError, match="limit"):
        read_official(tmp_path, limit=-1)


def test_by_default_every_split_found_is_read_length_by_length(tmp_path):
    for length in ("2k", "0k"):
        for task in ("qa10", "qa2"):
            _json(tmp_path / "data" / task / f"{length}.json", _records(task, length, 1))
    got = read_official(tmp_path)
    assert [(s.length, s.task) for s in got] == [("0k", "qa2"), ("0k", "qa10"),
                                                 ("2k", "qa2"), ("2k", "qa10")]


def test_files_that_name_no_length_and_task_are_ignored(tmp_path):
    _json(tmp_path / "data" / "qa1" / "0k.json", _records("qa1", "0k", 1))
    _json(tmp_path / "data" / "qa1" / "notes.json", [{"x": 1}])
    _json(tmp_path / "data" / "qa21" / "0k.json", [{"x": 1}])  # bAbI has qa1..qa20
    _json(tmp_path / "dataset_info.json", {"x": 1})
    assert list(find_official(tmp_path)) == [("0k", "qa1")]


# ------------------------------------------------------------------------------ errors
def test_a_missing_root_is_an_error_naming_it(tmp_path):
    with pytest.raises(OfficialDataError, match=f"{tmp_path / 'nope'} is not a folder"):
        find_official(tmp_path / "nope")


def test_a_folder_without_babilong_files_is_an_error_naming_it(tmp_path):
    (tmp_path / "README.md").write_text("hi")
    with pytest.raises(OfficialDataError, match=f"no BABILong files under {tmp_path}"):
        read_official(tmp_path)


def test_an_absent_length_is_an_error_listing_the_lengths_there(tmp_path):
    _json(tmp_path / "data" / "qa1" / "0k.json", _records("qa1", "0k", 1))
    _json(tmp_path / "data" / "qa1" / "8k.json", _records("qa1", "8k", 1))
    with pytest.raises(OfficialDataError,
                       match=f"no length '64k' under {tmp_path}; lengths there: 0k, 8k"):
        read_official(tmp_path, lengths=["0k", "64k"])


def test_an_absent_task_is_an_error_listing_the_tasks_there(tmp_path):
    for task in ("qa1", "qa2"):
        _json(tmp_path / "data" / task / "0k.json", _records(task, "0k", 1))
    _json(tmp_path / "data" / "qa3" / "1k.json", _records("qa3", "1k", 1))
    with pytest.raises(OfficialDataError,
                       match=f"no qa3 at length 0k under {tmp_path}; tasks there at 0k: "
                             "qa1, qa2"):
        read_official(tmp_path, tasks=["qa1", "qa3"], lengths=["0k"])


def test_a_record_lacking_a_field_is_an_error_naming_file_record_and_field(tmp_path):
    recs = _records("qa1", "0k", 3)
    del recs[2]["target"]
    _json(tmp_path / "data" / "qa1" / "0k.json", recs)
    path = tmp_path / "data" / "qa1" / "0k.json"
    with pytest.raises(OfficialDataError, match=f"{path}, record 2 lacks field 'target'"):
        read_official(tmp_path)


def test_a_field_that_is_not_text_is_an_error(tmp_path):
    recs = _records("qa1", "0k", 1)
    recs[0]["question"] = None
    _jsonl(tmp_path / "data" / "qa1" / "0k.jsonl", recs)
    with pytest.raises(OfficialDataError, match="record 0 has a non-text field 'question'"):
        read_official(tmp_path)


def test_a_parquet_file_lacking_a_column_is_an_error_naming_it(tmp_path):
    path = tmp_path / "0k" / "qa1-00000-of-00001.parquet"
    _parquet(path, _records("qa1", "0k", 2), columns=("input", "target"))
    with pytest.raises(OfficialDataError, match=f"{path}: no column 'question'"):
        read_official(tmp_path)


def test_a_json_file_that_is_not_records_is_an_error_naming_it(tmp_path):
    path = tmp_path / "data" / "qa1" / "0k.json"
    path.parent.mkdir(parents=True)
    path.write_text('"just a string"')
    with pytest.raises(OfficialDataError, match=f"{path}: expected a JSON list of records"):
        read_official(tmp_path)
    path.write_text('{"input": "a", "question": "b", "target": "c"}\n{broken\n')
    with pytest.raises(OfficialDataError, match=f"{path}, line 2: not JSON"):
        read_official(tmp_path)


def test_parquet_without_pyarrow_is_an_error_naming_the_file(tmp_path, monkeypatch):
    path = tmp_path / "0k" / "qa1-00000-of-00001.parquet"
    _parquet(path, _records("qa1", "0k", 1))
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import now fails
    with pytest.raises(OfficialDataError, match=f"reading {path} needs pyarrow"):
        read_official(tmp_path)


def test_json_reads_without_pyarrow(tmp_path, monkeypatch):
    _json(tmp_path / "data" / "qa1" / "0k.json", _records("qa1", "0k", 1))
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    assert read_official(tmp_path) == _expected("qa1", "0k", 1)


def test_a_missing_shard_is_an_error_naming_the_folder(tmp_path):
    _parquet(tmp_path / "128k" / "qa1-00000-of-00003.parquet", _records("qa1", "128k", 1))
    _parquet(tmp_path / "128k" / "qa1-00002-of-00003.parquet", _records("qa1", "128k", 1))
    with pytest.raises(OfficialDataError,
                       match=f"{tmp_path / '128k'}: shards of .* incomplete: 2 of 3 present, "
                             r"missing \[1\]"):
        find_official(tmp_path)


def _other(task: str, length: str, n: int) -> list[dict]:
    """Records that tell a second copy of a split from the first."""
    return [{**r, "question": r["question"] + " (other copy)"}
            for r in _records(task, length, n)]


def test_a_split_in_two_formats_is_read_in_the_format_datasets_infers_for_the_folder(
        tmp_path):
    # datasets reads one format per folder: the most common extension among its data files
    # (here json, 3 files to 1), and on a tie parquet.
    for task in ("qa1", "qa2", "qa3"):
        _json(tmp_path / "data" / task / "0k.json", _records(task, "0k", 2))
    _parquet(tmp_path / "0k" / "qa1-00000-of-00001.parquet", _other("qa1", "0k", 2))
    assert find_official(tmp_path)[("0k", "qa1")] == (tmp_path / "data" / "qa1" / "0k.json",)
    assert read_official(tmp_path, tasks=["qa1"]) == _expected("qa1", "0k", 2)
    tie = tmp_path / "tie"
    _json(tie / "data" / "qa1" / "0k.json", _records("qa1", "0k", 2))
    _parquet(tie / "0k" / "qa1-00000-of-00001.parquet", _other("qa1", "0k", 2))
    assert find_official(tie)[("0k", "qa1")] == (tie / "0k" / "qa1-00000-of-00001.parquet",)


CARD = """---
configs:
- config_name: 4k
  data_files:
  - split: qa1
    path: 4k/qa1-*
- config_name: qa1
  data_files:
  - split: 4k
    path: qa1/4k-*
---
# BABILong
"""


def test_a_split_in_two_layouts_of_a_hub_snapshot_is_read_as_its_dataset_card_says(
        tmp_path, monkeypatch):
    # An earlier RMT-team/babilong revision held config <length> in <length>/<task>-*.parquet
    # and config <task> in <task>/<length>-*.parquet: the same split twice, one format.
    snap = tmp_path / "datasets--RMT-team--babilong" / "snapshots" / "abc123"
    _parquet(snap / "4k" / "qa1-00000-of-00001.parquet", _records("qa1", "4k", 3))
    _parquet(snap / "qa1" / "4k-00000-of-00001.parquet", _other("qa1", "4k", 3))
    (snap / "README.md").write_text(CARD)
    assert read_official(tmp_path) == _expected("qa1", "4k", 3)
    # ... which is what datasets itself reads for load_dataset(<snapshot>, "4k")["qa1"]
    import datasets.config
    for key in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(key, "1")
        monkeypatch.setattr(datasets.config, key, True)
    theirs = datasets.load_dataset(str(snap), "4k", split="qa1",
                                   cache_dir=str(tmp_path / "cache"))
    assert [r["question"] for r in theirs] == [r["question"] for r in _records("qa1", "4k", 3)]


def test_the_same_split_in_two_hub_revisions_is_an_error_naming_both(tmp_path):
    # two revisions under one root: which one is meant is the caller's choice
    a = tmp_path / "snapshots" / "rev1" / "data" / "qa1" / "0k.json"
    b = tmp_path / "snapshots" / "rev2" / "0k" / "qa1-00000-of-00001.parquet"
    _json(a, _records("qa1", "0k", 1))
    _parquet(b, _records("qa1", "0k", 1))
    with pytest.raises(OfficialDataError, match="qa1 at length 0k .* more than once") as e:
        find_official(tmp_path)
    assert str(a) in str(e.value) and str(b) in str(e.value)
