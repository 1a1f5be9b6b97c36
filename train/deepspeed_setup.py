"""Importing DeepSpeed and building its ops: without MLflow at import, with the
environment's own ninja, reusing the op build scripts/setup.sh made in the checkout, and
clearing the locks a stopped build left."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def import_deepspeed():
    """The deepspeed module, imported without MLflow wherever it is imported first.

    DeepSpeed's autotuner imports mlflow when it is installed (deepspeed/autotuning/
    autotuner.py, for its own logging, which memtrain does not use), as part of `import
    deepspeed`: 2.2 of its 4.7 s of CPU (measured on the 2-core machine), on every rank
    and in every command that reads a checkpoint. MLflow is imported for real only where a
    run is tracked (train/tracking.py, rank 0). While the import runs, `import mlflow`
    fails at once (a None entry in sys.modules), so the autotuner sees no MLflow; the entry
    is removed after, and a later `import mlflow` imports it as usual."""
    if "deepspeed" not in sys.modules and "mlflow" not in sys.modules:
        sys.modules["mlflow"] = None
        try:
            import deepspeed
        finally:
            del sys.modules["mlflow"]
    import deepspeed

    return deepspeed


# A build of DeepSpeed's op takes under 2 minutes here (about 30 s alone on the machine).
STALE_LOCK_S = 15 * 60


def clear_stale_build_locks(extensions: Path, max_age_s: float = STALE_LOCK_S) -> list[Path]:
    """Remove the build locks of JIT-compiled ops (torch.utils.cpp_extension's FileBaton,
    `<op>/lock`) older than `max_age_s`: a build killed midway leaves its lock behind, and
    every later process that loads the op, built or not, waits for it to go, forever
    (seen: every DeepSpeed start hung). Returns what was removed, each with a warning."""
    import warnings

    removed = []
    for lock in sorted(extensions.glob("*/lock")):
        try:
            age = time.time() - lock.stat().st_mtime
            if age > max_age_s:
                lock.unlink()
        except FileNotFoundError:     # a build finished meanwhile
            continue
        if age > max_age_s:
            warnings.warn(f"removed {lock}: the build lock of an op, {age / 60:.0f} minutes "
                          "old, left by a build that was stopped; every process loading the "
                          "op would have waited for it", stacklevel=2)
            removed.append(lock)
    return removed


def use_environments_ninja() -> bool:
    """Put this interpreter's scripts folder first on PATH when it holds `ninja` (the
    environment's own, a DeepSpeed dependency); True if PATH changed. torch builds an op with
    the first `ninja` on PATH, and a ninja of another version does not read the build log the
    last one kept, so it builds everything again: launches from an activated environment
    (its ninja 1.13) and from a plain shell (the system's 1.11) sharing one op folder rebuilt
    DeepSpeed's op in turn, about a minute of both cores each time, every other rank waiting
    on the build lock (measured on the 2-core machine)."""
    bin_dir = str(Path(sys.executable).parent)
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p]
    if not (Path(bin_dir) / "ninja").is_file() or path[:1] == [bin_dir]:
        return False
    os.environ["PATH"] = os.pathsep.join([bin_dir, *(p for p in path if p != bin_dir)])
    return True


def use_prebuilt_ops() -> None:
    """Point torch's op builds at the checkout's `.cache/torch_ext`, where scripts/setup.sh
    built DeepSpeed's op (a JIT build takes ~30 s), unless the user chose another place;
    clear stale build locks there; put the environment's ninja first."""
    prebuilt = Path(__file__).resolve().parents[1] / ".cache" / "torch_ext"
    if prebuilt.is_dir():
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(prebuilt))
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        clear_stale_build_locks(Path(os.environ["TORCH_EXTENSIONS_DIR"]))
    use_environments_ninja()
