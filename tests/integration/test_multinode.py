"""The multi-node path on one machine: two torchrun agents (--nnodes 2, c10d rendezvous on 127.0.0.1) run
`distcheck consistency` together, as two nodes would (launch/multi_node.sh does the same on a real cluster)."""
import os
import signal
import socket
import subprocess

from launch_helpers import BIN, env_for_ranks, load_report


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_agents_c10d_rendezvous(tmp_path):
    port = free_port()
    procs = []
    for node in range(2):
        cmd = [str(BIN / "torchrun"), "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"test-{port}", "-m", "distcheck",
               "consistency", "--report-dir", str(tmp_path / f"node{node}"), "--timeout", "60", "--steps", "1"]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env=env_for_ranks(), start_new_session=True))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=240)[0])
    finally:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outputs)
    reports = [load_report(tmp_path / f"node{n}") for n in range(2) if (tmp_path / f"node{n}" / "report.json").exists()]
    assert len(reports) == 1  # written once, by global rank 0
    report = reports[0]
    assert report["ok"] and report["world_size"] == 2
    ranks_env = report["environment"]
    assert set(ranks_env) == {"0", "1"}
