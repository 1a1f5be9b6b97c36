import os
import sys

import pytest
import torch

# Tests import their naive references (tests/reference.py) by module name.
sys.path.insert(0, os.path.dirname(__file__))
# The tests use tiny tensors: one intra-op thread is fastest, and on a shared VM a second
# OpenMP thread mostly spin-waits (measured: 25x slower per op under pytest).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def zero_run(tmp_path_factory):
    """zero_run(mechanism, stage) -> run directory of a finished 2-rank training run of the
    tiny config (tests/train_helpers.py) at that ZeRO stage, trained once per session and
    shared by the tests that need it (ZeRO equality, re-sharding on resume). Tests that
    continue a run must copy it first (train_helpers.copy_run)."""
    from train_helpers import ZERO_RUN_SECTIONS, run_train, tiny_config

    root = tmp_path_factory.mktemp("zero_runs")
    done = {}

    def run(mechanism: str, stage: int):
        if (mechanism, stage) not in done:
            name = f"{mechanism}-z{stage}"
            cfg = tiny_config(root, name, deepspeed={"zero_stage": stage},
                              **ZERO_RUN_SECTIONS[mechanism])
            run_train(cfg, nproc=2)
            done[mechanism, stage] = root / "runs" / name
        return done[mechanism, stage]

    return run
