"""How ``distcheck consistency``'s rank ends (commands/consistency.py), without a process group: the pieces around
the checks are replaced, the order of the end is what is asserted."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from distcheck.commands import consistency as command
from distcheck.errors import UsageError

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


def test_the_watcher_is_stopped_before_rank_0s_hook_file_goes(tmp_path, monkeypatch):
    """A bad --model found mid-run removes the partial report; a watcher still running when rank 0's hook file went
    counted rank 0 as ended with no report and printed "rank 0 ended before writing the report" (a suite run under
    load). The watcher goes first."""
    from distcheck.rank import bootstrap, runtime, stack_hooks

    order: list[str] = []

    class Watcher:
        def stop(self) -> None:
            order.append("watcher stopped")

    class Session:
        rank = 0

    monkeypatch.setattr(runtime, "start", lambda bound: Session())
    monkeypatch.setattr(runtime, "stop", lambda session: order.append("runtime stopped"))
    monkeypatch.setattr(bootstrap, "rank_bootstrap", lambda *a, **k: Watcher())
    monkeypatch.setattr(stack_hooks, "remove_rank_hooks", lambda report_dir, rank: order.append("hook removed"))

    def bad_model(*args):
        raise UsageError("--model factory_errors.py:raises: the factory raised RuntimeError: cannot build")

    monkeypatch.setattr(command, "_run", bad_model)
    args = argparse.Namespace(model=f"{FIXTURES}/factory_errors.py:raises", parallel="fsdp", steps=3, timeout=30.0,
                              report_dir=str(tmp_path), native=False, rtol=None, atol=None,
                              argv=["consistency", "--model", "factory_errors.py:raises"])
    with pytest.raises(UsageError):
        command.main(args)
    assert order == ["watcher stopped", "hook removed", "runtime stopped"]
