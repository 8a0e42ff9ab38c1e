"""interp.files.write_atomic: all or nothing, and ordinary permissions."""

import os
import stat

import pytest

from interp import GPTConfig, GPTModel
from interp.files import write_atomic
from interp.loading import save_checkpoint


def test_content_kinds(tmp_path):
    assert write_atomic(tmp_path / "a" / "b.txt", "héllo").read_text(encoding="utf-8") == "héllo"
    assert write_atomic(tmp_path / "c.bin", b"\x00\x01").read_bytes() == b"\x00\x01"
    assert write_atomic(tmp_path / "d.txt", lambda tmp: tmp.write_text("via writer")).read_text() == "via writer"


def test_a_failing_writer_leaves_the_old_file_and_no_temporary(tmp_path):
    target = write_atomic(tmp_path / "out.csv", "old")

    def half_then_fail(tmp):
        tmp.write_text("half")
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError):
        write_atomic(target, half_then_fail)
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["out.csv"]


def test_checkpoint_files_get_the_umask_mode_not_a_private_one(tmp_path):
    old = os.umask(0o022)
    try:
        save_checkpoint(GPTModel(GPTConfig(d_vocab=257, n_ctx=8, d_model=16, n_heads=2, n_layers=1)), tmp_path)
    finally:
        os.umask(old)
    for name in ("model.safetensors", "config.json"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o644, name


@pytest.mark.parametrize("content", [
    "text",
    b"bytes",
    lambda tmp: tmp.write_text("via writer"),
    lambda tmp: os.close(os.open(tmp, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o600)),  # re-creates it private
    lambda tmp: (tmp.unlink(missing_ok=True), os.close(os.open(tmp, os.O_CREAT | os.O_WRONLY, 0o600))),  # replaces it private
], ids=["str", "bytes", "writer", "private-writer", "replacing-writer"])
def test_mode_follows_the_umask_without_touching_it(tmp_path, monkeypatch, content):
    """The process umask is never changed, not even briefly: another thread creating a file at that
    moment would get it world-writable."""
    old = os.umask(0o027)
    try:
        monkeypatch.setattr(os, "umask", lambda mask: pytest.fail("write_atomic called os.umask"))
        target = write_atomic(tmp_path / "out", content)
    finally:
        monkeypatch.undo()
        os.umask(old)
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
