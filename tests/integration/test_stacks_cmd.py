"""``distcheck stacks PID...`` on real processes: grouping, torchrun agents, and every bad-input / fault case.

Cheap targets are plain Python processes (no torch) written into tmp_path; one test dumps the real hang_python
fixture under torchrun through its agent pid.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch_helpers import BIN, FIXTURES, Result, distcheck, env_for_ranks

REAL_PYSPY = str(BIN / "py-spy")

TARGET = '''\
import os, sys, time


def load_shard():
    time.sleep(120)  # ODD


def wait_for_peers():
    time.sleep(120)  # WAIT


def main():
    if "hook" in sys.argv:
        from distcheck.rank.stack_hooks import install_rank_hooks
        install_rank_hooks(os.environ["DISTCHECK_REPORT_DIR"])
    print("ready", flush=True)
    (load_shard if os.environ.get("RANK") == "1" else wait_for_peers)()


main()
'''


@pytest.fixture
def cli(capsys, monkeypatch):
    """Run ``python -m distcheck ARGS`` in this process (a subprocess would pay torch's import every time)."""
    from distcheck import cli as cli_mod

    def run(argv: list[str], env: dict | None = None) -> Result:
        for k, v in (env or {}).items():
            monkeypatch.setenv(k, v)
        capsys.readouterr()
        code = cli_mod.main(argv)
        out, err = capsys.readouterr()
        return Result(code, out, err)
    return run


@pytest.fixture
def spawn(tmp_path):
    """Start target processes (each in its own session) and always kill them, by pid, at the end."""
    started: list[subprocess.Popen] = []
    script = tmp_path / "target.py"
    script.write_text(TARGET)

    def start(rank: int | None, *args: str, env: dict | None = None) -> subprocess.Popen:
        extra = dict(env or {})
        if rank is not None:
            extra.update(RANK=str(rank), WORLD_SIZE="3")
        full = env_for_ranks(extra)
        if rank is None:
            full.pop("RANK", None)
        p = subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE, text=True,
                             env=full, start_new_session=True)
        started.append(p)
        assert p.stdout.readline().strip() == "ready"
        # "ready" is printed just before the sleep: wait until the process is blocked in it (state S), so a dump
        # on a busy machine cannot catch it between the print and the sleep.
        deadline = time.monotonic() + 20
        while Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "S":
            assert time.monotonic() < deadline, "target never went to sleep"
            time.sleep(0.01)
        return p

    start.script = script
    yield start
    for p in started:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it may have ended since poll() looked
                os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=10)


def fake_pyspy(tmp_path: Path, body: str) -> str:
    """A py-spy stand-in that runs ``body`` (bash) before the real py-spy; the target pid is in $PID."""
    path = tmp_path / "py-spy-wrapper"
    path.write_text(f'#!/bin/bash\nPID="$3"\n{body}\n')
    path.chmod(0o755)
    return str(path)


def test_groups_ranks_and_names_the_odd_one(line_of, spawn, tmp_path, cli):
    procs = [spawn(r) for r in range(3)]
    out = tmp_path / "out"
    res = cli(["stacks", *[str(p.pid) for p in procs], "--report-dir", str(out)])
    assert res.returncode == 1, res.output
    odd_line = line_of(spawn.script, "# ODD")
    wait_line = line_of(spawn.script, "# WAIT")
    assert "!! rank 1 (1)  <-- MINORITY" in res.stdout
    report = json.loads((out / "report.json").read_text())
    (f,) = report["findings"]
    assert f["kind"] == "hang" and f["ranks"] == [1]
    assert f["message"] == (f"rank 1 is in load_shard (target.py:{odd_line}) while ranks 0,2 are in "
                            f"wait_for_peers (target.py:{wait_line})")
    assert f["detail"]["file"] == str(spawn.script) and f["detail"]["line"] == odd_line
    doc = json.loads((out / "stacks.json").read_text())
    assert [r["rank"] for r in doc["ranks"]] == [0, 1, 2] and {r["method"] for r in doc["ranks"]} == {"py-spy"}
    assert [g["ranks"] for g in doc["groups"]] == [[0, 2], [1]] and doc["groups"][1]["minority"] is True
    assert "stacks.txt" in report["artifacts"] and (out / "stacks.txt").read_text().startswith("distcheck stacks")


def test_same_place_exits_0_and_json_output(spawn, cli):
    procs = [spawn(0), spawn(2)]
    res = cli(["stacks", *[str(p.pid) for p in procs], "--json"])
    assert res.returncode == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["findings"] == [] and [g["ranks"] for g in doc["groups"]] == [[0, 2]]
    assert doc["summary"].startswith("all 2 ranks are in wait_for_peers (target.py:")


def test_native_frames_are_marked(spawn, cli):
    p = spawn(0)
    res = cli(["stacks", str(p.pid), "--json", "--native"])
    assert res.returncode == 0, res.output
    (rank,) = json.loads(res.stdout)["ranks"]
    assert rank["method"] == "py-spy --native"
    main = next(t for t in rank["threads"] if t["main"])
    assert any(f["native"] and "sleep" in f["name"] for f in main["frames"])


def test_bad_pid_arguments_exit_2_with_one_line():
    res = distcheck(["stacks", "12x"], timeout=30)
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        "distcheck: error: PID '12x' is not a process id: pass numeric pids, e.g. from 'pgrep -f torchrun'"]
    res = distcheck(["stacks", "4194999"], timeout=30)  # above any pid_max on this machine
    assert res.returncode == 2
    assert "pid 4194999: no such process" in res.stderr and "nothing could be dumped" in res.stderr
    assert "Traceback" not in res.stderr


def test_non_python_process_is_reported_and_others_still_dumped(spawn, cli):
    good = spawn(0)
    sleeper = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        res = cli(["stacks", str(sleeper.pid), str(good.pid), "4194999", "--json"])
        assert res.returncode == 0, res.output
        assert f"pid {sleeper.pid} (sleep) is not a Python process" in res.stderr
        assert "pid 4194999: no such process" in res.stderr
        doc = json.loads(res.stdout)
        assert [r["pid"] for r in doc["ranks"]] == [good.pid]
        assert {e["kind"] for e in doc["errors"]} == {"not_python", "no_such_process"}
        res = cli(["stacks", str(sleeper.pid)])
        assert res.returncode == 2 and "nothing could be dumped" in res.stderr
    finally:
        sleeper.kill()
        sleeper.wait()


def test_pyspy_missing(spawn, tmp_path, cli):
    p = spawn(0)
    res = cli(["stacks", str(p.pid)], env={"DISTCHECK_PYSPY": str(tmp_path / "nope")})
    assert res.returncode == 2
    assert "py-spy is not installed: pip install py-spy" in res.stderr
    assert res.stderr.strip().splitlines()[-1] == ("distcheck: error: nothing could be dumped: py-spy is not "
                                                   "installed (pip install py-spy, or set DISTCHECK_PYSPY to its path)")


def test_pyspy_missing_falls_back_to_faulthandler_hook(line_of, spawn, tmp_path, cli):
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    procs = [spawn(r, "hook", env={"DISTCHECK_REPORT_DIR": str(hooks)}) for r in (0, 1, 2)]
    res = cli(["stacks", *[str(p.pid) for p in procs], "--json"], env={"DISTCHECK_PYSPY": str(tmp_path / "nope")})
    assert res.returncode == 1, res.output
    doc = json.loads(res.stdout)
    assert {r["method"] for r in doc["ranks"]} == {"faulthandler"}
    assert all("py-spy is not installed" in r["note"] for r in doc["ranks"])
    (f,) = doc["findings"]
    assert f["ranks"] == [1] and f"load_shard (target.py:{line_of(spawn.script, '# ODD')})" in f["message"]
    assert all(p.poll() is None for p in procs)  # the signal dumped them, it did not kill them


def test_permission_denied_real_uid_mismatch_then_faulthandler(spawn, tmp_path, cli):
    """py-spy runs as uid 65534 against our (root) processes: a real EPERM from the kernel."""
    if os.geteuid() != 0 or not Path("/usr/bin/setpriv").exists():
        pytest.skip("needs root and setpriv to run py-spy as another user")
    wrapper = fake_pyspy(tmp_path, f'exec setpriv --reuid=65534 --regid=65534 --clear-groups {REAL_PYSPY} "$@"')
    plain = spawn(0)
    res = cli(["stacks", str(plain.pid)], env={"DISTCHECK_PYSPY": wrapper})
    assert res.returncode == 2
    assert re.search(rf"pid {plain.pid} \(python[\d.]*\): permission denied to read its stack", res.stderr), res.stderr
    assert "run distcheck as the same user as the job or as root; in a container add --cap-add SYS_PTRACE" in res.stderr
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    hooked = spawn(1, "hook", env={"DISTCHECK_REPORT_DIR": str(hooks)})
    res = cli(["stacks", str(hooked.pid), "--json"], env={"DISTCHECK_PYSPY": wrapper})
    assert res.returncode == 0, res.output
    (rank,) = json.loads(res.stdout)["ranks"]
    assert rank["method"] == "faulthandler" and "permission denied" in rank["note"]


def test_process_exiting_during_the_dump(spawn, tmp_path, cli):
    victim, survivor = spawn(0), spawn(1)
    # The wrapper kills the victim just before py-spy reads it, as if the rank exited mid-dump.
    wrapper = fake_pyspy(tmp_path, f'if [ "$PID" = "{victim.pid}" ]; then kill -9 "$PID"; sleep 0.3; fi\n'
                                   f'exec {REAL_PYSPY} "$@"')
    res = cli(["stacks", str(victim.pid), str(survivor.pid), "--json"], env={"DISTCHECK_PYSPY": wrapper})
    assert res.returncode == 0, res.output
    assert f"pid {victim.pid} exited during the dump" in res.stderr
    doc = json.loads(res.stdout)
    assert [r["rank"] for r in doc["ranks"]] == [1]
    assert doc["errors"] == [{"pid": victim.pid, "rank": 0, "kind": "exited",
                              "message": f"pid {victim.pid} exited during the dump"}]


def test_torchrun_agent_pid_finds_workers_and_names_stuck_rank(line_of, tmp_path, cli):
    """The real use: `distcheck stacks <torchrun pid>` on the hang_python fixture."""
    fixture = FIXTURES / "hang_python.py"
    agent = subprocess.Popen([str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2", str(fixture)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env_for_ranks(),
                             start_new_session=True)
    try:
        from distcheck.supervise.stacks import dump_all, resolve_targets

        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:  # until rank 1 is inside load_shard
            targets, _ = resolve_targets([agent.pid])
            if len(targets) == 2:
                stacks = dump_all(targets).stacks
                if any(f.name == "load_shard" for s in stacks for t in s.threads for f in t.frames):
                    break
            time.sleep(0.5)
        else:
            pytest.fail("hang_python never reached load_shard")
        res = cli(["stacks", str(agent.pid), "--report-dir", str(tmp_path / "out")])
        assert res.returncode == 1, res.output
        (f,) = json.loads((tmp_path / "out" / "report.json").read_text())["findings"]
        sleep_line = line_of(fixture, "# HANG")
        wait_line = line_of(fixture, "# WAIT")
        assert f["ranks"] == [1]
        assert f["message"] == (f"rank 1 is in load_shard (hang_python.py:{sleep_line}) while rank 0 waits in "
                                f"all_reduce (hang_python.py:{wait_line})")
        assert f["detail"]["line"] == sleep_line
        assert {s["rank_source"] for s in f["detail"]["stacks"].values()} == {"RANK"}
    finally:
        # torchrun starts each worker in its own session: end the workers by pid, then the agent's group.
        from distcheck.supervise.stacks import rank_descendants

        for pid in rank_descendants(agent.pid):
            os.kill(pid, signal.SIGKILL)
        os.killpg(agent.pid, signal.SIGKILL)
        agent.wait(timeout=10)
