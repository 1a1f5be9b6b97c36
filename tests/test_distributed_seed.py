"""Every rank starts from the same weights but draws its own dropout masks: `memtrain train`
seeds the model with run seed on all ranks and then the training RNG per rank (simulated in
one process as rank 0 and rank 1 of a 2-rank world, up to the first dropout draw)."""

import pytest
import torch
from train_helpers import tiny_config

from train import process_group, trainer
from train.config import load_config


class _Stop(Exception):
    pass


def _start_as(rank: int, tmp_path, monkeypatch) -> tuple[dict, torch.Tensor]:
    """Run trainer.train as `rank` of 2 until the tracker would start: (the initial weights
    handed to DeepSpeed, a dropout mask drawn right after the trainer's seeding)."""
    for key, value in {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(trainer, "init_process_group", lambda *a, **k: None)
    seen = {}

    def initialize(model, cfg, ds_config):
        seen["weights"] = {k: v.clone() for k, v in model.state_dict().items()}
        return object(), object()

    def tracker(*args, **kwargs):
        seen["mask"] = torch.nn.functional.dropout(torch.ones(256), 0.5, training=True)
        raise _Stop

    monkeypatch.setattr(trainer, "initialize", initialize)
    monkeypatch.setattr(trainer, "Tracker", tracker)
    cfg = load_config(tiny_config(tmp_path, f"r{rank}"), [f"run_dir={tmp_path}/r{rank}"])
    with pytest.raises(_Stop):
        trainer.train(cfg)
    return seen["weights"], seen["mask"]


def test_two_ranks_share_the_initial_weights_but_not_the_dropout_masks(tmp_path, monkeypatch):
    w0, mask0 = _start_as(0, tmp_path, monkeypatch)
    w1, mask1 = _start_as(1, tmp_path, monkeypatch)
    assert w0.keys() == w1.keys()
    for name in w0:
        assert torch.equal(w0[name], w1[name]), name
    assert not torch.equal(mask0, mask1)
    # Rank 0 keeps the stream a 1-rank run always had: its results do not change.
    torch.manual_seed(0)
    from model import build_model
    build_model(load_config(tiny_config(tmp_path, "ref")).model)
    assert torch.equal(mask0, torch.nn.functional.dropout(torch.ones(256), 0.5, training=True))


def test_rank_seeds_are_distinct_and_not_a_shift_of_the_run_seed():
    seeds = {(s, r): process_group.rank_seed(s, r) for s in range(4) for r in range(64)}
    assert len(set(seeds.values())) == len(seeds)
    assert process_group.rank_seed(1, 0) != process_group.rank_seed(0, 1)
    assert all(0 <= v < 2**63 for v in seeds.values())
    assert process_group.rank_seed(3, 5) == process_group.rank_seed(3, 5)
