"""Checkpoints on NFS/Lustre: every file of a checkpoint (DeepSpeed's and the per-rank ones)
is fsynced by the rank that wrote it, and the folders by rank 0, before COMPLETE and
`latest`; and a resume loads the checkpoint rank 0 sees on every rank, even when the ranks'
views of the folder disagree (simulated with a per-rank find_latest on 2 gloo ranks)."""

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from train import checkpoint as ckpt
from train import trainer


class FakeEngine:
    """What DeepSpeed's save_checkpoint writes at ZeRO-2: the model states on rank 0, the
    optimizer partition on every rank."""

    def __init__(self, rank: int):
        self.rank = rank

    def save_checkpoint(self, root, tag, client_state, save_latest):
        folder = Path(root) / tag
        folder.mkdir(parents=True, exist_ok=True)
        if self.rank == 0:
            torch.save({"module": {}}, folder / "mp_rank_00_model_states.pt")
        torch.save({"optim": self.rank},
                   folder / f"zero_pp_rank_{self.rank}_mp_rank_00_optim_states.pt")


def _record_fsyncs(monkeypatch) -> list[str]:
    """Replace os.fsync by a recorder of the synced paths, in call order."""
    synced = []
    real = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    return synced


def _meta(world: int) -> dict:
    return {"world_size": world, "zero_stage": 2}


def test_every_file_and_folder_is_fsynced_before_complete_and_latest(tmp_path, monkeypatch):
    synced = _record_fsyncs(monkeypatch)
    root = tmp_path / "checkpoints"
    final = ckpt.save(FakeEngine(0), root, 3, 0, {"step": 3}, _meta(1), keep_last=2)
    names = [Path(p).name for p in synced]
    files = sorted(p.name for p in final.iterdir())
    assert files == ["COMPLETE", "memtrain_rank00000.pt", "mp_rank_00_model_states.pt",
                     "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    complete = next(i for i, n in enumerate(names) if n.startswith(".COMPLETE."))
    latest = next(i for i, n in enumerate(names) if n.startswith(".latest."))
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                 "memtrain_rank00000.pt"):
        assert name in names[:complete], f"{name} not fsynced before COMPLETE"
    assert ".tmp-step00000003" in names[:complete]                 # the folder's names
    assert names[complete + 1] == ".tmp-step00000003"               # COMPLETE's name
    assert "checkpoints" in names[complete + 2:latest]               # the renamed folder
    assert names[-1] == "checkpoints"                                # latest's name
    print(f"fsync calls for one 1-rank ZeRO-2 checkpoint: {len(synced)}")


def test_the_writer_of_each_file(tmp_path):
    assert ckpt.writer_rank("zero_pp_rank_13_mp_rank_00_optim_states.pt") == 13
    assert ckpt.writer_rank("bf16_zero_pp_rank_5_mp_rank_00_optim_states.pt") == 5
    assert ckpt.writer_rank("zero_pp_rank_2_mp_rank_00_model_states.pt") == 2   # ZeRO-3
    assert ckpt.writer_rank("memtrain_rank00007.pt") == 7
    assert ckpt.writer_rank("mp_rank_00_model_states.pt") == 0
    (tmp_path / ".memtrain_rank00001.pt.123.tmp").write_bytes(b"x")  # another rank's, midway
    (tmp_path / "memtrain_rank00000.pt").write_bytes(b"x")
    assert ckpt.fsync_written(tmp_path, 0) == 1


# ----------------------------------------------------------------------------- 2 ranks
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world, port, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        root = Path(out) / "checkpoints"
        # The save: each rank fsyncs what it wrote.
        synced = []
        real = os.fsync

        def fsync(fd):
            synced.append(os.readlink(f"/proc/self/fd/{fd}"))
            real(fd)
        os.fsync = fsync
        ckpt.save(FakeEngine(rank), root, 2, rank, {"step": 2}, _meta(world), keep_last=5)
        ckpt.save(FakeEngine(rank), root, 4, rank, {"step": 4}, _meta(world), keep_last=5)
        os.fsync = real
        # The resume: rank 1's view is stale (attribute caching): it would pick step 2.
        views = {0: ckpt.read_checkpoint(root / "step00000004"),
                 1: ckpt.read_checkpoint(root / "step00000002")}
        ckpt.find_latest = lambda _root: views[rank]
        info = ckpt.agreed_latest(root)
        Path(out, f"rank{rank}.json").write_text(json.dumps({
            "own_view": views[rank].tag, "resumes": info.tag,
            "synced": sorted({Path(p).name for p in synced})}))
    finally:
        dist.destroy_process_group()


def test_two_ranks_fsync_their_own_files_and_resume_from_rank_0s_checkpoint(tmp_path):
    mp.start_processes(_rank_main, args=(2, _free_port(), str(tmp_path)), nprocs=2,
                       join=True, start_method="spawn")
    got = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)}
    assert [got[r]["own_view"] for r in (0, 1)] == ["step00000004", "step00000002"]
    assert [got[r]["resumes"] for r in (0, 1)] == ["step00000004", "step00000004"]
    assert {"zero_pp_rank_1_mp_rank_00_optim_states.pt", "memtrain_rank00001.pt"} <= \
        set(got[1]["synced"])
    assert not any(n.startswith(("mp_rank", "zero_pp_rank_0", "memtrain_rank00000"))
                   for n in got[1]["synced"])
    assert {"mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
            "memtrain_rank00000.pt", "checkpoints"} <= set(got[0]["synced"])


class _Stop(Exception):
    pass


def test_memtrain_train_resumes_from_the_agreed_checkpoint(tmp_path, monkeypatch):
    """The trainer asks agreed_latest (not each rank's find_latest) which checkpoint to load."""
    from train_helpers import tiny_config

    from train.config import load_config

    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(trainer, "init_process_group", lambda *a, **k: None)

    def agreed(root):
        raise _Stop

    def unexpected(*args, **kwargs):
        raise AssertionError("went on without asking agreed_latest")
    monkeypatch.setattr(ckpt, "agreed_latest", agreed, raising=False)
    monkeypatch.setattr(trainer, "build_ds_config", unexpected)
    cfg = load_config(tiny_config(tmp_path))
    for resume in (True, False):
        with pytest.raises(_Stop):
            trainer.train(cfg, resume=resume)
