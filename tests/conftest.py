import fcntl
import os
import shutil
import sys

import pytest
import torch

# Tests import their naive references (tests/reference.py) by module name.
sys.path.insert(0, os.path.dirname(__file__))
# The tests use tiny tensors: one intra-op thread is fastest, and on a shared VM a second
# OpenMP thread mostly spin-waits (measured: 25x slower per op under pytest).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _environment_restored():
    """Each test leaves os.environ as it found it. An in-process run writes the launcher's
    variables there (train.distributed.resolve_env fills RANK, WORLD_SIZE, ...), and a later
    test in the same worker that starts a job from a copy of os.environ would hand every rank
    RANK=0 (seen: both ranks of a DeepSpeed-launcher job on SLURM called themselves rank 0)."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(autouse=True)
def _torch_linear_restored():
    """Each test leaves torch.nn.functional.linear as it found it. A ZeRO-3 engine built in
    the test process replaces it for the rest of the process (DeepSpeed's memory-efficient
    linear; "This will persist unless manually reset", deepspeed/runtime/zero/
    partition_parameters.py), and later tests in the same worker measured other saved
    tensors (seen: the memory planner's measured bytes, the recompute's matmul counts)."""
    linear = torch.nn.functional.linear
    yield
    torch.nn.functional.linear = linear


@pytest.fixture(scope="session")
def zero_run(tmp_path_factory):
    """zero_run(mechanism, stage) -> run directory of a finished 2-rank training run of the
    tiny config (tests/train_helpers.py) at that ZeRO stage, trained once per session and
    shared by the tests that need it (ZeRO equality, re-sharding on resume). Tests that
    continue a run must copy it first (train_helpers.copy_run). XL's runs are launched
    through tests/optimizer_probe.py, which also saves the Adam state the finished run
    holds, gathered in full, as ADAM_AFTER_TRAINING in the run directory.

    Under pytest-xdist the workers of one session share them too: the runs live beside the
    workers' own temporary folders, and a lock per run makes one worker train it while
    another that needs the same run waits, then reads it; two workers needing different
    runs train them side by side (one lock for all made the second worker wait on the
    first's unrelated trainings)."""
    from train_helpers import (
        ADAM_AFTER_TRAINING,
        ZERO_RUN_SECTIONS,
        make_word_corpus,
        run_optimizer_probe,
        run_train,
        tiny_config,
    )

    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = tmp_path_factory.getbasetemp().parent / "zero_runs"   # this session's
        root.mkdir(exist_ok=True)
    else:
        root = tmp_path_factory.mktemp("zero_runs")

    def run(mechanism: str, stage: int):
        name = f"{mechanism}-z{stage}"
        run_dir, finished = root / "runs" / name, root / f"{name}.finished"
        with (root / "lock").open("a") as lock:   # the shared corpus, made once
            fcntl.flock(lock, fcntl.LOCK_EX)
            make_word_corpus(root / "data")
        with (root / f"{name}.lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not finished.exists():
                shutil.rmtree(run_dir, ignore_errors=True)   # a worker's unfinished attempt
                cfg = tiny_config(root, name, deepspeed={"zero_stage": stage},
                                  **ZERO_RUN_SECTIONS[mechanism])
                if mechanism == "xl":   # the re-sharding tests also read its Adam state
                    run_optimizer_probe(cfg, run_dir / ADAM_AFTER_TRAINING, 2, "--after-training")
                else:
                    run_train(cfg, nproc=2)
                finished.touch()
        return run_dir

    return run


# Running the suite on several workers (pytest-xdist, `-n 3 --dist loadfile
# --no-loadscope-reorder`, as .ci/run does; docs/testing.md): a module is one unit of work,
# so its module-scoped fixtures (a compiled model, an MLflow server, a SLURM cluster) are
# built once, on one worker. Daemons take free ports of their own (tests/daemons.py), so two
# workers' SLURM clusters run side by side; the session's ZeRO runs are shared by a lock per
# run in the session's folder (above).
#
# The modules go to the workers longest first, by the seconds tests/durations.json holds
# (scripts/test_durations.py writes it from a JUnit report), so that the last ones to
# start are short and both workers finish together. pytest-xdist's own order, most tests
# first, left the one-test modules for the end, and the longest of them (the multi-node
# rehearsal) ran alone on one worker after the other had finished. A module missing from
# the file counts as 60 s if it has slow tests, else 5 s.
def pytest_collection_modifyitems(config, items):
    import json
    from pathlib import Path

    table = Path(__file__).with_name("durations.json")
    seconds = json.loads(table.read_text()) if table.exists() else {}
    slow = {item.module.__name__ for item in items if item.get_closest_marker("slow")}

    def weight(item) -> float:
        module = item.nodeid.split("::")[0]
        return seconds.get(module, 60.0 if item.module.__name__ in slow else 5.0)

    items.sort(key=lambda item: -weight(item))   # stable: a module's tests keep their order
