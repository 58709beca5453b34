"""The multi-node path on one machine: two torchrun agents (--nnodes 2, c10d rendezvous on 127.0.0.1) run together,
as two nodes would (launch/multi_node.sh does the same on a real cluster).

The `run` tests give each agent a node of its own: its own UTS and mount namespace (``unshare --uts --mount``), so
each has its own hostname (node-a, node-b, both resolvable through a bind-mounted hosts file) and its own
node-local ``--report-dir``. One complete report must come from the node of global rank 0, with no rank called
failed or "not found" because its files are on the other node.
"""
import json
import os
import shutil
import signal
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from launch_helpers import (BIN, FIXTURES, FRESH, TAG, env_for_ranks, free_port, kill_tagged, load_report, run_python,
                            tagged)



def test_two_agents_c10d_rendezvous(tmp_path):
    """Both agents forked by the session's zygote (run_python, in two threads), their ranks standing in for
    zygote-forked ones: the rendezvous and the one report are what is tested, not torch's import."""
    port = free_port()
    results: dict[int, object] = {}

    def agent(node: int) -> None:
        try:
            results[node] = run_python(
                ["-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                 "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"test-{port}", "-m", "distcheck",
                 "consistency", "--report-dir", str(tmp_path / f"node{node}"), "--timeout", "60", "--steps", "1"],
                timeout=240)
        except AssertionError as exc:  # run_python's timeout
            results[node] = exc

    threads = [threading.Thread(target=agent, args=(node,)) for node in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    outputs = [getattr(results[n], "output", str(results[n])) for n in range(2)]
    assert [getattr(results[n], "returncode", None) for n in range(2)] == [0, 0], "\n".join(outputs)
    reports = [load_report(tmp_path / f"node{n}") for n in range(2) if (tmp_path / f"node{n}" / "report.json").exists()]
    assert len(reports) == 1  # written once, by global rank 0
    report = reports[0]
    assert report["ok"] and report["world_size"] == 2
    ranks_env = report["environment"]
    assert set(ranks_env) == {"0", "1"}


HOSTS = ("node-a", "node-b")


def unshare_refused() -> str | None:
    """Why two namespaced "nodes" cannot be made here (not root, no user namespaces), or None."""
    if shutil.which("unshare") is None:
        return "unshare is not installed"
    try:
        probe = subprocess.run(["unshare", "--uts", "--mount", "true"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare failed: {exc}"
    return None if probe.returncode == 0 else f"unshare --uts --mount is not permitted: {probe.stderr.strip()}"


@dataclass
class Nodes:
    """What two namespaced nodes left: each console, and when the second torchrun returned (monotonic)."""

    consoles: dict[str, str]
    last_exit: float
    reports_at_exit: dict[str, bool]  # whether each host's job report existed when the last torchrun returned


def kill_namespace(tag: str, uts: str, within: float = 5.0) -> None:
    """SIGKILL every process of the run in the UTS namespace ``uts`` until none is left (or ``within`` seconds have
    passed: the caller's check of what is left then fails), as Slurm's cgroup kill or a CI runner's process-tree
    kill does. One sweep is not enough: a process can fork between the listing and the
    kill, and a killed process is still listed until the kernel has ended it."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        alive = []
        for pid in tagged(tag):
            try:
                if os.readlink(f"/proc/{pid}/ns/uts") == uts:
                    os.kill(pid, signal.SIGKILL)
                    alive.append(pid)
            except OSError:  # ended since the listing
                pass
        if not alive:
            return
        time.sleep(0.005)


def run_two_nodes(tmp_path: Path, script: str | None, timeout: float, tag: str, *args: str, nproc: int = 1,
                  env: dict[str, dict[str, str]] | None = None, kill_at_exit: bool = False) -> Nodes:
    """Two torchrun agents, one per namespaced node, each with ``nproc`` ranks and a node-local report dir
    (tmp_path/<host>), running ``distcheck run -- script args``, or (``script`` None) ``distcheck args``;
    ``env``: extra variables by host. ``kill_at_exit``: the moment a node's torchrun returns, every process of
    the run on that node (its UTS namespace) is SIGKILLed, as a CI step or a Slurm job step ends."""
    hosts_file = tmp_path / "hosts"
    hosts_file.write_text("127.0.0.1 localhost\n" + "".join(f"127.0.0.1 {h}\n" for h in HOSTS))
    port = free_port()
    procs = {}
    logs = {}
    for host in HOSTS:
        torchrun = [str(BIN / "torchrun"), "--nnodes", "2", "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"mn-{port}", "-m", "distcheck"]
        torchrun += ["run", "--timeout", str(timeout), "--report-dir", str(tmp_path / host), "--",
                     str(FIXTURES / script), *args] if script is not None else \
            [*args, "--timeout", str(timeout), "--report-dir", str(tmp_path / host)]
        inner = f"hostname {host} && mount --bind {hosts_file} /etc/hosts && exec \"$@\""
        logs[host] = open(tmp_path / f"{host}.console", "w+")
        procs[host] = subprocess.Popen(["unshare", "--uts", "--mount", "bash", "-c", inner, "node", *torchrun],
                                       stdout=logs[host], stderr=subprocess.STDOUT,
                                       env=env_for_ranks({TAG: tag, **FRESH, **(env or {}).get(host, {})}),
                                       start_new_session=True)
    own_uts = os.readlink("/proc/self/ns/uts")
    uts: dict[str, str] = {}
    ended: dict[str, float] = {}
    unseen: list[str] = []  # nodes that ended before their namespace could be read: their processes were not killed
    deadline = time.monotonic() + 240
    try:
        while len(ended) < len(procs) and time.monotonic() < deadline:
            for host, proc in procs.items():
                if host not in uts:
                    try:
                        node_uts = os.readlink(f"/proc/{proc.pid}/ns/uts")
                    except OSError:
                        node_uts = own_uts
                    # Read before unshare(2) has run, the link is still this process's namespace: the kill at
                    # exit would then miss every process of the node.
                    if node_uts != own_uts:
                        uts[host] = node_uts
                if host not in ended and proc.poll() is not None:
                    ended[host] = time.monotonic()
                    if kill_at_exit:
                        if host in uts:
                            kill_namespace(tag, uts[host])
                        else:
                            unseen.append(host)
            time.sleep(0.01)
        at_exit = {h: (tmp_path / h / "report.json").exists() for h in HOSTS}
    except BaseException:  # nothing of the run outlives a failed test (watchers run in sessions of their own)
        kill_tagged(tag)
        raise
    finally:
        for proc in procs.values():
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=10)
    consoles = {}
    for host, fh in logs.items():
        fh.seek(0)
        consoles[host] = fh.read()
        fh.close()
    if unseen or len(ended) < len(procs):
        kill_tagged(tag)
    assert not unseen, (f"{unseen}: the node ended before its namespace was read, so its processes were not killed "
                        "at torchrun's exit", consoles)
    assert len(ended) == len(procs), ("the two nodes' torchruns did not end within 240 s", consoles)
    return Nodes(consoles, max(ended.values()), at_exit)


def no_watcher_left(tag: str, since: float, within: float = 2.0) -> list[str]:
    """The run's processes still alive ``within`` seconds after ``since`` (the last torchrun's exit), each as
    ``pid: command line`` so that a failure says which."""
    time.sleep(max(0.0, since + within - time.monotonic()))
    out = []
    for pid in tagged(tag):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            cmd = "(gone)"
        out.append(f"{pid}: {cmd[:200]}")
    if out:  # how much later they did end, for the failure's message
        while tagged(tag) and time.monotonic() < since + 30:
            time.sleep(0.1)
        out.append(f"(ended {time.monotonic() - since:.1f}s after the last torchrun)")
    return out


def one_report(tmp_path: Path, consoles: dict[str, str]) -> tuple[str, dict]:
    """The host whose report dir holds the job's report (the node of global rank 0), and that report; the other
    node printed one line naming it."""
    written = [h for h in HOSTS if (tmp_path / h / "report.json").exists()]
    assert len(written) == 1, (written, consoles)
    host = written[0]
    other = next(h for h in HOSTS if h != host)
    report_txt = tmp_path / host / "report.txt"
    assert f"distcheck: the report of this job is on {host}: {report_txt}" in consoles[other], consoles[other]
    assert "distcheck FAILED (" not in consoles[other] and "distcheck PASSED" not in consoles[other]
    return host, load_report(tmp_path / host)


def test_two_nodes_one_report_names_the_stuck_rank_and_the_waiting_collective(tmp_path):
    reason = unshare_refused()
    if reason:
        pytest.skip(reason)
    tag = f"multinode-{uuid.uuid4().hex[:8]}"
    consoles = run_two_nodes(tmp_path, "hang_python.py", 8, tag).consoles
    host, report = one_report(tmp_path, consoles)
    assert not report["ok"] and report["world_size"] == 2
    kinds = [f["kind"] for f in report["findings"]]
    assert "rank_failure" not in kinds and kinds == ["hang"], report["findings"]
    (hang,) = report["findings"]
    assert hang["ranks"] == [1]
    assert hang["message"] == ("no progress for 8s: rank 1 is in load_shard (hang_python.py:23) while rank 0 waits "
                               "in all_reduce #2 (hang_python.py:33)")
    assert hang["detail"]["file"].endswith("hang_python.py") and hang["detail"]["line"] == 23
    assert "not found" not in (tmp_path / host / "report.txt").read_text()
    # The stacks of both nodes are in the report's stacks; each node's own dump stays there, named by host.
    assert {s["host"] for s in hang["detail"]["stacks"].values()} == set(HOSTS)
    for h in HOSTS:
        assert (tmp_path / h / f"node-{h}" / "stacks.txt").exists()
    assert set(report["nodes"]) == set(HOSTS)
    assert report["nodes"][host]["report_dir"] == str(tmp_path / host)
    assert tagged(tag) == []


def test_two_nodes_without_a_bug_pass_with_every_rank_accounted_for_and_the_straggler_named(tmp_path):
    """Rank 1, on the other node, reads slowly: node 0's report names it from the time each rank spent inside
    each all-reduce (its node's summary carries rank 1's), since the two hosts' clocks need not agree."""
    reason = unshare_refused()
    if reason:
        pytest.skip(reason)
    tag = f"multinode-{uuid.uuid4().hex[:8]}"
    consoles = run_two_nodes(tmp_path, "hang_none.py", 10, tag, "--slow-rank", "1").consoles
    host, report = one_report(tmp_path, consoles)
    assert report["ok"], report["findings"]
    assert report["stragglers"]["named"] == [1], report["stragglers"]
    (note,) = [w for w in report["warnings"] if w["kind"] == "straggler"]
    assert note["ranks"] == [1] and note["message"].startswith("rank 1 arrived last at 14 of 14 collectives")
    assert "its trace and samples are on its node" in note["message"]
    assert report["ranks"] == {"0": {"state": "ok", "exit_code": 0, "signal": None},
                               "1": {"state": "ok", "exit_code": 0, "signal": None}}
    assert report["collectives"] == {"0": 14, "1": 14}  # rank 1's count came from its node
    assert tagged(tag) == []


def test_a_crash_on_node_b_is_named_in_the_report_before_torchrun_returns(tmp_path, line_of):
    """Rank 1 (node-b) raises at its second step; rank 0 (node-a) then loses its peer. The job's report, on node-a,
    names rank 1's error and line with rank 0's loss folded in, and exists when the last torchrun returns; node-b
    keeps its own report; nothing of the run is alive 2 s later."""
    reason = unshare_refused()
    if reason:
        pytest.skip(reason)
    tag = f"multinode-{uuid.uuid4().hex[:8]}"
    nodes = run_two_nodes(tmp_path, "multinode_crash.py", 15, tag, "--crash-rank", "1")
    left = no_watcher_left(tag, nodes.last_exit)
    assert not left, "\n".join(left)
    assert nodes.reports_at_exit == {"node-a": True, "node-b": False}, nodes.consoles
    report = load_report(tmp_path / "node-a")
    line = line_of("multinode_crash.py", "raise ValueError")
    (failure,) = report["findings"]
    assert failure["kind"] == "rank_failure" and failure["ranks"] == [1], report["findings"]
    assert failure["message"].startswith(f"rank 1 raised ValueError: bad sample in step 1 at multinode_crash.py:{line}"
                                         "; rank 0 failed in all_reduce #2 on group [0,1]"), failure["message"]
    assert failure["detail"]["line"] == line
    own = load_report(tmp_path / "node-b" / "node-node-b")
    assert [(f["kind"], f["ranks"]) for f in own["findings"]] == [("rank_failure", [1])]
    assert "the report of this job is on node-a" in nodes.consoles["node-b"]


def test_a_crash_on_node_a_leaves_both_node_reports_when_the_watchers_are_killed_at_torchruns_exit(tmp_path,
                                                                                                   line_of):
    """2 ranks per node; rank 0 raises; every process of a node is SIGKILLed the moment its torchrun returns. Each
    node's own report was written before: `distcheck report` merges them into the job's report."""
    reason = unshare_refused()
    if reason:
        pytest.skip(reason)
    tag = f"multinode-{uuid.uuid4().hex[:8]}"
    nodes = run_two_nodes(tmp_path, "multinode_crash.py", 15, tag, "--crash-rank", "0", nproc=2, kill_at_exit=True)
    left = no_watcher_left(tag, nodes.last_exit, within=0.0)
    assert not left, "\n".join(left)
    for host in HOSTS:
        assert (tmp_path / host / f"node-{host}" / "report.json").exists(), (host, nodes.consoles[host])
        assert (tmp_path / host / f"node-{host}" / "summary.json").exists()
    line = line_of("multinode_crash.py", "raise ValueError")
    res = run_python(["-m", "distcheck", "report", "--format", "json", str(tmp_path / "node-a"),
                      str(tmp_path / "node-b")], timeout=60)
    assert res.returncode == 1, res.output
    merged = json.loads(res.stdout)
    causes = [f for f in merged["findings"] if f["kind"] == "rank_failure"]
    assert causes[0]["ranks"] == [0] and causes[0]["detail"]["line"] == line, merged["findings"]
    assert causes[0]["message"].startswith(f"rank 0 raised ValueError: bad sample in step 1 at "
                                           f"multinode_crash.py:{line}")
    assert set(merged["nodes"]) == set(HOSTS)


def test_a_node_set_up_differently_is_named_as_a_collective_mismatch_across_nodes(tmp_path, line_of):
    """node-b's ranks all-reduce [48] where node-a's all-reduce [64]: gloo aborts, and each node alone sees nothing
    wrong. Node 0 compares the nodes' digests and names the collective, both sides and both lines."""
    reason = unshare_refused()
    if reason:
        pytest.skip(reason)
    tag = f"multinode-{uuid.uuid4().hex[:8]}"
    nodes = run_two_nodes(tmp_path, "multinode_shape_mismatch.py", 15, tag, env={"node-b": {"MODEL_WIDTH": "48"}})
    left = no_watcher_left(tag, nodes.last_exit)
    assert not left, "\n".join(left)
    report = load_report(tmp_path / "node-a")
    line = line_of("multinode_shape_mismatch.py", "dist.all_reduce(grad)")
    (mismatch,) = report["findings"]
    assert mismatch["kind"] == "collective_mismatch" and mismatch["ranks"] == [0, 1], report["findings"]
    assert mismatch["message"].startswith(
        f"collective #1 on group [0,1] differs in shapes across nodes: rank 0 (node-a) issued all_reduce [64] "
        f"float32 SUM at multinode_shape_mismatch.py:{line}; rank 1 (node-b) issued all_reduce [48] float32 SUM at "
        f"multinode_shape_mismatch.py:{line}"), mismatch["message"]
    assert mismatch["detail"]["line"] == line and mismatch["detail"]["across_nodes"]


def test_two_node_consistency_names_a_variable_set_on_one_node_and_its_watcher_publishes_the_report(tmp_path):
    """NCCL_ALGO is set on node-b only: the job's one report, on node-a (global rank 0's node), names it. Rank 0
    composed that report and handed it to node-a's watcher, which wrote it (contract/report_handoff.py); node-b
    printed where it is."""
    reason = unshare_refused()
    if reason:
        pytest.skip(reason)
    tag = f"multinode-{uuid.uuid4().hex[:8]}"
    nodes = run_two_nodes(tmp_path, None, 60, tag, "consistency", "--steps", "1",
                          env={"node-b": {"NCCL_ALGO": "Ring"}})
    host, report = one_report(tmp_path, nodes.consoles)
    assert host == "node-a"
    (mismatch,) = report["findings"]
    assert mismatch["kind"] == "env_mismatch" and mismatch["detail"]["key"] == "NCCL_ALGO", report["findings"]
    assert mismatch["ranks"] == [0, 1] and "'Ring'" in mismatch["message"]  # two ranks: no majority
    assert "distcheck FAILED (1 finding)" in nodes.consoles["node-a"]
    log = (tmp_path / "node-a" / "watcher-node-a.log").read_text()
    assert "handed over (final): published" in log, log
    assert not [p for p in (tmp_path / "node-a").iterdir() if p.name.startswith(".report-")]
    assert tagged(tag) == []
