"""Files that appear whole or not at all: written under a temporary name in their own folder,
flushed to disk, then renamed over the target.

    atomic_write_json(run / "status.json", {"state": "finished", "step": 1000})
    with AtomicFile(path) as f:       # any writer that takes a binary file (tar, torch.save)
        torch.save(payload, f)

os.replace within one folder is atomic on POSIX, so a reader (another rank, a requeued job,
`memtrain jobs`, the sbatch script) sees the old file or the new one, never half of one, even
when the writer is killed midway; the fsync before the rename makes the new content durable
before its name is. The temporary file sits in the target's folder because a rename across
file systems is a copy, and carries the writer's pid so that two processes writing the same
file (ranks, jobs) never share one. A failed write removes its temporary file and leaves the
old file as it was.

data_pipeline/, model/ (model/io.py's exported weights), train/ and cluster/ share this one
copy. It lives here because neither data_pipeline/ nor model/ may import train/ (README,
"Layout"); it is stdlib only and imports nothing of data_pipeline/, so model/ takes on no data
dependency by using it, and `python -m train.run_dir status` (the sbatch script's status read)
starts without importing numpy or torch.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO, Any


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def temp_name(path: Path) -> Path:
    """The temporary name `path` is written under (a dot file: globs of the final names,
    e.g. checkpoints/step*, never match it)."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


class AtomicFile:
    """A temporary file beside `path`, opened at once (`.file`); `commit()` fsyncs it and
    renames it to `path`, `discard()` removes it. As a context manager it gives the file and
    commits when the block ends without an exception, discards (and re-raises) otherwise:

        with AtomicFile(path) as f:
            torch.save(payload, f)
    """

    def __init__(self, path: str | Path, mode: str = "wb", **open_kwargs):
        self.path = Path(path)
        self.tmp = temp_name(self.path)
        self.file: IO[Any] = open(self.tmp, mode, **open_kwargs)  # noqa: SIM115 - commit()

    def commit(self) -> Path:
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            # The mode a plain open() would give: a writer that replaces the file by name
            # (safetensors writes its own, mode 0600) must not hide an export from the
            # other users of a shared file system.
            os.chmod(self.tmp, 0o666 & ~_umask())
            os.replace(self.tmp, self.path)
        except BaseException:
            self.discard()
            raise
        return self.path

    def discard(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> IO[Any]:
        return self.file

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.discard()


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    with AtomicFile(path) as f:
        f.write(data)
    return Path(path)


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj: Any, *, indent: int | None = 1,
                      **dumps_kwargs) -> Path:
    """`obj` as JSON (plus a final newline). It is serialised before anything is opened, so
    an object that does not serialise leaves no file behind either."""
    return atomic_write_text(path, json.dumps(obj, indent=indent, **dumps_kwargs) + "\n")
