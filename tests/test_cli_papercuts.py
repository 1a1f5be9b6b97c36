"""A newcomer's papercuts: relative `--train` paths, one-line CLI errors, intermixed train
options and overrides, a prefetching TokenStream abandoned at exit, one MLflow store per
runs root."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import yaml

from data_pipeline.shard_writer import write_manifest, write_token_split
from data_pipeline.shards import Manifest, id_dtype, load_manifest

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    env["OMP_NUM_THREADS"] = "1"
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


# --------------------------------------------------------------------------- TokenStream exit
ABANDON = """
import sys

from data_pipeline.shards import load_manifest
from data_pipeline.streams import TokenStream

it = iter(TokenStream(load_manifest(sys.argv[1]), "train", 4, 16, prefetch=8))
for _ in range(2000):  # many epochs: the prefetch thread is busy in torch when we leave
    next(it)
"""


def test_a_token_stream_abandoned_mid_epoch_lets_the_interpreter_exit_cleanly(tmp_path):
    # Before the fix, about half of these runs aborted at exit with "terminate called without
    # an active exception" (exit 134): the prefetch thread was still inside torch when the
    # interpreter finalized.
    data = tmp_path / "data"
    data.mkdir()
    info = write_token_split(data, "train", [np.arange(20000) % 1000], id_dtype(1000), 256, 4)
    write_manifest(data, Manifest(kind="tokens", source="t", vocab={"kind": "t"},
                                  vocab_fingerprint="f" * 64, vocab_size=1000,
                                  dtype=str(id_dtype(1000)), chunk_tokens=256,
                                  splits={"train": info}))
    script = tmp_path / "abandon.py"
    script.write_text(ABANDON)

    def run(_):
        return subprocess.run([sys.executable, str(script), str(data)], env=_env(),
                              capture_output=True, text=True, timeout=120)

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run, range(8)))
    codes = [r.returncode for r in results]
    assert codes == [0] * 8, [r.stderr[-300:] for r in results if r.returncode]


# --------------------------------------------------------------------------- memtrain prepare
MEMTRAIN = [sys.executable, "-m", "memtrain.cli"]
TEXT = "the quick brown fox jumps over the lazy dog\n" * 40


def _memtrain(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*MEMTRAIN, *args], cwd=cwd, env=_env(), capture_output=True,
                          text=True, timeout=120)


def test_prepare_finds_relative_train_files_and_globs_in_the_working_directory(tmp_path):
    (tmp_path / "books.txt").write_text(TEXT)
    (tmp_path / "more").mkdir()
    for name in ("a.txt", "b.txt", "v.txt"):
        (tmp_path / "more" / name).write_text(TEXT)
    runs = [["prepare", "--corpus", "text", "--train", "books.txt", "--out", "data/books"],
            ["prepare", "--corpus", "text", "--train", "more/[ab].txt", "--valid",
             "more/v.txt", "--out", "data/more"],
            ["prepare", "--corpus", "text", "--train", "nope.txt", "--out", "data/nope"]]
    with ThreadPoolExecutor(3) as pool:
        books, more, nope = pool.map(lambda a: _memtrain([*a, "--quiet"], tmp_path), runs)
    assert books.returncode == 0 and more.returncode == 0, books.stderr + more.stderr
    m = load_manifest(tmp_path / "data" / "books")
    assert sum(s.n_tokens for s in m.splits.values()) == len(TEXT)
    m = load_manifest(tmp_path / "data" / "more")
    assert m.splits["valid"].n_tokens == len(TEXT)  # test is carved from a.txt + b.txt
    assert m.splits["train"].n_tokens + m.splits["test"].n_tokens == 2 * len(TEXT)
    # The real command's error: one line naming the file and where it was looked for.
    assert nope.returncode == 2 and nope.stderr == (
        f"memtrain prepare: text corpus, train: no file matches 'nope.txt' (relative to "
        f"{tmp_path})\n")


# Each: (command line, words the one error line must contain). All are usage or config
# errors: exit code 2, one line on stderr, no traceback.
BAD_COMMANDS = {
    "missing train file": (["prepare", "--corpus", "text", "--train", "nope.txt", "--out", "o"],
                           ["memtrain prepare:", "nope.txt"]),
    "text without --train": (["prepare", "--corpus", "text", "--out", "o"],
                             ["memtrain prepare:", "--train"]),
    "missing benchmark file": (["prepare", "--corpus", "enwik8", "--out", "o"],
                               ["memtrain prepare:", "enwik8", "--download"]),
    "unknown tokenizer": (["prepare", "--corpus", "text", "--train", "books.txt",
                           "--tokenizer", "zz", "--out", "o"], ["memtrain prepare:", "'zz'"]),
    "prepare: missing option": (["prepare", "--out", "o"], ["memtrain prepare:", "--corpus"]),
    "unwritable --out": (["tasks", "copy", "--src-len", "4", "--out", "books.txt/x"],
                         ["memtrain tasks:", "--out", "books.txt/x"]),
    "bad --param": (["tasks", "copy", "--src-len", "4", "--out", "t", "--param", "n_pairs"],
                    ["memtrain tasks:", "n_pairs", "KEY=INT"]),
    "train: unknown option": (["train", "--config", "quickstart", "--bogus"],
                              ["memtrain train:", "--bogus"]),
    "train: bad value": (["train", "--config", "quickstart", "bptt.mode=zigzag"],
                         ["memtrain train:", "bptt.mode", "zigzag"]),
}


def test_every_cli_error_is_one_line_naming_the_problem_with_exit_code_2(tmp_path,
                                                                         monkeypatch, capsys):
    # In-process (`memtrain` runs exactly this main); a traceback would fail the test.
    from memtrain.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "books.txt").write_text(TEXT)
    for case, (argv, words) in BAD_COMMANDS.items():
        try:
            code = main(argv)
        except SystemExit as stop:  # argparse's way out
            code = stop.code
        lines = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(lines) == 1, (case, code, lines)
        for word in words:
            assert word in lines[0], (case, word, lines[0])
    assert not (tmp_path / "o").exists()  # nothing half-written by a refused command


def test_train_reports_a_run_directory_it_cannot_write_in_one_line(tmp_path, monkeypatch,
                                                                   capsys):
    # The trainer's own errors (config, shards, layout) are one line already; an OSError from
    # the file system (an unwritable run_dir) was a traceback. A stand-in trainer raises it
    # without starting DeepSpeed.
    import train.cli

    def main_entry(cfg, resume):
        raise PermissionError(13, "Permission denied", str(cfg.resolved_run_dir))

    monkeypatch.setattr(train.cli, "main_entry", main_entry)
    code = train.cli.main_train(["--config", "quickstart", f"run_dir={tmp_path}/locked"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"memtrain train: {tmp_path}/locked: Permission denied"]


# --------------------------------------------------------------------------- memtrain train
def test_train_options_and_overrides_mix_in_any_order(capsys):
    from train.cli import main_train, parse_train_args

    args = parse_train_args(["--config", "x", "a=b", "--no-resume", "c=d"])
    assert args.config == "x" and args.no_resume and args.overrides == ["a=b", "c=d"]
    assert main_train(["--config", "quickstart", "model.mem_len=32", "--print-config",
                       "max_steps=70"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["model"]["mem_len"] == 32 and cfg["max_steps"] == 70


# --------------------------------------------------------------------------- one MLflow store
def test_two_runs_share_one_store_under_the_runs_root_and_a_bare_compare_sees_both(
        tmp_path, monkeypatch, capsys):
    from train_helpers import run_train, tiny_config

    from compare.cli import main_compare

    configs = [tiny_config(tmp_path, name, max_steps=4, eval={"every": 2, "max_segments": 2},
                           tracking={}) for name in ("first", "second")]
    (tmp_path / "runs" / "mlflow.db").unlink()   # tiny_config's ready store: no new one
    with ThreadPoolExecutor(2) as pool:  # at once: both open the new store (the lock's job)
        list(pool.map(lambda c: run_train(c, launcher="single",
                                          env={"MLFLOW_TRACKING_URI": ""}), configs))
    runs = tmp_path / "runs"
    shared = f"sqlite:///{runs.absolute()}/mlflow.db"
    ids = []
    for name in ("first", "second"):
        state = json.loads((runs / name / "tracking.json").read_text())
        assert state["tracking_uri"] == shared and not (runs / name / "mlflow.db").exists()
        ids.append(state["run_id"])
    assert (runs / "mlartifacts").is_dir()

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)  # the project root: its runs/ is the default runs root
    assert main_compare(["--no-log", "--out", "report"]) == 0
    assert "compared 2 runs (0 incomplete" in capsys.readouterr().out
    summary = (tmp_path / "report" / "report.md").read_text()
    assert all(run_id in summary for run_id in ids)


def test_a_run_made_with_its_own_store_keeps_it_without_a_uri(tmp_path):
    # Runs made before the shared default have runs/<name>/mlflow.db, named in tracking.json:
    # evaluating or resuming them (no tracking.uri set) must go on in that run.
    from train.tracking import Tracker, TrackingWarning

    run_dir = tmp_path / "runs" / "old"
    own = f"sqlite:///{run_dir.absolute()}/mlflow.db"
    first = Tracker(run_dir, tracking_uri=own)
    first.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error", TrackingWarning)  # no "tracking URI changed"
        again = Tracker(run_dir)
    again.close()
    assert (again.tracking_uri, again.run_id) == (own, first.run_id)
    assert not (tmp_path / "runs" / "mlflow.db").exists()


def test_compare_runs_root_names_the_shared_store_and_wins_over_the_environment(
        tmp_path, monkeypatch, capsys):
    from compare.cli import main_compare

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # never asked
    assert main_compare(["--runs-root", str(tmp_path / "elsewhere"), "--no-log"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{tmp_path}/elsewhere/mlflow.db does not exist" in err[0]
    assert not (tmp_path / "elsewhere").exists()
