"""The run directory's one layout (train/run_dir.py), the one atomic write
(data_pipeline/atomic.py) and the one vocabulary fingerprint (data_pipeline/vocab.py)."""

import hashlib
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from data_pipeline import atomic
from data_pipeline.atomic import AtomicFile, atomic_write_json, atomic_write_text
from data_pipeline.shard_writer import write_manifest, write_token_split
from data_pipeline.shards import Manifest, id_dtype, load_manifest
from data_pipeline.streams import TokenStream
from data_pipeline.vocab import ByteVocab, fingerprint
from train.run_dir import RunDir, read_json, shared_store_uri

ROOT = Path(__file__).resolve().parents[1]


def _leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


# ---------------------------------------------------------------------------- atomic writes
def test_atomic_json_replaces_the_file_whole_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "status.json"
    atomic_write_json(path, {"state": "interrupted", "step": 3})
    atomic_write_json(path, {"state": "finished", "step": 7})
    assert json.loads(path.read_text()) == {"state": "finished", "step": 7}
    assert path.read_text().endswith("\n")
    assert _leftovers(tmp_path) == []


def test_a_json_that_fails_to_serialise_leaves_the_old_file_and_no_temporary(
        tmp_path, monkeypatch):
    path = tmp_path / "status.json"
    atomic_write_json(path, {"state": "finished", "step": 7})
    before = path.read_bytes()

    def boom(*args, **kwargs):
        raise TypeError("not serialisable")

    monkeypatch.setattr(atomic.json, "dumps", boom)
    with pytest.raises(TypeError, match="not serialisable"):
        atomic_write_json(path, {"state": "failed", "step": 8})
    assert path.read_bytes() == before
    assert _leftovers(tmp_path) == []


def test_a_write_that_fails_midway_leaves_the_old_file_and_no_partial_file(tmp_path):
    path = tmp_path / "manifest.json"
    atomic_write_text(path, "old content\n")
    with pytest.raises(RuntimeError, match="disk died"), AtomicFile(path) as f:
        f.write(b"half of the new con")
        f.flush()
        # The partial bytes exist, but only under the temporary name.
        assert atomic.temp_name(path).read_bytes() == b"half of the new con"
        raise RuntimeError("disk died")
    assert path.read_text() == "old content\n"
    assert _leftovers(tmp_path) == []


def test_a_failing_fsync_or_rename_leaves_the_old_file_and_no_partial_file(
        tmp_path, monkeypatch):
    path = tmp_path / "tracking.json"
    atomic_write_text(path, "old\n")

    def no_rename(src, dst):
        raise OSError("rename refused")

    monkeypatch.setattr(atomic.os, "replace", no_rename)
    with pytest.raises(OSError, match="rename refused"):
        atomic_write_text(path, "new\n")
    assert path.read_text() == "old\n"
    assert _leftovers(tmp_path) == []


def test_the_temporary_file_is_beside_the_target_and_hidden(tmp_path):
    tmp = atomic.temp_name(tmp_path / "checkpoints" / "latest")
    assert tmp.parent == tmp_path / "checkpoints"          # same file system: a real rename
    assert tmp.name.startswith(".latest.") and str(os.getpid()) in tmp.name


# ---------------------------------------------------------------------------- fingerprint
def test_fingerprint_is_the_sha256_of_compact_sorted_json_whatever_the_key_order():
    a = {"kind": "synthetic", "generator": "words", "size": 16, "extra": {"b": 1, "a": [1, 2]}}
    b = {"size": 16, "extra": {"a": [1, 2], "b": 1}, "generator": "words", "kind": "synthetic"}
    assert fingerprint(a) == fingerprint(b)
    canon = '{"extra":{"a":[1,2],"b":1},"generator":"words","kind":"synthetic","size":16}'
    assert fingerprint(a) == hashlib.sha256(canon.encode("ascii")).hexdigest()
    assert fingerprint(a) != fingerprint({**a, "size": 17})
    # Non-ASCII symbols are escaped, so the bytes hashed do not depend on an encoding.
    assert fingerprint({"symbols": ["é"]}) == hashlib.sha256(
        b'{"symbols":["\\u00e9"]}').hexdigest()


def test_vocab_objects_use_the_same_fingerprint_and_corpus_manifests_keep_theirs():
    # The form `memtrain prepare` always wrote for corpora: their manifests are unchanged.
    assert ByteVocab().fingerprint() == fingerprint(ByteVocab().to_dict()) == \
        hashlib.sha256(b'{"kind":"bytes","size":256}').hexdigest()


def _repeat_manifest(folder, vocab, fp):
    ids = (np.arange(4000) % 16).astype(id_dtype(16))
    info = write_token_split(folder, "train", [ids], id_dtype(16), 512, 4)
    write_manifest(folder, Manifest(kind="tokens", source="repeat_blocks", vocab=vocab,
                                    vocab_fingerprint=fp, vocab_size=16,
                                    dtype=str(id_dtype(16)), chunk_tokens=512,
                                    splits={"train": info}))
    return load_manifest(folder)


def test_data_prepared_with_the_old_synthetic_fingerprint_still_loads_and_resumes(tmp_path):
    """Synthetic and task manifests used to hash json.dumps(vocab, sort_keys=True) (with
    spaces). Such data loads with its stored fingerprint, and a stream state saved on it
    (as in a checkpoint) continues on it."""
    vocab = {"kind": "synthetic", "generator": "repeat_blocks", "size": 16, "block": 12,
             "filler": 4}
    old = hashlib.sha256(json.dumps(vocab, sort_keys=True).encode()).hexdigest()
    assert old != fingerprint(vocab)
    m = _repeat_manifest(tmp_path, vocab, old)
    assert m.vocab_fingerprint == old
    s = TokenStream(m, "train", 2, 8)
    list(itertools.islice(iter(s), 3))
    state = s.state_dict()
    expected = next(iter(s)).tokens
    again = TokenStream(load_manifest(tmp_path), "train", 2, 8)
    again.load_state_dict(state)                # the vocabulary check passes
    assert np.array_equal(next(iter(again)).tokens, expected)


def test_fresh_synthetic_data_gets_the_canonical_fingerprint(tmp_path):
    from data_pipeline.synthetic import write_repeat_corpus

    m = write_repeat_corpus(tmp_path, split_tokens={"train": 2000, "valid": 500,
                                                    "test": 500})
    assert load_manifest(tmp_path).vocab_fingerprint == fingerprint(m.vocab)


# ---------------------------------------------------------------------------- RunDir
def test_run_dir_names_every_file_and_folder_of_a_run(tmp_path):
    run = RunDir(tmp_path / "runs" / "q")
    names = {"config": "config.yaml", "ds_config": "ds_config.json", "status": "status.json",
             "tracking": "tracking.json", "metrics": "metrics.jsonl",
             "loss_curve": "loss_curve.png", "eval_report": "eval_report.json",
             "exported": "model.safetensors", "checkpoints": "checkpoints", "eval_dir": "eval",
             "analysis": "analysis", "jobs": "jobs.jsonl", "sweep": "sweep.json"}
    for prop, name in names.items():
        assert getattr(run, prop) == tmp_path / "runs" / "q" / name, prop
    assert run.hostfile("812") == run.path / "hostfile-812"
    assert run.slurm_log("%j") == run.path / "slurm-%j.out"
    assert run.submit_script("20260101-120000") == run.path / "submit-20260101-120000.sbatch"
    # The runs root's shared MLflow store, and a store of the run's own.
    assert run.runs_root == tmp_path / "runs"
    assert shared_store_uri(run.runs_root) == f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"
    assert run.own_store_uri == f"sqlite:///{tmp_path / 'runs' / 'q' / 'mlflow.db'}"
    # A string path is a Path, and the value is frozen (hashable, comparable).
    assert RunDir(str(run.path)) == run and isinstance(RunDir(str(run.path)).path, Path)
    with pytest.raises(AttributeError):
        run.path = tmp_path


def test_status_round_trip_and_what_a_missing_or_broken_status_reads_as(tmp_path):
    run = RunDir(tmp_path)
    assert run.read_status() == {}
    run.write_status("interrupted", 40)
    assert run.read_status() == {"state": "interrupted", "step": 40}
    run.write_status("finished", 100)
    assert run.read_status() == {"state": "finished", "step": 100}
    assert _leftovers(tmp_path) == []
    with pytest.raises(ValueError, match="zigzag"):
        run.write_status("zigzag", 1)
    assert run.read_status()["state"] == "finished"       # the refused write changed nothing
    run.status.write_text('{"state": "fin')                # e.g. written by hand, cut short
    assert run.read_status() == {}
    run.status.write_text("[1, 2]")
    assert read_json(run.status) == {}


def test_tracking_record_and_last_logged_step(tmp_path):
    run = RunDir(tmp_path)
    assert run.read_tracking() == {} and run.last_step() is None
    run.write_tracking("abc123", "sqlite:///x/mlflow.db", "memtrain")
    assert run.read_tracking() == {"run_id": "abc123", "tracking_uri": "sqlite:///x/mlflow.db",
                                   "experiment": "memtrain"}
    run.metrics.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n')
    assert run.last_step() == 2


def _script_lines(script: str, *starts: str) -> str:
    return "\n".join(line for line in script.splitlines() if line.startswith(starts))


@pytest.mark.parametrize("launcher", ["srun", "deepspeed"])
def test_the_sbatch_script_reads_the_status_and_the_port_through_the_python_entries(
        tmp_path, launcher):
    """The status read and master port lines of a rendered script, run by bash as the job
    would: the state of status.json ("failed" without one), and the port train/distributed.py
    computes for a rank that was given none."""
    from cluster.sbatch import SubmitOptions, render
    from train.distributed import resolve_env

    run = RunDir(tmp_path / "r")
    script = render("configs/quickstart.yaml", [], run.path,
                    SubmitOptions(gpus_per_node=0, python=sys.executable, launcher=launcher))
    lines = _script_lines(script, "export MASTER_PORT=", "RUN_DIR=", "STATE=",
                          "HOSTFILE=") + '\necho "$MASTER_PORT $STATE ${HOSTFILE:-}"'
    env = {**os.environ, "SLURM_JOB_ID": "54321", "PYTHONPATH": str(ROOT)}

    def job():
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", lines], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout.split()

    port = resolve_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1",
                        "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_ID": "54321"}).master_port
    hostfile = [str(run.hostfile("54321"))] if launcher == "deepspeed" else []
    assert job() == [str(port), "failed", *hostfile]
    run.path.mkdir()
    run.write_status("interrupted", 5)
    assert job() == [str(port), "interrupted", *hostfile]
    run.write_status("finished", 9)
    assert job()[1] == "finished"


def test_run_dir_status_command(tmp_path):
    def status(*args):
        return subprocess.run([sys.executable, "-m", "train.run_dir", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)

    assert status("status", str(tmp_path)).stdout == "failed\n"
    RunDir(tmp_path).write_status("interrupted", 3)
    assert status("status", str(tmp_path)).stdout == "interrupted\n"
    assert status().returncode == 2 and "usage" in status().stderr
