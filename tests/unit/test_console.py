"""The node watcher's console (supervise/console.py): a console nobody reads any more never raises."""
from __future__ import annotations

import io
import logging
import os
import sys

from distcheck.supervise.console import LostConsoleTolerant, survive_lost_console


def test_writes_to_a_console_whose_reader_is_gone_are_dropped_once_said(caplog):
    read_end, write_end = os.pipe()
    stream = io.TextIOWrapper(io.FileIO(write_end, "w"), write_through=True)
    console = LostConsoleTolerant(stream, "stderr")
    assert console.write("first\n") == 6 and os.read(read_end, 100) == b"first\n"
    os.close(read_end)
    with caplog.at_level(logging.WARNING, logger="distcheck"):
        assert console.write("the report\n") == 11  # BrokenPipeError underneath
        console.write("more\n")
        console.flush()
    assert console.lost
    said = [r.getMessage() for r in caplog.records if "console is gone" in r.getMessage()]
    assert said == ["the console is gone (BrokenPipeError on stderr): what distcheck prints to it is dropped; the "
                    "report files are still written"]
    assert console.fileno() == write_end  # the rest is the stream's
    stream.close()  # nothing buffered (write_through): closes quietly


def test_the_watcher_wraps_stdout_and_stderr_once(monkeypatch):
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    survive_lost_console()
    wrapped = sys.stderr
    survive_lost_console()
    assert isinstance(sys.stdout, LostConsoleTolerant) and sys.stderr is wrapped
    print("visible", file=sys.stderr)
    assert wrapped._stream.getvalue() == "visible\n"
