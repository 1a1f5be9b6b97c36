"""Shared pieces of the training tests: a learnable tiny corpus, a tiny run config, and
launching `python -m train` as 1 process or 2 ranks (torchrun / deepspeed launcher)."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import yaml
from daemons import free_port  # noqa: F401  (the tests import it from here)
from slurm_cluster import LAUNCHER_VARIABLES

from data_pipeline.shard_writer import write_manifest, write_token_split
from data_pipeline.shards import Manifest, id_dtype
from data_pipeline.vocab import fingerprint
from train.run_dir import STORE

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
V = 16


def make_word_corpus(path: Path, n_train: int = 60_000, n_valid: int = 6_000, seed: int = 0):
    """Random 'words' (fixed 3-5 symbol spellings) in random order: inside a word the next
    symbol is certain, so a tiny model's loss falls within a few dozen steps."""
    path.mkdir(parents=True, exist_ok=True)
    if (path / "manifest.json").exists():
        return path
    rng = np.random.default_rng(seed)
    words = [rng.integers(0, V, rng.integers(3, 6)) for _ in range(10)]
    splits = {}
    for split, n in (("train", n_train), ("valid", n_valid), ("test", n_valid)):
        out, total = [], 0
        while total < n:
            w = words[rng.integers(len(words))]
            out.append(w)
            total += len(w)
        ids = np.concatenate(out)[:n].astype(id_dtype(V))
        splits[split] = write_token_split(path, split, [ids], id_dtype(V), 8192, 4)
    vocab = {"kind": "synthetic", "generator": "words", "size": V}
    write_manifest(path, Manifest(
        kind="tokens", source="words", vocab=vocab,
        vocab_fingerprint=fingerprint(vocab),
        vocab_size=V, dtype=str(id_dtype(V)), chunk_tokens=8192, splits=splits))
    return path


def tiny_config(tmp: Path, name: str = "t", **sections) -> Path:
    """A YAML run config for a 2-layer model on the word corpus; `sections` update it.

    MLflow tracking is off unless `sections` has a `tracking` section: importing MLflow and
    opening its store cost a launch 2.5-3 s on the 2-core machine, and most runs here test
    the engine. What tracking must do, across ranks, resumes, signals, servers and
    comparisons, is tested by the runs that ask for it (tracking={} turns it on)."""
    cfg = {
        "name": name, "run_dir": str(tmp / "runs" / name), "max_steps": 12, "log_every": 1,
        "threads": 1,
        "model": {"mechanism": "xl", "vocab_size": V, "n_layer": 2, "d_model": 32,
                  "n_head": 2, "d_inner": 64, "tgt_len": 8, "mem_len": 8, "dropout": 0.1},
        "data": {"path": str(make_word_corpus(tmp / "data")), "global_batch": 4},
        "optim": {"lr": 3e-3, "schedule": "constant"},
        "eval": {"max_segments": 10},
        "tracking": {"enabled": "tracking" in sections},
    }
    for key, value in sections.items():
        if isinstance(value, dict):
            cfg.setdefault(key, {}).update(value)
        else:
            cfg[key] = value
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    store = tmp / "runs" / STORE
    if not store.exists():   # the runs' shared MLflow store, as the first run would make it
        store.parent.mkdir(parents=True, exist_ok=True)
        # Never over a store in use: two workers may make configs in one root (conftest's
        # zero_run), so the copy appears under its name in one step, or not at all.
        part = store.with_name(f"{store.name}.{os.getpid()}.part")
        shutil.copyfile(_empty_store(), part)
        try:
            os.link(part, store)
        except FileExistsError:
            pass
        finally:
            part.unlink()
    return path


def _empty_store() -> Path:
    """An empty MLflow sqlite store at the head of MLflow's schema, made once per MLflow
    version and copied into each test's runs root. Making a store runs MLflow's schema
    migrations, 3-7 s on the 2-core machine, which every launch into a fresh runs root paid;
    making one is tested where it is the subject (tests/test_tracking.py). Shared by the
    suite's workers under a lock."""
    from importlib.metadata import version

    path = ROOT / ".cache" / f"mlflow-{version('mlflow')}-empty.db"
    if path.exists():
        return path
    path.parent.mkdir(exist_ok=True)
    with path.with_suffix(".lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            from mlflow import MlflowClient

            part = path.with_suffix(".part")
            part.unlink(missing_ok=True)
            MlflowClient(f"sqlite:///{part}").search_experiments()   # migrates to the head
            part.rename(path)
    return path


def child_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_ext"))
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = str(ROOT)
    for key in LAUNCHER_VARIABLES:
        env.pop(key, None)
    env.update(extra or {})
    return env


def train_cmd(config: Path, overrides=(), nproc: int = 1, launcher: str = "local"):
    """The command that trains `config` on `nproc` ranks. launcher "local" (the default):
    one rank runs `python -m train` alone, several run under tests/launch_ranks.py (the
    rank variables torchrun sets, without torchrun's start-up); "single": `memtrain train`;
    "torchrun" and "deepspeed": those launchers, for the tests of what they do."""
    args = ["--config", str(config), *overrides]
    if nproc == 1 and launcher == "single":
        return [str(BIN / "memtrain"), "train", *args]
    if launcher == "local":
        return ranks_cmd(nproc, ["-m", "train", *args])
    if launcher == "deepspeed":
        return [str(BIN / "deepspeed"), "--num_gpus", str(nproc), "--master_port",
                str(free_port()), "--module", "train", *args]
    assert launcher == "torchrun", launcher
    return [str(BIN / "torchrun"), "--nproc_per_node", str(nproc), "--master_port",
            str(free_port()), "-m", "train", *args]


def ranks_cmd(nproc: int, python_args: list[str]) -> list[str]:
    """`python python_args...` on `nproc` local ranks: alone for one (no launcher), else
    under tests/launch_ranks.py."""
    if nproc == 1:
        return [sys.executable, *python_args]
    return [sys.executable, str(ROOT / "tests" / "launch_ranks.py"), str(nproc),
            str(free_port()), *python_args]


def run_train(config: Path, overrides=(), nproc: int = 1, launcher: str = "local",
              env: dict | None = None, timeout: int = 1200, check: bool = True):
    """Train `config` to the end (train_cmd says what `launcher` runs); the finished
    process, its output kept; `check`: fail the test unless it exited 0."""
    return run_launch(train_cmd(config, overrides, nproc, launcher), env, timeout, check)


# What zero_run's XL runs save beside their checkpoints: the Adam state the engine held at the
# end of training (tests/optimizer_probe.py --after-training).
ADAM_AFTER_TRAINING = "adam_after_training.pt"


def run_optimizer_probe(config: Path, out: Path, nproc: int, *args: str) -> str:
    """tests/optimizer_probe.py on `nproc` ranks (its docstring says what `args` choose):
    the Adam state lands in `out`; returns the launch's stdout and stderr."""
    cmd = ranks_cmd(nproc, [str(ROOT / "tests" / "optimizer_probe.py"), str(config), str(out),
                            *args])
    done = run_launch(cmd, None, 1200, True)
    return done.stdout + done.stderr


def run_launch(cmd: list[str], env: dict | None, timeout: int, check: bool):
    # `timeout` guards against a hung run only: 2 ranks beside a busy suite on 2 cores have
    # taken over 10 minutes to their first step. The launch is its own process group: past
    # the timeout the launcher AND its ranks are killed (killing only the launcher, as
    # subprocess.run does, left the ranks running, orphaned, slowing every later test).
    with subprocess.Popen(cmd, cwd=ROOT, env=child_env(env), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise AssertionError(f"training still running after {timeout} s, killed:\n"
                                 f"{out[-4000:]}\n{err[-6000:]}") from None
    done = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if check and done.returncode != 0:
        raise AssertionError(f"training failed ({done.returncode}):\n{done.stdout[-4000:]}\n"
                             f"{done.stderr[-6000:]}")
    return done


def step_losses(run_dir: Path, key: str = "loss") -> dict[int, float]:
    """Per-step training loss from metrics.jsonl (later lines win: a resumed run re-logs
    the steps after its checkpoint)."""
    out = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if key in row:
            out[row["step"]] = row[key]
    return out


def torchrun_exit_codes(stderr: str) -> tuple[int, dict[int, int]]:
    """The exit codes of the ranks as torchrun reports them when a rank fails (torchrun
    itself then exits with 1): (root cause = first failed rank's code, {rank: code} of every
    rank listed). A rank that torchrun stopped after the first failure shows -15 (SIGTERM)."""
    entry = re.compile(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*exitcode\s*:\s*(-?\d+)")
    codes = {int(rank): int(code) for rank, code in entry.findall(stderr)}
    root = stderr.split("Root Cause (first observed failure):", 1)
    if len(root) != 2 or not entry.search(root[1]):
        raise AssertionError(f"no torchrun failure report in:\n{stderr[-3000:]}")
    return int(entry.search(root[1]).group(2)), codes


# The runs of conftest.zero_run: 10 steps on 2 ranks, dropout 0.1 (the tiny default).
ZERO_RUN_SECTIONS = {
    "xl": dict(max_steps=10, eval={"max_segments": 4}),
    "lamemo": dict(max_steps=10, model={"mechanism": "lamemo"}, eval={"max_segments": 4}),
    # The WikiText-103 configs' head: a tied adaptive softmax, clusters cut from one matrix.
    "xl-adaptive": dict(max_steps=10, model={"cutoffs": [4, 8], "div_val": 1,
                                             "tie_projs": [False, True, True]},
                        eval={"max_segments": 4}),
    # RMT with an XL cache, BPTT through 2 segments, segment checkpointing.
    "rmt": dict(max_steps=10, model={"mechanism": "rmt", "mem_len": 4,
                                     "rmt": {"num_mem_tokens": 3}},
                bptt={"depth": 1, "checkpoint_segments": True}, eval={"max_segments": 4}),
    # Titans (memory as a context): each row's MLP memory and momentum carried through a
    # window of 2 segments, updated in chunks of 4 inside each 8-token segment.
    "titans": dict(max_steps=10, model={"mechanism": "titans", "mem_len": 0,
                                        "titans": {"d_mem": 16, "chunk_size": 4}},
                   bptt={"depth": 1}, eval={"max_segments": 4}),
    # ARMT likewise: the association matrices carried through a window of 2 segments.
    "armt": dict(max_steps=10, model={"mechanism": "armt", "mem_len": 4,
                                      "rmt": {"num_mem_tokens": 3}, "armt": {"d_key": 8}},
                 bptt={"depth": 1, "checkpoint_segments": True}, eval={"max_segments": 4}),
}


def copy_run(run_dir: Path, tmp: Path, name: str) -> Path:
    """A copy of a finished run under `tmp` as run `name` and its config (run_dir and name
    rewritten), to continue it without touching the original; returns the config's path."""
    new_dir = tmp / "runs" / name
    shutil.copytree(run_dir, new_dir)
    (new_dir / "tracking.json").unlink(missing_ok=True)  # its own MLflow run, in tmp's store
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    cfg.update(name=name, run_dir=str(new_dir))
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def rewind_run(run_dir: Path, step: int) -> None:
    """Turn a (copied) finished run into the run as a stop at `step` leaves it, `step` being
    one of its checkpoints: the later checkpoints removed and `latest` naming this one, the
    metrics of later steps and the end's outputs (exported weights, evaluation, curve)
    gone, its status "interrupted". What the continued run then shows is its own."""
    from train.checkpoint import LATEST, complete_checkpoints

    checkpoints = run_dir / "checkpoints"
    kept = [info for info in complete_checkpoints(checkpoints) if info.step <= step]
    assert kept and kept[-1].step == step, f"no checkpoint at step {step} in {run_dir}"
    for info in complete_checkpoints(checkpoints):
        if info.step > step:
            shutil.rmtree(info.path)
    (checkpoints / LATEST).write_text(kept[-1].path.name)
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    (run_dir / "metrics.jsonl").write_text("".join(
        f"{row}\n" for row in rows if json.loads(row).get("step", 0) <= step
        and "final_loss" not in json.loads(row)))
    for name in ("model.safetensors", "eval_report.json", "loss_curve.png"):
        (run_dir / name).unlink(missing_ok=True)
    (run_dir / "status.json").write_text(json.dumps({"state": "interrupted", "step": step}))


def train_in_process(cfg, monkeypatch) -> None:
    """`train.trainer.train(cfg)` in this process, a world of one over gloo, left as found:
    the rank variables set for the run only, no DeepSpeed backend from an earlier engine,
    the signal handlers the trainer installs put back, and DeepSpeed's cached groups of the
    process group that train() leaves released too (as deepspeed.comm.destroy_process_group
    does), or the next engine made in this process finds them."""
    import deepspeed.comm.comm as ds_comm
    from deepspeed.utils import groups

    from train import trainer

    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(ds_comm, "cdb", None)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        assert trainer.train(cfg) == 0
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        groups._release_process_group_references(None)
