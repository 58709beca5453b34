"""The distributed marker, tested through pytester in subprocesses (each with its own rank pool)."""
import re
from pathlib import Path

import pytest
from launch_helpers import run_pytest

PASSING_FAILING_HANGING = '''
import time, pytest, torch, torch.distributed as dist

@pytest.mark.distributed(nprocs=2, timeout=30)
def test_passes(dist_ctx):
    t = torch.ones(4) * (dist_ctx.rank + 1)
    dist.all_reduce(t)
    assert t.tolist() == [3.0] * 4 and dist_ctx.world_size == 2 and str(dist_ctx.device) == "cpu"

@pytest.mark.distributed(nprocs=2, timeout=30)
@pytest.mark.parametrize("value", [1, 2])
def test_fails_on_rank_1(dist_ctx, value, tmp_path):
    assert tmp_path.exists()
    assert dist_ctx.rank == 0, f"rank-one-broke-{value}"

@pytest.mark.distributed(nprocs=2, timeout=30)
def test_ddp_unused_head(dist_ctx):
    class WithAux(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Linear(4, 4)
            self.aux = torch.nn.Linear(4, 2)  # never used in forward
        def forward(self, x):
            return self.body(x)
    model = torch.nn.parallel.DistributedDataParallel(WithAux())
    for _ in range(2):
        model(torch.ones(2, 4)).sum().backward()

@pytest.mark.distributed(nprocs=2, timeout=4)
def test_hangs(dist_ctx):
    if dist_ctx.rank == 1:
        time.sleep(60)
    dist.barrier()

@pytest.mark.distributed(nprocs=2, timeout=30)
def test_passes_after_a_hang(dist_ctx):
    mesh = dist_ctx.mesh((2,), ("dp",))
    assert mesh.size() == 2
    dist.barrier()

@pytest.mark.distributed(nprocs=2)
@pytest.mark.skipif(False, reason="other markers still apply")
def test_skips_inside(dist_ctx):
    pytest.skip("skipped on every rank")

@pytest.mark.distributed(nprocs=2, timeout=60)
def test_mismatched_collectives(dist_ctx):
    t = torch.ones(4)
    if dist_ctx.rank == 0:
        dist.all_reduce(t)  # rank 0's collective
    else:
        dist.broadcast(t, src=0)  # rank 1's collective
'''


def test_pass_fail_hang_parametrize(pytester, line_of):
    pytester.makepyfile(test_dist=PASSING_FAILING_HANGING)
    result = run_pytest(pytester, "-p", "no:cacheprovider", "-v", "--durations=0", timeout=240)
    out = result.stdout.str()
    result.assert_outcomes(passed=2, failed=5, skipped=1)
    assert re.search(r"test_passes PASSED", out) and re.search(r"test_passes_after_a_hang PASSED", out)
    # A failure shows the failing rank's assertion, labelled, once per test; rank 0 passed so is not shown.
    assert out.count("[rank 1] ----------") >= 2 and "rank-one-broke-1" in out and "rank-one-broke-2" in out
    fails = out[out.index("_ test_fails_on_rank_1[1] _"):]
    fails = fails[:fails.index("_ test_fails_on_rank_1[2] _")]
    assert "---------- [rank 1] ----------" in fails and "---------- [rank 0] ----------" not in fails
    def line_in_test(marker):
        return line_of(None, marker, text=PASSING_FAILING_HANGING.strip("\n"))

    # torch's DDP error stays, and under it what it means in the model's terms (indices -> names, lines, fixes).
    aux = line_in_test("self.aux = torch.nn.Linear")
    assert "Parameter indices which did not receive grad" in out
    assert (f"[distcheck] DDP: 2 parameters got no gradient, so DDP's gradient reduction never finished and the next "
            f"forward failed: 'aux.weight', 'aux.bias' (created at test_dist.py:{aux})") in out
    # A hang names the odd rank and its line, where the others wait, and shows the grouped stacks.
    sleep = line_in_test("time.sleep(60)")
    assert (f"distributed test hung: no progress for 4s: rank 1 is in test_hangs (test_dist.py:{sleep}) while "
            f"rank 0 waits in barrier #1 (test_dist.py:{sleep + 1})") in out
    assert "MINORITY" in out and "last collectives (from the trace)" in out
    # Mismatched collectives fail in seconds (not at the 60 s timeout) and show the first divergence.
    assert "distributed test cannot progress" in out
    assert (f"first divergence: collective #1 on group [0,1] differs in op, reduce_op, root: rank 0 issued "
            f"all_reduce [4] float32 SUM at test_dist.py:{line_in_test('rank 0' + chr(39) + 's collective')}") in out
    duration = re.search(r"([0-9.]+)s call +test_dist.py::test_mismatched_collectives", out)
    assert duration and float(duration.group(1)) < 30  # it did not wait for its 60 s timeout
    # The failed pools' work directories (their traces back the messages above) are gone with the session.
    kept = re.search(r"\(per-rank traces: (\S+), removed when the session ends", out)
    assert kept and not Path(kept.group(1)).parent.exists()


def test_xdist_several_distributed_tests(pytester):
    body = "\n".join(f'''
@pytest.mark.distributed(nprocs=2, timeout=60)
def test_sum_{i}(dist_ctx):
    t = torch.full((3,), float(dist_ctx.rank + {i}))
    dist.all_reduce(t)
    assert t[0].item() == 1 + 2 * {i}
''' for i in range(6))
    pytester.makepyfile(test_many="import pytest, torch, torch.distributed as dist\n" + body)
    result = run_pytest(pytester, "-p", "no:cacheprovider", "-n", "2", timeout=240)
    result.assert_outcomes(passed=6)


CRASHING = '''
import ctypes, sys, pytest, torch.distributed as dist

@pytest.mark.distributed(nprocs=2, timeout=30)
def test_crashes_on_rank_1(dist_ctx):
    if dist_ctx.rank == 1:
        print("rank-one-about-to-crash", file=sys.stderr, flush=True)
        ctypes.string_at(0)
    dist.barrier()
'''


def test_a_rank_that_dies_shows_its_stderr(pytester):
    pytester.makepyfile(test_crash=CRASHING)
    result = run_pytest(pytester, "-p", "no:cacheprovider", timeout=240)
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "rank 1 exited with code -11" in out
    stderr_part = out[out.index("[rank 1] stderr (last"):]
    assert "rank-one-about-to-crash" in stderr_part and "Segmentation fault" in stderr_part
    assert "test_crash.py" in stderr_part  # faulthandler's stack names the test's line


STATEFUL = '''
import os, pytest, torch, torch.distributed as dist

@pytest.mark.distributed(nprocs=2, timeout=30)
def test_a_changes_the_process(dist_ctx, tmp_path):
    os.environ["LEAKED_BY_TEST_A"] = "1"
    os.chdir(tmp_path)
    open(f"moved-here-{dist_ctx.rank}", "w").close()
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.manual_seed(1234 + dist_ctx.rank)

@pytest.mark.distributed(nprocs=2, timeout=30)
def test_b_starts_clean(dist_ctx):
    assert "LEAKED_BY_TEST_A" not in os.environ
    assert torch.get_default_dtype() == torch.float32 and torch.is_grad_enabled()
    assert not any(name.startswith("moved-here") for name in os.listdir("."))
    t = torch.ones(2)
    dist.all_reduce(t)
    assert t.tolist() == [2.0, 2.0]
'''


def test_each_distributed_test_starts_from_the_same_process_state(pytester):
    pytester.makepyfile(test_state=STATEFUL)
    result = run_pytest(pytester, "-p", "no:cacheprovider", "-v", timeout=240)
    result.assert_outcomes(passed=2)


HANGING = '''
import time, pytest, torch.distributed as dist

@pytest.mark.distributed(nprocs=2, timeout=120)
def test_hangs(dist_ctx):
    if dist_ctx.rank == 1:
        time.sleep(120)
    dist.barrier()
'''


@pytest.mark.parametrize("zygote", ["0", None], ids=["fresh", "zygote"])
def test_sigterm_to_pytest_ends_every_rank_worker(pytester, zygote):
    import os
    import signal
    import subprocess
    import sys
    import time
    import uuid
    from pathlib import Path

    from distcheck.processes import read_environ

    pytester.makepyfile(test_hang=HANGING)
    tag = uuid.uuid4().hex  # the pool's ranks inherit the environment: found by it, whoever forked them
    env = {**os.environ, "DISTCHECK_TEST_TAG": tag}
    if zygote is not None:  # fresh interpreters, children of pytest; else forked by this session's shared zygote
        env["DISTCHECK_ZYGOTE"] = zygote
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "test_hang.py"],
                            cwd=pytester.path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, env=env)

    def workers() -> list[int]:
        out = []
        for entry in Path("/proc").iterdir():
            try:
                environ = read_environ(int(entry.name))
            except (OSError, ValueError):
                continue
            if environ.get("DISTCHECK_TEST_TAG") == tag and "DISTCHECK_POOL_ADDR" in environ:
                out.append(int(entry.name))
        return out

    try:
        deadline = time.monotonic() + 120
        while len(workers()) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, "the pool never started"
            time.sleep(0.2)
        pids = workers()
        time.sleep(2)  # the test body is running: rank 1 sleeps, rank 0 waits in the barrier
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(Path(f"/proc/{p}").exists() and "Z" not in (Path(f"/proc/{p}/stat").read_text().split()[2])
                  for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert time.monotonic() < deadline, f"pool workers {pids} outlived pytest"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


ASSERTING = '''
import pytest, torch

@pytest.mark.distributed(nprocs=2, timeout=30)
def test_values(dist_ctx):
    t = torch.ones(2) * (dist_ctx.rank + 1)
    assert t.tolist() == [1.0, 1.0]
'''


def test_a_failing_assert_on_a_rank_shows_the_values(pytester):
    pytester.makepyfile(test_values=ASSERTING)
    result = run_pytest(pytester, "-p", "no:cacheprovider", timeout=240)
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    rank1 = out[out.index("---------- [rank 1] ----------"):]
    assert "assert [2.0, 2.0] == [1.0, 1.0]" in rank1
    assert "---------- [rank 0] ----------" not in out


SAVING = '''
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

HERE = Path(__file__).parent


@pytest.mark.distributed(nprocs=2, timeout=60)
def test_every_rank_saves_its_shard_to_one_file(dist_ctx):
    torch.save({"w": torch.full((4,), float(dist_ctx.rank))}, HERE / "ckpt.pt")  # SAVE
    dist.barrier()


@pytest.mark.distributed(nprocs=2, timeout=60)
def test_rank_0_saves_alone(dist_ctx):
    if dist_ctx.rank == 0:
        torch.save({"w": torch.ones(4)}, HERE / "ckpt0.pt")
    dist.barrier()


@pytest.mark.distributed(nprocs=2, timeout=60)
def test_every_rank_saves_the_same_weights(dist_ctx):
    torch.save({"w": torch.ones(4)}, HERE / "same.pt")
    dist.barrier()
'''


def test_one_file_that_the_ranks_save_with_different_contents_fails_the_test(pytester, line_of):
    """As under `distcheck run`: one path, several writers, different contents; a rank-0 save or identical
    contents pass."""
    pytester.makepyfile(test_saves=SAVING)
    result = run_pytest(pytester, "-p", "no:cacheprovider", "-v", timeout=240)
    result.assert_outcomes(passed=2, failed=1)
    out = result.stdout.str()
    assert re.search(r"test_every_rank_saves_its_shard_to_one_file FAILED", out)
    save = line_of(None, "# SAVE", text=SAVING.strip("\n"))
    assert "[tensor_divergence] ranks 0-1" in out and "ckpt.pt" in out and f"test_saves.py:{save}" in out
