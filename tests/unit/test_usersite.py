"""The one rule for "the user's line" (rank/usersite.py), as the tracer, records, crashes and check_model use it."""
from __future__ import annotations

import importlib.util
import inspect

import torch
import torch.nn as nn

from distcheck.rank.usersite import caller_site, forward_site, is_internal, param_site, traceback_site


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 4)  # FC1
        self.scale = nn.Parameter(torch.ones(4))  # SCALE

    def forward(self, x):  # FORWARD
        return self.fc1(x) * self.scale


class Stack(nn.Sequential):
    def __init__(self):  # STACK INIT
        super().__init__(Block(), nn.ReLU())


def _line(marker: str) -> int:
    lines = open(__file__).read().splitlines()
    return next(i for i, text in enumerate(lines, 1) if text.rstrip().endswith(f"# {marker}"))


def test_internal_files():
    assert is_internal(torch.__file__) and is_internal(inspect.__file__) and is_internal("<frozen runpy>")
    assert not is_internal(__file__)
    assert is_internal("/opt/venv/lib/python3.11/site-packages/lightning/pytorch/core/module.py")
    assert is_internal("/opt/venv/lib/python3.11/site-packages/distcheck/rank/autocheck/patches.py")


def _fake_library(tmp_path):
    """A third-party package as pip installs one: a file under site-packages that calls back into the user."""
    path = tmp_path / "venv" / "lib" / "python3.11" / "site-packages" / "fakelib" / "api.py"
    path.parent.mkdir(parents=True)
    path.write_text("def log(report):\n    return report()\n\n\ndef fail():\n    raise ValueError('bad')\n")
    spec = importlib.util.spec_from_file_location("fakelib_api", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_third_party_library_frame_is_not_the_users_line(tmp_path):
    api = _fake_library(tmp_path)
    site = api.log(caller_site)  # LIBRARY CALL
    assert site.file == __file__ and site.line == _line("LIBRARY CALL")
    assert site.via == "fakelib/api.py:2 in log" and site.detail()["via"] == site.via
    try:
        api.fail()  # LIBRARY RAISES
    except ValueError as exc:
        crash = traceback_site(exc.__traceback__)
    assert crash.line == _line("LIBRARY RAISES") and crash.via == "fakelib/api.py:6 in fail"
    # a direct call has no library under it, and the findings' detail stays as it was
    direct = caller_site(0)
    assert direct.via is None and set(direct.detail()) == {"file", "line"}


def test_param_site_is_the_assignment_in_the_users_class():
    model = Stack()
    assert param_site(model, "0.scale").line == _line("SCALE")
    # a torch layer's parameter: the line of the user's parent that assigns the layer
    assert param_site(model, "0.fc1.weight").line == _line("FC1")
    # no assignment to find (nn.Sequential's positional children): the user's __init__
    assert param_site(Stack(), "1.missing").line == _line("STACK INIT")
    assert not param_site(nn.Linear(2, 2), "weight")  # nothing of the user's


def test_forward_site():
    assert forward_site(Block()).line == _line("FORWARD") and forward_site(Block()).site.startswith("test_usersite.py:")


def test_caller_site_skips_torch_and_distcheck_frames():
    here = inspect.currentframe().f_lineno + 1
    site = caller_site(0)
    assert site.file == __file__ and site.line == here


def test_traceback_site_is_the_innermost_user_frame():
    def user_code():
        torch.zeros(2).view(3)  # RAISES

    try:
        user_code()
    except RuntimeError as exc:
        site = traceback_site(exc.__traceback__)
    assert site.file == __file__ and "RAISES" in open(__file__).read().splitlines()[site.line - 1]


def test_a_mesh_built_by_a_library_names_the_users_line_and_the_library_call(tmp_path, monkeypatch):
    from distcheck.rank.checks.mesh import mesh_error_finding

    monkeypatch.setenv("WORLD_SIZE", "2")
    path = tmp_path / "venv" / "lib" / "python3.11" / "site-packages" / "meshlib" / "dims.py"
    path.parent.mkdir(parents=True)
    path.write_text("def build():\n    raise RuntimeError('Mesh should not be bigger than default world size 2')\n")
    spec = importlib.util.spec_from_file_location("meshlib_dims", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        module.build()  # BUILD MESH
    except RuntimeError as exc:
        finding = mesh_error_finding(exc)
    assert finding.detail["line"] == _line("BUILD MESH") and finding.detail["via"] == "meshlib/dims.py:2 in build"
    assert f"at test_usersite.py:{_line('BUILD MESH')} via meshlib/dims.py:2 in build failed" in finding.message
