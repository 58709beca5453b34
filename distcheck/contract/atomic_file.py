"""The one way every file that another process reads is written: whole or not at all.

    from distcheck.contract import atomic_file
    atomic_file.write_text(report_dir / "watcher-node-a.json", json.dumps(state))

A reader (the supervisor polling a rank's files, node 0 reading a node's summary, ``distcheck report``) never sees
a file half written or truncated to nothing: the text goes to a temporary file beside the target, named by the
writer's pid and thread (two writers of one file never share it), which then replaces the target by a rename.
The file gets the usual mode (0666 less the umask): reports are shared like every other file (CI artifacts).
"""
from __future__ import annotations

import os
import threading
from pathlib import Path


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Replace ``path`` with ``data`` whole. Raises OSError (a full disk, a folder that is not there); the temporary
    file is gone then."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return target


def write_text(path: str | os.PathLike, text: str) -> Path:
    """:func:`write_bytes` of ``text`` in UTF-8."""
    return write_bytes(path, text.encode("utf-8"))
