"""contract/atomic_file.py: every file another process reads is replaced whole, or left as it was."""
import os

import pytest

from distcheck.contract import atomic_file


def test_a_write_replaces_the_file_whole_with_the_usual_mode(tmp_path):
    target = tmp_path / "watcher-node-a.json"
    target.write_text("old")
    atomic_file.write_text(target, '{"covered": [0]}')
    assert target.read_text() == '{"covered": [0]}' and os.listdir(tmp_path) == ["watcher-node-a.json"]
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "summary.json"
    target.write_bytes(b"before")

    class Full:
        def __init__(self, path, mode):
            self.fh = open(path, mode)

        def __enter__(self):
            return self

        def write(self, data):
            self.fh.write(data[:3])
            raise OSError(28, "No space left on device")

        def __exit__(self, *exc):
            self.fh.close()

    monkeypatch.setattr(atomic_file, "open", Full, raising=False)
    with pytest.raises(OSError):
        atomic_file.write_bytes(target, b"after, but the disk is full")
    assert target.read_bytes() == b"before" and os.listdir(tmp_path) == ["summary.json"]
