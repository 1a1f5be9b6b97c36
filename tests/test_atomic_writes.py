"""Files other commands read appear whole or not at all: the exported weights (model/io.py)
and an extracted corpus file (data_pipeline/download.py) go through the one AtomicFile
(data_pipeline/atomic.py), as run-directory files and checkpoints do. tests/test_corpora.py
covers a download whose checksum fails."""

from __future__ import annotations

import zipfile

import pytest
import torch
from reference import tiny_model

from data_pipeline.download import ChecksumError, extract_member
from model import load_model
from model.io import save_model


def test_exported_weights_load_back_and_leave_no_temporary(tmp_path):
    model = tiny_model("xl")
    path = save_model(model, tmp_path / "model.safetensors", extra={"step": 7})
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]
    back = load_model(path)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 back.state_dict().values(), strict=True))


def test_exported_weights_get_the_mode_a_plain_file_would(tmp_path):
    """safetensors writes its file itself with mode 0600; on a shared file system the export
    must be readable by whom the umask allows, like every other file of the run."""
    import os
    path = save_model(tiny_model("xl"), tmp_path / "model.safetensors")
    plain = tmp_path / "plain"
    plain.write_text("")
    assert os.stat(path).st_mode & 0o777 == os.stat(plain).st_mode & 0o777


def test_an_export_that_fails_midway_keeps_the_previous_file(tmp_path, monkeypatch):
    path = save_model(tiny_model("xl"), tmp_path / "model.safetensors")
    before = path.read_bytes()

    def killed(model, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"half a file")
        raise KeyboardInterrupt

    monkeypatch.setattr("model.backbones.native._save_from", killed)   # the native writer
    with pytest.raises(KeyboardInterrupt):
        save_model(tiny_model("xl", seed=1), path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]


def test_an_extracted_member_of_the_wrong_size_leaves_nothing_behind(tmp_path):
    archive = tmp_path / "a.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("enwik8", b"x" * 500)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ChecksumError, match="has 500 bytes, expected 400"):
        extract_member(archive, "enwik8", out / "enwik8", size=400)
    assert list(out.iterdir()) == []
    assert extract_member(archive, "enwik8", out / "enwik8", size=500).read_bytes() == \
        b"x" * 500
    assert [p.name for p in out.iterdir()] == ["enwik8"]  # no temporary left
