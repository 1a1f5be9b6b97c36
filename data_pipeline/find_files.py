"""Finding a corpus's files on disk: the benchmarks' files present, extracted from their
archive, or downloaded first (`resolve_files`), and a user's own text files from glob
patterns (`expand_globs`). Every file returned exists, is readable and is not empty.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

from .download import SOURCES, Remote, extract_member, fetch_remote


def check_file(path: Path) -> Path:
    if not path.is_file():
        raise FileNotFoundError(f"{path} is not a file")
    if not os.access(path, os.R_OK):
        raise PermissionError(f"cannot read {path} (permission denied)")
    if path.stat().st_size == 0:
        raise ValueError(f"{path} is empty")
    return path


def _find(data_dir: Path, candidates: list[list[str]]) -> list[Path] | None:
    """First existing candidate for every wanted file, or None if any is missing."""
    found = []
    for options in candidates:
        hit = next((data_dir / c for c in options if (data_dir / c).is_file()), None)
        if hit is None:
            return None
        found.append(hit)
    return found


def resolve_files(name: str, data_dir: Path, candidates: list[list[str]], download: bool,
             progress: bool) -> list[Path]:
    """Paths of the files a benchmark needs: present already, extracted from its archive in
    data_dir, or (download=True) fetched first. Archives present are verified before use."""
    found = _find(data_dir, candidates)
    if found is not None:
        return [check_file(p) for p in found]
    remotes: tuple[Remote, ...] = SOURCES[name]
    for remote in remotes:
        local = data_dir / remote.filename
        if not local.exists() and not download:
            continue
        if remote.members:
            if all((data_dir / t).is_file() for t in remote.members.values()):
                continue
            fetch_remote(remote, data_dir, progress)  # verifies an archive already present
            for member, target in remote.members.items():
                if not (data_dir / target).is_file():
                    extract_member(local, member, data_dir / target,
                                   remote.member_sizes.get(member))
        elif not local.exists():
            fetch_remote(remote, data_dir, progress)
    found = _find(data_dir, candidates)
    if found is not None:
        return [check_file(p) for p in found]
    expected = [" or ".join(str(data_dir / c) for c in options) for options in candidates]
    archives = [str(data_dir / r.filename) for r in remotes if r.members]
    urls = [r.urls[0] for r in remotes]
    msg = f"{name}: missing " + "; ".join(expected)
    if archives:
        msg += f" (or the archive {', '.join(archives)})"
    raise FileNotFoundError(f"{msg}. Pass download=True (--download) to fetch {', '.join(urls)}")


def expand_globs(data_dir: Path, patterns: list[str], split: str) -> list[Path]:
    if isinstance(patterns, (str, os.PathLike)):
        patterns = [patterns]
    paths: list[Path] = []
    for pat in patterns:
        pat = str(pat)
        full = pat if os.path.isabs(pat) else str(data_dir / pat)
        hits = sorted(Path(p) for p in glob.glob(full, recursive=True) if os.path.isfile(p))
        if not hits:
            where = "" if os.path.isabs(pat) else f" (relative to {data_dir.absolute()})"
            raise FileNotFoundError(f"text corpus, {split}: no file matches {pat!r}{where}")
        paths.extend(hits)
    return [check_file(p) for p in dict.fromkeys(paths)]
