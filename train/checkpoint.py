"""Checkpoints that carry the memory, the stream position and the RNG, and count only whole.

Layout under `<run_dir>/checkpoints/` (RunDir.checkpoints):

    step00001200/                     one complete checkpoint
        mp_rank_00_model_states.pt    DeepSpeed (ZeRO state is partitioned: every rank writes)
        ..._optim_states.pt
        memtrain_rank00000.pt         per rank: its rows' memory, sliding-BPTT history,
        memtrain_rank00001.pt         stream state and RNG states
        COMPLETE                      JSON: step, world size, ZeRO stage (written last)
    latest                            name of the newest complete checkpoint
    .tmp-step00001300/                a save in progress (or killed midway): ignored

A save writes everything into `.tmp-<tag>`, fsyncs it (each rank its own files, rank 0 the
folder), waits for every rank, writes COMPLETE and renames the folder; a crash at any point
leaves the previous checkpoint as `latest`. A resume takes the checkpoint rank 0 sees
(agreed_latest), so every rank loads the same one. DeepSpeed's own
`client_state` is written by one rank only, which is why each rank writes its own file.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .process_group import barrier
from .run_dir import AtomicFile, atomic_write_json, atomic_write_text

MARKER = "COMPLETE"
LATEST = "latest"
# DeepSpeed's universal-checkpoint converter refuses checkpoints without this entry
# (Megatron-DeepSpeed provides it; a plain model must).
UNIVERSAL_INFO = {"universal_checkpoint_info": {"universal_checkpoint_version": 0.2}}


@dataclass
class CheckpointInfo:
    path: Path
    tag: str
    step: int
    world_size: int
    zero_stage: int
    meta: dict

    def rank_file(self, rank: int) -> Path:
        return self.path / rank_file_name(rank)


def rank_file_name(rank: int) -> str:
    return f"memtrain_rank{rank:05d}.pt"


def _tag(step: int) -> str:
    return f"step{step:08d}"


def rng_state() -> dict:
    """This rank's RNG states: CPU, numpy, Python, and the CUDA generator of its own device
    only (a rank draws on no other GPU; saving every visible GPU's would tie the checkpoint
    to the number of GPUs the node showed)."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
             "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()   # the current device (device_for)
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    cuda = state.get("cuda")
    if cuda is None or not torch.cuda.is_available():
        return
    if isinstance(cuda, (list, tuple)):
        # Saved by earlier versions: one state per GPU the node showed, of which the rank
        # drew on cuda:LOCAL_RANK. Take that one whatever this node shows: the launcher's
        # local rank, which gpu_binding.bind_gpu keeps when it rewrites LOCAL_RANK.
        local = int(os.environ.get("MEMTRAIN_LOCAL_RANK")
                    or os.environ.get("LOCAL_RANK", torch.cuda.current_device()))
        if local >= len(cuda):
            return
        cuda = cuda[local]
    torch.cuda.set_rng_state(cuda)             # the current device


def save(engine, root: Path, step: int, rank: int, rank_payload: dict, meta: dict,
         keep_last: int) -> Path:
    """Collective: every rank calls it at the same step. Returns the checkpoint folder."""
    root.mkdir(parents=True, exist_ok=True)
    tag, tmp_tag = _tag(step), f".tmp-{_tag(step)}"
    tmp = root / tmp_tag
    if rank == 0 and tmp.exists():
        shutil.rmtree(tmp)          # leftovers of a save that was killed midway
    barrier()
    engine.save_checkpoint(str(root), tag=tmp_tag, client_state={**UNIVERSAL_INFO},
                           save_latest=False)
    payload = {**rank_payload, "rng": rng_state()}
    with AtomicFile(tmp / rank_file_name(rank)) as f:
        torch.save(payload, f)
    _fault_point("after_rank_files", step)
    # On NFS or Lustre another node may see COMPLETE before data this rank wrote reaches the
    # server: each rank fsyncs its own files (only the writer's fsync flushes them).
    fsync_written(tmp, rank)
    barrier()
    final = root / tag
    if rank == 0:
        fsync_folders(tmp)         # every rank's file names, before COMPLETE vouches for them
        atomic_write_json(tmp / MARKER, {**meta, "step": step})
        fsync_folders(tmp)         # COMPLETE's own name
        if final.exists():         # the same step saved again (e.g. signal at the end)
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_folders(root, recursive=False)   # the new folder name, before `latest` names it
        atomic_write_text(root / LATEST, tag)
        fsync_folders(root, recursive=False)
        _prune(root, keep_last)
    barrier()
    return final


# The rank that wrote a file of a checkpoint folder: DeepSpeed's per-rank ZeRO files carry
# their data-parallel rank (zero_pp_rank_<r>_mp_rank_00_{optim,model}_states.pt; the global
# rank, with no model parallelism), ours memtrain_rank<r>.pt; DeepSpeed writes the rest
# (mp_rank_00_model_states.pt below ZeRO-3) on rank 0.
_WRITER = re.compile(r"(?:^|_)zero_pp_rank_(\d+)_|^memtrain_rank(\d+)\.pt$")


def writer_rank(name: str) -> int:
    m = _WRITER.search(name)
    return int(m.group(1) or m.group(2)) if m else 0


def fsync_path(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_written(folder: Path, rank: int) -> int:
    """fsync every file of `folder` (and below) that `rank` wrote; returns how many. Hidden
    names are other writers' temporary files (AtomicFile), fsynced by them."""
    n = 0
    for path in sorted(folder.rglob("*")):
        if path.is_file() and not path.name.startswith(".") and writer_rank(path.name) == rank:
            fsync_path(path)
            n += 1
    return n


def fsync_folders(folder: Path, recursive: bool = True) -> None:
    """fsync `folder` (and the folders below it): the names of the files in them."""
    subfolders = sorted(p for p in folder.rglob("*") if p.is_dir()) if recursive else []
    for path in [*subfolders, folder]:
        fsync_path(path, directory=True)


def _fault_point(where: str, step: int) -> None:
    """Test hook: MEMTRAIN_FAULT=<where>:<step> kills this process there (SIGKILL-like), to
    check that a save killed midway leaves the previous checkpoint usable."""
    if os.environ.get("MEMTRAIN_FAULT") == f"{where}:{step}":
        sys.stderr.write(f"MEMTRAIN_FAULT: dying at {where} of step {step}\n")
        sys.stderr.flush()
        os._exit(137)


def _prune(root: Path, keep_last: int) -> None:
    done = complete_checkpoints(root)
    for info in done[:-keep_last]:
        shutil.rmtree(info.path, ignore_errors=True)
        for extra in root.glob(f"{info.tag}_universal*"):
            shutil.rmtree(extra, ignore_errors=True)


def read_checkpoint(path: Path) -> CheckpointInfo | None:
    """The checkpoint in `path` if it is complete (COMPLETE marker and every rank file), else
    None."""
    marker = path / MARKER
    if not marker.is_file():
        return None
    try:
        meta = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    info = CheckpointInfo(path, path.name, int(meta["step"]), int(meta["world_size"]),
                          int(meta.get("zero_stage", 0)), meta)
    if not all(info.rank_file(r).is_file() for r in range(info.world_size)):
        return None
    return info


def complete_checkpoints(root: Path) -> list[CheckpointInfo]:
    """Complete checkpoints, oldest first (folders without COMPLETE or rank files skipped)."""
    if not root.is_dir():
        return []
    found = [read_checkpoint(p) for p in root.iterdir() if p.is_dir() and p.name.startswith("step")
             and not p.name.endswith("_universal")]
    return sorted((f for f in found if f is not None), key=lambda f: f.step)


def agreed_latest(root: Path) -> CheckpointInfo | None:
    """The checkpoint to resume from, the same on every rank: rank 0 picks it (find_latest)
    and broadcasts it. Collective when a process group of several ranks exists. On NFS or
    Lustre attribute caching can show ranks different folders or `latest` for a while, and
    ranks resuming from different checkpoints would train on silently."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return find_latest(root)
    box = [find_latest(root) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def find_latest(root: Path) -> CheckpointInfo | None:
    """The checkpoint named by `latest` if complete, else the newest complete one."""
    pointer = root / LATEST
    if pointer.is_file():
        info = read_checkpoint(root / pointer.read_text().strip())
        if info is not None:
            return info
    done = complete_checkpoints(root)
    return done[-1] if done else None


def to_universal(info: CheckpointInfo) -> str:
    """Convert a ZeRO checkpoint to DeepSpeed's universal format (rank 0, once), so that a
    different world size can load it with the model and optimizer re-sharded."""
    out = info.path.parent / f"{info.tag}_universal"
    if not (out / MARKER).is_file():
        if out.exists():
            shutil.rmtree(out)
        cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
               "--input_folder", str(info.path), "--output_folder", str(out),
               "--num_extract_workers", "1", "--num_merge_workers", "1"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"converting {info.path} to a universal checkpoint failed:\n"
                               f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
        for path in sorted(out.rglob("*")):   # all written here, by the converter
            if path.is_file():
                fsync_path(path)
        fsync_folders(out)
        atomic_write_json(out / MARKER, info.meta)
    return out.name


def load_rank_payload(info: CheckpointInfo, rank: int) -> dict:
    return torch.load(info.rank_file(rank), map_location="cpu", weights_only=False)
