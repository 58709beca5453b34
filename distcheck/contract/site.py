"""One way to name a line of code in every message: ``train.py:88``.

    python -m distcheck run --nproc 2 -- train.py    # every finding points at train.py:LINE this way

:class:`Site` is a line of the user's code as every process passes it around (the rank finds it:
rank/usersite.py; the findings, traces and autocheck files carry its file and line; the analysis and the report
name it); :func:`file_line` is the one formatter of a file and a line, for a Site or for a file and a line read
back from a file.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def file_line(file: str | None, line: int | None) -> str | None:
    """``train.py:88`` (the file's base name, whatever the separator of the machine that wrote it), or None
    unless both are known. ``file_line(f, l) or "?"`` where a message needs a placeholder."""
    if not file or not line:
        return None
    return f"{base_name(file)}:{line}"


def with_line(path: str, line: int | None) -> str:
    """``path:88``, or the path alone when the line is unknown: a frame as stacks print it (whatever ``path`` is:
    a base name, a display path or a native library)."""
    return f"{path}:{line}" if line else path


def base_name(file: str) -> str:
    return file.replace("\\", "/").rsplit("/", 1)[-1]


@dataclass(frozen=True)
class Site:
    file: str | None
    line: int | None
    # The library call the user's line made, when the walk out to it passed through one: what the user called
    # (``lightning/pytorch/core/module.py:512 in log``) is not always what issued the collective or raised.
    via: str | None = field(default=None, compare=False)

    @property
    def site(self) -> str | None:
        """``train.py:88``, or None when unknown."""
        return file_line(self.file, self.line)

    def __str__(self) -> str:
        return self.site or "?"

    def __bool__(self) -> bool:
        return self.file is not None

    def detail(self) -> dict:
        out: dict[str, Any] = {"file": self.file, "line": self.line}
        if self.via:
            out["via"] = self.via
        return out


UNKNOWN = Site(None, None)
