"""The zygote's pieces that run without a process: descriptor installation, its command line's bad input.

The zygote itself (fork, the socket protocol, a closed connection ending its ranks) runs in the integration tier:
every `run` and `compare` there goes through one (tests/integration/conftest.py), and test_faults.py,
test_pytest_plugin.py and test_run.py::test_every_way_of_starting_ranks_gives_the_same_report cover its ends.
"""
from __future__ import annotations

import os

from distcheck.supervise import zygote


def test_descriptors_land_on_their_targets_even_when_the_targets_are_each_others_numbers():
    (r1, w1), (r2, w2) = os.pipe(), os.pipe()
    # The rank must get w1 at w2's number and w2 at w1's number: a naive dup2 in order would clobber one.
    target_of_w1, target_of_w2 = w2, w1
    zygote._install_fds([w1, w2], [target_of_w1, target_of_w2])
    try:
        os.write(target_of_w1, b"one")
        os.write(target_of_w2, b"two")
        assert os.read(r1, 10) == b"one" and os.read(r2, 10) == b"two"
        assert os.get_inheritable(target_of_w1) and os.get_inheritable(target_of_w2)  # like Popen's pass_fds
    finally:
        for fd in (r1, r2, w1, w2):
            os.close(fd)


def test_bad_command_lines_are_one_line_and_exit_2(capsys, tmp_path):
    assert zygote.main([]) == 2
    assert capsys.readouterr().err.startswith("usage: python -m distcheck.supervise.zygote SOCKET_PATH")
    missing = tmp_path / "no" / "socket"
    assert zygote.main([str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot listen on {missing}: No such file or directory" in err


def test_no_zygote_unless_asked(monkeypatch):
    monkeypatch.delenv(zygote.ENV, raising=False)
    assert zygote.Zygote.shared() is None
    monkeypatch.setenv(zygote.ENV, "0")
    assert zygote.Zygote.shared() is None


def test_a_missing_shared_zygote_is_one_warning_then_fresh_interpreters(monkeypatch, caplog, tmp_path):
    monkeypatch.setattr(zygote.Zygote, "_shared", None)
    monkeypatch.setattr(zygote.Zygote, "_failed", False)
    missing = tmp_path / "zygote.sock"
    monkeypatch.setenv(zygote.ENV, str(missing))
    with caplog.at_level("WARNING", logger="distcheck"):
        assert zygote.Zygote.shared() is None and zygote.Zygote.shared() is None
    assert [r.getMessage() for r in caplog.records] == \
        [f"DISTCHECK_ZYGOTE={missing}: no zygote listens on {missing}; starting ranks as fresh interpreters"]


def test_a_torchrun_rank_stands_in_only_where_a_shared_zygote_is_named(monkeypatch, caplog, tmp_path):
    """stand_in(): None means "run here": every case but a `consistency` or `run` rank of torchrun with a socket
    path named, not itself forked on a stand-in's behalf. A named socket with no zygote: one warning, run here."""
    monkeypatch.setattr(zygote.Zygote, "_shared", None)
    monkeypatch.setattr(zygote.Zygote, "_failed", False)
    missing = tmp_path / "zygote.sock"
    monkeypatch.delenv(zygote.AGENT_PID_ENV, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    for setting in ("", "0", "1"):  # none, or a private one: a rank has no launcher to share it with
        monkeypatch.setenv(zygote.ENV, setting)
        assert zygote.stand_in(["consistency"]) is None
    monkeypatch.setenv(zygote.ENV, str(missing))
    assert zygote.stand_in(["report", "out/"]) is None and zygote.stand_in([]) is None  # not a rank's command
    monkeypatch.setenv(zygote.AGENT_PID_ENV, "123")  # the forked rank itself
    assert zygote.stand_in(["consistency"]) is None
    monkeypatch.delenv(zygote.AGENT_PID_ENV)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")  # not under torchrun
    assert zygote.stand_in(["run", "train.py"]) is None
    assert not caplog.records
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    with caplog.at_level("WARNING", logger="distcheck"):
        assert zygote.stand_in(["run", "train.py"]) is None
    assert [r.getMessage() for r in caplog.records] == \
        [f"DISTCHECK_ZYGOTE={missing}: no zygote listens on {missing}; starting ranks as fresh interpreters"]


def test_the_agent_is_the_parent_unless_a_stand_in_names_it(monkeypatch):
    from distcheck.processes import AGENT_PID_ENV, agent_pid

    monkeypatch.delenv(AGENT_PID_ENV, raising=False)
    assert agent_pid() == os.getppid()
    monkeypatch.setenv(AGENT_PID_ENV, "4242")
    assert agent_pid() == 4242


def test_the_preloads_library_teardown_is_switched_off_and_a_later_librarys_is_kept():
    """What a forked process would run at exit for the ~170 Library objects the preload made: nothing. A Library made
    after (the user's, in a forked rank) keeps its teardown. Fails if the skip misses torch's finalizers."""
    import weakref

    import torch.library

    def teardowns(atexit: bool) -> list:
        return [f for f in list(weakref.finalize._registry)
                if f.peek() is not None and f.peek()[1] is torch.library._del_library and f.atexit is atexit]

    assert teardowns(True), "torch made no Library with an exit-time teardown: nothing left to test"
    assert zygote._skip_library_teardown() > 0
    assert teardowns(True) == [] and teardowns(False)
    later = torch.library.Library("distcheck_test_zygote", "FRAGMENT")
    try:
        assert len(teardowns(True)) == 1
    finally:
        del later
