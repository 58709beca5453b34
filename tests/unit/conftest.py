"""The unit tier launches no process: a test that tries fails at once, naming the rule."""
from __future__ import annotations

import os
import subprocess

import pytest


@pytest.fixture(autouse=True)
def _no_processes(monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("a unit test launched a process: move it to tests/integration")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(os, "fork", refuse)
    monkeypatch.setattr(os, "posix_spawn", refuse, raising=False)
