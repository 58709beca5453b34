"""The zero-code checks' one protocol (rank/autocheck/protocol.py, registry.py, core.py) and their one table
(analysis/check_table.py): every check is built alike, hears its events in the registry's order, writes its state
under its name, and the hooks name no check.

    pytest tests/unit/test_autocheck_protocol.py
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from distcheck.analysis.check_table import TABLE, judge
from distcheck.contract import autocheck_file
from distcheck.rank.autocheck import AutoCheck, protocol
from distcheck.rank.autocheck.registry import CHECKS

AUTOCHECK = Path(__file__).resolve().parents[2] / "distcheck" / "rank" / "autocheck"
# What a hook may ask of the core (rank/autocheck/core.py's docstring): events, and the wrap depth it shares.
HOOK_API = {"fire", "wrap_depth", "inside_wrap", "step_begins", "step_ends"}


def test_every_check_is_built_alike_and_listens_to_known_events(tmp_path):
    core = AutoCheck(tmp_path, 0)
    assert list(core.checks) == [c.name for c in CHECKS]
    for cls in CHECKS:
        check = core.checks[cls.name]
        assert isinstance(check, protocol.Check) and check.core is core
        assert set(cls.events()) <= set(protocol.EVENTS), cls.__name__
    assert set(TABLE) <= set(core.checks)  # an entry of the table judges a registered check's state


def test_a_handler_for_no_known_event_is_refused():
    class Typo(protocol.Check):
        name = "typo"

        def on_backwards(self, loss):
            pass

    with pytest.raises(TypeError, match="on_backwards"):
        protocol.handlers([Typo(None)])


def test_events_reach_the_core_first_then_the_checks_in_order_and_a_failure_stops_no_one(tmp_path, monkeypatch):
    from distcheck.rank.autocheck.auto_records import AutoRecords
    from distcheck.rank.autocheck.nan_watch import NanWatch

    heard = []

    def broken(self, loss):
        heard.append(("records", self.core.backwards))
        raise RuntimeError("a bug in a check")

    monkeypatch.setattr(AutoRecords, "on_backward", broken)
    monkeypatch.setattr(NanWatch, "on_backward", lambda self, loss: heard.append(("nan", self.core.backwards)))
    core = AutoCheck(tmp_path, 0)
    core.fire("backward", torch.tensor(1.0))
    assert heard == [("records", 1), ("nan", 1)]  # counted by the core before; records' failure is not nan's
    core.fire("no_such_event")  # nobody listens: nothing happens


def test_the_state_file_is_each_checks_state_under_its_name(tmp_path):
    core = AutoCheck(tmp_path, 3)
    core.fire("optimizer_built", torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))
    core.checks["precision"].note("torch.autocast(cpu, bfloat16)", torch.bfloat16)
    core.write_state()
    (doc,) = autocheck_file.read_all(tmp_path).values()
    assert autocheck_file.RunFields.of(doc) == autocheck_file.RunFields(3, 0, "backward", 0)
    assert set(doc) - set(autocheck_file.RESERVED) == {"precision"}  # empty states are left out
    assert judge({3: doc}, only=("precision",)).facts["precision"] == doc["precision"]


@pytest.mark.parametrize("module", ["patches.py", "pipeline_schedule.py", "dcp_roundtrip.py"])
def test_the_hooks_name_no_check(module):
    source = (AUTOCHECK / module).read_text()
    asked = set(re.findall(r"\b(?:check|current\(\))\.(\w+)", source))
    assert asked <= HOOK_API, f"{module} asks the core for {sorted(asked - HOOK_API)}"
