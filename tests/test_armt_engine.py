"""ARMT through the engine (`memtrain train`): a run stopped at a checkpoint and resumed
continues bit for bit, its association matrices restored with the weights, the optimizer,
the RNG and the sliding BPTT history; the checkpoint holds each row's A and z in float32.
ZeRO 1-3 with ARMT: tests/test_train_distributed.py (the same losses, gradient norms and
weights as ZeRO-0)."""

import pytest
import torch
from train_helpers import copy_run, rewind_run, run_train, step_losses, tiny_config

from train.checkpoint import find_latest, load_rank_payload

pytestmark = pytest.mark.slow

SECTIONS = dict(model={"mechanism": "armt", "mem_len": 0, "dropout": 0.1, "pre_lnorm": True,
                       "rmt": {"num_mem_tokens": 3}, "armt": {"d_key": 8}},
                bptt={"depth": 2, "mode": "sliding"}, eval={"max_segments": 4})


def test_a_stopped_armt_run_resumes_bit_for_bit_with_its_memory(tmp_path):
    # The uninterrupted run saves at step 6 on its way; a copy of it, rewound to that
    # checkpoint, is the run stopped there (one launch fewer than training it again).
    straight = tiny_config(tmp_path, "straight", max_steps=12, save_every=6, **SECTIONS)
    run_train(straight)
    # Every log line names each layer's smallest relative read denominator (model/
    # model/mechanisms/armt/associative.py `take_read_minimum`; docs/armt.md, "Loss spikes"): phi^T
    # z >= 0. The first step reads only fresh (empty) memories, which do not count.
    for layer in (0, 1):
        lows = step_losses(tmp_path / "runs" / "straight", f"read_den_min/{layer}")
        assert sorted(lows) == list(range(2, 13)) and all(v >= 0 for v in lows.values())
    cfg = copy_run(tmp_path / "runs" / "straight", tmp_path, "stopped")
    run_dir = tmp_path / "runs" / "stopped"
    rewind_run(run_dir, 6)
    info = find_latest(run_dir / "checkpoints")
    assert info.step == 6
    memory = load_rank_payload(info, 0)["memory"]
    assert memory["kind"] == "armt" and memory["A"].dtype == memory["z"].dtype == torch.float32
    assert memory["A"].shape == (4, 2, 2 * 3 * 8, 32) and memory["A"].abs().sum() > 0
    done = run_train(cfg)
    assert "resumed from" in done.stdout
    assert step_losses(run_dir) == step_losses(tmp_path / "runs" / "straight")


def test_a_finished_constant_lr_run_extended_to_wsd_is_the_wsd_run_from_scratch(tmp_path):
    # How docs/armt.md's associative-retrieval runs were made: a constant-lr run finished at
    # step 8, then continued with the shipped config (more steps, the wsd schedule). The
    # final evaluation of the finished run and its end-of-run checkpoint must leave nothing
    # behind that the uninterrupted wsd run would not have: weights, Adam, memory, data
    # order and RNG all continue, so every logged loss and lr is the same.
    wsd = dict(SECTIONS, optim={"lr": 3e-3, "schedule": "wsd", "decay_steps": 4})
    straight = tiny_config(tmp_path, "straight", max_steps=12, **wsd)
    run_train(straight)
    cfg = tiny_config(tmp_path, "extended", max_steps=12, **wsd)
    run_train(cfg, ["max_steps=8", "optim.schedule=constant", "optim.decay_steps=0"])
    done = run_train(cfg)
    assert "resumed from" in done.stdout
    for key in ("loss", "lr"):
        extended = step_losses(tmp_path / "runs" / "extended", key)
        assert extended == step_losses(tmp_path / "runs" / "straight", key)
    assert extended[8] == 3e-3 > extended[9] > extended[12] == 0.0   # decayed after step 8
