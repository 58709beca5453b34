"""Faults distcheck itself could cause: a report file system that fills up mid-run, and a rank that ends without its
exit record. Each test asserts the report (or, when it cannot be written, what goes to stderr instead), the exit code,
a bounded time, and that no process of the run is left, found by a tag in the launch's environment (never by name).

    .venv/bin/python -m pytest -q tests/integration/test_faults_disk.py

The full disk is a real 128 KiB tmpfs, mounted in a private mount namespace (``unshare --mount``: nothing to clean up
on the host), so the run's ranks are fresh interpreters started inside it, not forked from the test session's zygote
(which lives outside that namespace).
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from launch_helpers import FRESH, TAG, env_for_ranks, load_report, tagged


# A correct script: every rank issues the same all_reduces, far more than a 128 KiB file system can trace (24 bytes
# a collective), and checks their result at the end.
MANY_ALL_REDUCES = """\
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank())])
for _ in range(int(sys.argv[1])):
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # THE LOOP
assert t.item() == dist.get_world_size() - 1
dist.destroy_process_group()
"""

# Rank 1 ends itself with os._exit(0) in the middle of training: no exception, exit code 0, no exit record.
EXITS_MIDWAY = """\
import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(4)
for step in range(10):
    dist.all_reduce(t)  # STEP
    if step == 3 and dist.get_rank() == 1:
        os._exit(0)  # EXIT
dist.destroy_process_group()
"""


def tagged_processes(tag: str) -> list[str]:
    """``pid: command line`` of every live process whose environment carries ``TAG=tag`` (zombies excluded)."""
    found = []
    for pid in tagged(tag):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # ended since the scan
            continue
        found.append(f"{pid}: {cmdline[:160]}")
    return found


def assert_nothing_left(tag: str, grace: float = 5.0) -> None:
    """Every process of the run has ended (a few seconds for the last ones to be reaped)."""
    deadline = time.monotonic() + grace
    while (left := tagged_processes(tag)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, "processes of the run are still alive:\n" + "\n".join(left)


def launch(cmd: list[str], tag: str, limit: float) -> tuple[int, str, str, float]:
    """Run ``cmd`` in its own session with the tag in its environment; (exit code, stdout, stderr, seconds). Past
    ``limit`` every tagged process is killed and the test fails."""
    env = env_for_ranks({**FRESH, TAG: tag})
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        for line in tagged_processes(tag):
            try:
                os.kill(int(line.split(":", 1)[0]), signal.SIGKILL)
            except ProcessLookupError:
                pass
        out, err = proc.communicate()
        raise AssertionError(f"the run did not end within {limit}s:\n{out}\n{err}") from None
    return proc.returncode, out, err, time.monotonic() - t0


def mount_namespace_available() -> str | None:
    """Why a private tmpfs cannot be mounted here (None: it can)."""
    if shutil.which("unshare") is None:
        return "no unshare(1) on this machine"
    probe = subprocess.run(["unshare", "--mount", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"mounting a tmpfs in a private mount namespace is not permitted: {probe.stderr.strip()}"
    return None


def stderr_report(stderr: str) -> dict:
    """The report.json document publish prints to stderr after its one-line reason."""
    return json.loads(stderr[stderr.index("\n{") + 1:])


def test_a_full_report_file_system_stops_the_trace_not_the_ranks(tmp_path, line_of):
    """The tmpfs fills while both ranks trace 4000 all_reduces (it filled at #1176 and #2457 in one run): recording
    stops at a collective each trace names, the ranks finish their script (no SIGBUS), the verdict is PASSED with a
    warning per rank, and the last line printed names report.json only if it was written (else the report is on
    stderr with a one-line reason)."""
    why = mount_namespace_available()
    if why is not None:
        pytest.skip(why)
    script = tmp_path / "many_all_reduces.py"
    script.write_text(MANY_ALL_REDUCES)
    mnt = tmp_path / "disk"
    mnt.mkdir()
    out = mnt / "report"
    run = shlex.join([sys.executable, "-m", "distcheck", "run", "--nproc", "2", "--timeout", "30", "--report-dir",
                      str(out), "--", str(script), "4000"])
    # In the namespace: mount, run distcheck, then tell the test what the directory held before the tmpfs goes.
    json_path = shlex.quote(str(out / "report.json"))
    shell = (f"mount -t tmpfs -o size=128k tmpfs {shlex.quote(str(mnt))} && {run}; code=$?; "
             f"echo; echo \"@@report.json: $(test -f {json_path} && echo yes || echo no)\"; "
             f"cat {json_path} 2>/dev/null | tr -d '\\n'; echo; exit $code")
    tag = uuid.uuid4().hex
    code, stdout, stderr, seconds = launch(["unshare", "--mount", "sh", "-c", shell], tag, limit=60)
    printed, _, probe = stdout.rpartition("\n@@report.json: ")
    written, _, document = probe.partition("\n")
    assert code == 0, stdout + stderr
    assert seconds < 40, seconds
    assert "SIGBUS" not in stdout + stderr and "Bus error" not in stderr
    if written.strip() == "yes":
        report = json.loads(document)
        assert printed.rstrip().endswith(f"report: {out / 'report.json'}"), printed
    else:  # the report could not be written: never named, on stderr with the reason instead
        assert "report.json" not in printed.replace("report.json went to stderr", ""), printed
        assert "report: not written (No space left on device); report.json went to stderr" in printed
        assert f"could not write the report into {out} (No space left on device)" in stderr
        report = stderr_report(stderr)
    assert report["ok"] and report["findings"] == [], report["findings"]
    assert report["ranks"] == {"0": {"state": "ok", "exit_code": 0, "signal": None},
                               "1": {"state": "ok", "exit_code": 0, "signal": None}}
    cut = {w["ranks"][0]: w for w in report.get("warnings", []) if w["kind"] == "trace_incomplete"}
    assert cut, report.get("warnings")
    loop = line_of(script, "# THE LOOP")
    for rank, w in cut.items():
        first = w["detail"]["from_collective"]
        assert 1 < first < 4000 and w["detail"]["errno"] == 28
        assert w["message"].startswith(f"trace of rank {rank} is incomplete from collective #{first} on: the "
                                       "report directory's file system was full"), w["message"]
        # What was recorded is a clean prefix: the collective before the cut, at the user's line.
        last = w["detail"]["last_recorded"]
        assert last["op"] == "all_reduce" and last["seq"] == first - 1 and last["line"] == loop
        assert w["detail"]["unrecorded"] > 0  # the ranks went on: the watch loop saw them progress
        assert f"[distcheck rank {rank}] WARNING the report directory's file system was full" in stderr
    assert_nothing_left(tag)


def test_a_rank_that_ends_with_os_exit_is_named_not_said_to_have_finished(tmp_path, line_of):
    """Rank 1 calls os._exit(0) after its 4th all_reduce: the finding names rank 1 as having ended without finishing
    its script (exit code 0), rank 0's lost connection is folded in as the consequence, rank 1's state is "died",
    and no message says it finished its script."""
    script = tmp_path / "exits_midway.py"
    script.write_text(EXITS_MIDWAY)
    out = tmp_path / "report"
    tag = uuid.uuid4().hex
    code, stdout, stderr, seconds = launch(
        [sys.executable, "-m", "distcheck", "run", "--nproc", "2", "--timeout", "20", "--report-dir", str(out), "--",
         str(script)], tag, limit=60)
    assert code == 1, stdout + stderr
    assert seconds < 30, seconds
    report = load_report(out)
    assert "finished its script" not in json.dumps(report["findings"])
    (f,) = report["findings"]
    step = line_of(script, "# STEP")
    assert f["kind"] == "rank_failure" and f["ranks"] == [1], f
    assert f["message"].startswith(
        f"rank 1 ended without finishing its script: os._exit or a signal (exit code 0) after all_reduce #4 at "
        f"exits_midway.py:{step}; rank 0 failed in all_reduce #5"), f["message"]
    assert "0" in f["detail"].get("consequences", {})  # rank 0, left waiting on it, is the consequence
    assert report["ranks"]["1"] == {"state": "died", "exit_code": 0, "signal": None}
    assert report["ranks"]["0"]["state"] == "error"
    assert f"report: {out / 'report.json'}" in stdout
    assert_nothing_left(tag)


def test_under_torchrun_a_rank_that_ends_with_os_exit_is_named_with_every_possible_cause(tmp_path, line_of):
    """Under torchrun the agent, not distcheck, reaps the ranks: rank 1's os._exit(0) is named as a rank that ended
    without finishing its script, by os._exit or a signal, never as a death by a signal alone, and never as a rank
    that finished."""
    from launch_helpers import torchrun

    script = tmp_path / "exits_midway.py"
    script.write_text(EXITS_MIDWAY)
    out = tmp_path / "report"
    res = torchrun(["-m", "distcheck", "run", "--timeout", "20", "--report-dir", str(out), "--", str(script)],
                   timeout=120)
    assert res.returncode != 0, res.output
    report = load_report(out)
    assert "finished its script" not in json.dumps(report["findings"])
    (f,) = [f for f in report["findings"] if f["kind"] == "rank_failure" and f["ranks"] == [1]]
    assert f["message"].startswith(
        "rank 1 ended without finishing its script: os._exit or a signal (SIGKILL, the OOM killer, a hard crash; "
        f"only torchrun's agent saw its exit code) after all_reduce #4 at exits_midway.py:{line_of(script, '# STEP')}"
    ), f["message"]
    assert report["ranks"]["1"]["state"] == "died"
