"""Run an unmodified script on every rank with collective tracing; report the first diverging collective.

    python -m distcheck run --nproc 2 --timeout 60 --report-dir out -- train.py --lr 0.1
    torchrun --nproc-per-node 2 -m distcheck run --report-dir out -- train.py --lr 0.1

Every rank runs SCRIPT in-process (as ``__main__``, with sys.argv = [SCRIPT, ARGS...]) with the tracer
installed. At the end, or when ranks fail or stop progressing for --timeout seconds, the per-rank traces are
aligned per process group: the first divergence is a ``collective_mismatch`` naming the position, what each rank
issued there and each rank's source line; a rank that raised or died is a ``rank_failure``; no progress is a
``hang``. The report directory holds report.json, report.txt, trace-rank<R>.jsonl and trace.json (Perfetto).

With --nproc, distcheck starts and supervises the ranks (distcheck/supervise/launcher.py) and writes the report itself,
even when ranks crash or hang. Under torchrun the ranks share the report directory (one node, or a shared file
system) and rank 0 writes the report once every rank has finished, failed, or stopped progressing.
Exit codes: 0 no findings, 1 findings, 2 bad input (missing script, not a Python file, bad options).
"""
from __future__ import annotations

import argparse
import logging
import os
import runpy
import sys
import threading
import time
import traceback
from pathlib import Path

from distcheck.rank import sink
from distcheck.analysis.trace_align import (STATE_DIED, STATE_ERROR, STATE_HUNG, STATE_OK, STATE_STOPPED,
                                            STATE_UNKNOWN, RankOutcome, analyze_run, provably_stuck)
from distcheck.analysis.trace_events import RankTrace, load_traces
from distcheck.errors import UsageError
from distcheck.contract.findings import CheckResult, Finding, format_ranks
from distcheck.contract.report import Report, default_report_dir, prepare_report_dir, render_text, write_report
from distcheck.rank.runtime import backstop

log = logging.getLogger("distcheck")

ENV_SUPERVISED = "DISTCHECK_SUPERVISED"
DEFAULT_TIMEOUT = 300.0
# Seconds without progress after which a provably stuck run (a rank waits on a finished peer) is ended.
STOP_GRACE = 2.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=None,
                        help="launch this many ranks on this machine (default: 1, or the ranks of torchrun)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                        help="no-progress limit in seconds: after it the run is declared hung (default 300)")
    parser.add_argument("--report-dir", default=None, help="report directory (default: distcheck-report-<time>)")
    parser.add_argument("--native", action="store_true", help="include native frames in hang stack dumps")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="-- SCRIPT [ARGS...]",
                        help="the Python script to run on every rank, and its arguments")


def validate_script(script_args: list[str]) -> tuple[Path, list[str]]:
    if script_args and script_args[0] == "--":
        script_args = script_args[1:]
    if not script_args:
        raise UsageError("no script given: pass it after --, e.g. distcheck run --nproc 2 -- train.py")
    script = Path(script_args[0])
    if not script.exists():
        raise UsageError(f"script {str(script)!r} does not exist: check the path (relative to {os.getcwd()})")
    if not script.is_file():
        raise UsageError(f"script {str(script)!r} is not a file: pass a Python script such as train.py")
    if script.suffix != ".py":
        try:
            head = script.open("rb").readline(200)
        except OSError as exc:
            raise UsageError(f"script {str(script)!r} cannot be read ({exc.strerror})") from None
        if not (head.startswith(b"#!") and b"python" in head):
            raise UsageError(f"script {str(script)!r} is not a Python file: pass a .py file "
                             "(or a script with a python #! line)")
    return script.resolve(), script_args[1:]


def main(args: argparse.Namespace) -> int:
    script, script_args = validate_script(list(args.script_args))
    if args.timeout is None or args.timeout <= 0:
        raise UsageError(f"--timeout {args.timeout} must be a positive number of seconds")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if args.nproc is not None and os.environ.get(ENV_SUPERVISED) != "1":
            raise UsageError("--nproc is for launching ranks yourself; under torchrun drop it "
                             "(torchrun's --nproc-per-node sets the ranks)")
        return run_in_rank(args, script, script_args)
    nproc = 1 if args.nproc is None else args.nproc
    if nproc < 1:
        raise UsageError(f"--nproc {nproc} must be at least 1")
    return run_supervised(args, script, script_args, nproc)


# -- outcomes and the report -----------------------------------------------------------------------------------

def outcome_from_trace(rank: int, trace: RankTrace | None) -> RankOutcome | None:
    """The outcome a rank wrote itself (its exit line), or None if it never got that far."""
    if trace is None or trace.finished is None:
        return None
    err = trace.errors[-1] if trace.errors else None
    if trace.finished.get("ok"):
        return RankOutcome(rank, STATE_OK, exit_code=0)
    return RankOutcome(rank, STATE_ERROR, exit_code=int(trace.finished.get("code", 1) or 1), error=err)


def build_report(report_dir: Path, command: str, world_size: int, traces: dict[int, RankTrace],
                 outcomes: dict[int, RankOutcome], timeout: float, seconds: float,
                 hang_findings: list[Finding] | None = None, stop_reason: str | None = None) -> Report:
    from distcheck.contract.chrome_trace import write_chrome_trace

    findings = analyze_run(traces, outcomes, world_size, timeout=timeout, hang_findings=hang_findings)
    findings = merge_mesh_errors(findings + sink.collect(report_dir))
    from distcheck.rank.autocheck import report_parts

    # Zero-code checks: model_check (its time), and the first NaN/Inf merged from every rank's own record.
    auto_findings, auto_checks = report_parts(report_dir)
    findings += auto_findings
    # A script that calls check_model itself gets the same findings from the automatic check: report them once.
    seen: set[tuple] = set()
    findings = [f for f in findings if not ((f.kind, tuple(f.ranks), f.message) in seen
                                            or seen.add((f.kind, tuple(f.ranks), f.message)))]
    mismatch = any(f.kind == "collective_mismatch" for f in findings)
    failed = any(o.state != STATE_OK for o in outcomes.values())
    checks = [CheckResult("collective_order", not mismatch, seconds),
              CheckResult("ranks_completed", not failed, 0.0,
                          note=stop_reason or "")] + auto_checks
    artifacts: dict[str, str] = {}
    for r in sorted(traces):
        artifacts[f"trace-rank{r}"] = f"trace-rank{r}.jsonl"
    try:
        write_chrome_trace(traces, report_dir / "trace.json", end_time=time.time())
        artifacts["trace.json"] = "trace.json"
    except OSError as exc:
        log.warning("could not write trace.json: %s", exc)
    for path in sorted(report_dir.glob("findings-rank*.jsonl")) + sorted(report_dir.glob("autocheck-rank*.json")):
        artifacts[path.stem] = path.name
    outcomes_json = {str(r): {"state": o.state, "exit_code": o.exit_code, "signal": o.signal}
                     for r, o in sorted(outcomes.items())}
    return Report(command=command, world_size=world_size, findings=findings, checks=checks, artifacts=artifacts,
                  data={"ranks": outcomes_json, "collectives": {str(r): len(t.events) for r, t in traces.items()}})


def _clean_report_dir(report_dir: Path, ranks: range | list[int]) -> None:
    """Traces and findings files are appended to: a reused report dir must not mix in an earlier run."""
    for r in ranks:
        for name in (f"trace-rank{r}.jsonl", f"findings-rank{r}.jsonl", f"autocheck-rank{r}.json"):
            try:
                (report_dir / name).unlink()
            except FileNotFoundError:
                pass


# -- --nproc: the supervisor -----------------------------------------------------------------------------------

def run_supervised(args: argparse.Namespace, script: Path, script_args: list[str], nproc: int) -> int:
    from distcheck.cli import command_line
    from distcheck.supervise.launcher import Supervisor

    report_dir = prepare_report_dir(args.report_dir).resolve()
    _clean_report_dir(report_dir, range(nproc))
    for name in ("report.json", "report.txt", "trace.json"):
        (report_dir / name).unlink(missing_ok=True)
    argv = [sys.executable, "-m", "distcheck", "run", "--timeout", str(args.timeout),
            "--report-dir", str(report_dir), "--", str(script), *script_args]
    env = dict(os.environ)
    env[ENV_SUPERVISED] = "1"
    env[sink.ENV_REPORT_DIR] = str(report_dir)

    def should_stop(codes: dict[int, int | None]) -> str | None:
        traces = load_traces(report_dir)
        finished = {r for r, c in codes.items() if c is not None}
        return provably_stuck(traces, finished)

    def on_hang(pids: dict[int, int], directory: str) -> list[Finding]:
        # The supervisor is the ranks' parent: py-spy may attach even under Yama ptrace_scope=1.
        from distcheck.supervise.watchdog import diagnose_hang

        return diagnose_hang(pids, directory, native=args.native, timeout=args.timeout, world_size=nproc)

    supervisor = Supervisor(nproc, lambda rank: argv, report_dir=report_dir, timeout=args.timeout, env=env,
                            on_hang=on_hang, should_stop=should_stop, stop_grace=STOP_GRACE)
    result = supervisor.run()
    traces = load_traces(report_dir)
    outcomes: dict[int, RankOutcome] = {}
    for r, ex in result.exits.items():
        trace = traces.get(r)
        if ex.killed == "hang":
            outcomes[r] = RankOutcome(r, STATE_HUNG)
            continue
        if ex.killed == "stop":
            outcomes[r] = RankOutcome(r, STATE_STOPPED)
            continue
        own = outcome_from_trace(r, trace)
        if own is not None and not (own.state == STATE_OK and ex.returncode not in (0, None)):
            own.exit_code = ex.returncode
            outcomes[r] = own
        elif ex.returncode == 0:
            outcomes[r] = RankOutcome(r, STATE_OK, exit_code=0)
        else:
            err = trace.errors[-1] if trace is not None and trace.errors else None
            outcomes[r] = RankOutcome(r, STATE_ERROR if err else STATE_DIED, ex.returncode, ex.signal, err)
    report = build_report(report_dir, command_line(args.argv), nproc, traces, outcomes, args.timeout,
                          result.seconds, result.hang_findings, result.stop_reason)
    for finding in result.hang_findings:
        report.artifacts.update(finding.detail.get("artifacts", {}))
    write_report(report, report_dir)
    sys.stdout.write(render_text(report, report_dir))
    sys.stdout.flush()
    return report.exit_code


# -- inside a rank (supervised, or under torchrun) -------------------------------------------------------------

def _torchrun_default_dir() -> Path:
    """All local ranks must agree on the default directory: stamp it with the start time of their common parent
    (torchrun's agent), not each rank's own clock."""
    try:
        ticks = int(Path(f"/proc/{os.getppid()}/stat").read_text().rsplit(")", 1)[1].split()[19])
        btime = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                     if line.startswith("btime"))
        return default_report_dir(btime + ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, StopIteration):
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "run")
        return Path.cwd() / f"distcheck-report-{run_id}"


def _execute(script: Path, script_args: list[str], tracer) -> tuple[bool, int]:
    """Run the script as __main__; record an exception (with the user's line) in the trace. (ok, exit code)"""
    sys.argv = [str(script), *script_args]
    sys.path.insert(0, str(script.parent))
    try:
        runpy.run_path(str(script), run_name="__main__")
        return True, 0
    except SystemExit as exc:
        code = exc.code
        if code in (None, 0):
            return True, 0
        exc_info = (type(exc), exc, exc.__traceback__)
        status = code if isinstance(code, int) else 1
    except BaseException as exc:  # noqa: BLE001 - every failure of the script is a finding
        exc_info = (type(exc), exc, exc.__traceback__)
        status = 1
    text = "".join(traceback.format_exception(*exc_info))
    _report_mesh_error(exc_info[1], tracer.rank)
    sys.stderr.write(f"[distcheck rank {tracer.rank}] the script raised:\n{text}")
    sys.stderr.flush()
    from distcheck.rank.usersite import traceback_site

    where = traceback_site(exc_info[2])
    tracer.note({"ev": "error", "exc_type": exc_info[0].__name__, "message": str(exc_info[1]), "traceback": text,
                 "site": where.site, "file": where.file, "line": where.line})
    return False, status


def _report_mesh_error(exc: BaseException, rank: int) -> None:
    """A torch error from building a DeviceMesh is a mesh_mismatch (with the user's line), not just a crash."""
    try:
        from distcheck.checks.mesh import mesh_error_finding

        finding = mesh_error_finding(exc, exc.__traceback__)
    except Exception as err:  # the diagnosis must never hide the script's own error
        log.debug("mesh error check failed: %s", err)
        return
    if finding is not None:
        sink.emit([finding], rank)


def merge_mesh_errors(findings: list[Finding]) -> list[Finding]:
    """One mesh_mismatch per failing init_device_mesh call (every rank raises the same error), and no
    rank_failure for the ranks whose failure it explains."""
    merged: dict[tuple, Finding] = {}
    out: list[Finding] = []
    for f in findings:
        if f.kind != "mesh_mismatch" or "torch_error" not in f.detail:
            out.append(f)
            continue
        key = (f.detail.get("file"), f.detail.get("line"), f.detail["torch_error"])
        if key in merged:
            first = merged[key]
            ranks = sorted(set(first.ranks) | set(f.ranks))
            first.message = first.message.replace(f"failed on {format_ranks(first.ranks)}",
                                                  f"failed on {format_ranks(ranks)}", 1)
            first.ranks = ranks
            continue
        merged[key] = f
        out.append(f)
    explained = {(r, f.detail["torch_error"].split(":", 1)[0]) for f in merged.values() for r in f.ranks}
    return [f for f in out if not (f.kind == "rank_failure" and len(f.ranks) == 1
                                   and (f.ranks[0], f.detail.get("exception")) in explained)]


def run_in_rank(args: argparse.Namespace, script: Path, script_args: list[str]) -> int:
    from distcheck.rank import tracer as trace
    from distcheck.rank.runtime import RankInfo, setup_logging

    info = RankInfo.from_env()
    setup_logging(info)
    supervised = os.environ.get(ENV_SUPERVISED) == "1"
    report_dir = Path(args.report_dir) if args.report_dir else _torchrun_default_dir()
    report_dir = prepare_report_dir(report_dir).resolve()
    os.environ[sink.ENV_REPORT_DIR] = str(report_dir)
    if not supervised:
        _clean_report_dir(report_dir, [info.rank])
    tracer = trace.install(report_dir, info.rank)
    from distcheck.rank import autocheck

    # Finds the models (fully_shard/DDP/TP) and optimizers by itself; DISTCHECK_AUTOCHECK=0 turns it off.
    checker = autocheck.install(report_dir, info.rank)
    from distcheck.supervise.watchdog import rank_bootstrap

    # Stack hooks (ptrace permission for our launcher, faulthandler fallback); under plain torchrun also the node
    # watcher, a process outside the ranks that dumps their stacks on a hang even when one holds the GIL.
    rank_bootstrap(report_dir, args.timeout, native=args.native, trace=False, watcher=not supervised)
    done_marker = report_dir / f".done-{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}-{os.environ.get('MASTER_PORT', '')}"
    if not supervised and info.rank == 0:
        done_marker.unlink(missing_ok=True)
    finalizer = None
    main_done = threading.Event()
    if not supervised:
        finalizer = _TorchrunMonitor(info.rank, info.world_size, report_dir, args, done_marker, main_done)
        finalizer.start()
    ok, code = _execute(script, script_args, tracer)
    if checker is not None:
        checker.finish()  # before the exit line: rank 0 reads every rank's autocheck file once all have exited
    tracer.note({"ev": "exit", "ok": ok, "code": code})
    main_done.set()
    if supervised:
        if ok:
            return 0
        _hard_exit(code or 1)
    assert finalizer is not None
    if info.rank == 0:
        finalizer.join()  # it writes the report once every rank has finished, failed or stopped progressing
        return finalizer.exit_code
    if not ok:
        # Under torchrun a non-zero exit makes the agent kill every other rank at once: stay until rank 0 has
        # written the report (bounded), so the report survives our failure.
        deadline = time.monotonic() + args.timeout + 30
        while time.monotonic() < deadline and not done_marker.exists():
            time.sleep(0.1)
        _hard_exit(code or 1)
    return 0


def _hard_exit(code: int) -> None:
    """After a failure the process group may hold threads blocked on dead peers: exit without joining them."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class _TorchrunMonitor(threading.Thread):
    """Under torchrun: rank 0 waits for every rank's outcome (their trace files) and writes the report; the
    other ranks end themselves once the report is written, if their script is still stuck."""

    def __init__(self, rank: int, world_size: int, report_dir: Path, args: argparse.Namespace, done_marker: Path,
                 main_done: threading.Event) -> None:
        super().__init__(name="distcheck-run-monitor", daemon=True)
        self.rank, self.world_size, self.report_dir, self.args = rank, world_size, report_dir, args
        self.done_marker, self.main_done = done_marker, main_done
        self.exit_code = 1
        self.started_at = time.monotonic()

    def run(self) -> None:
        try:
            if self.rank == 0:
                self._finalize()
            else:
                self._follow()
        except Exception:  # the monitor must never be what breaks the run
            log.exception("distcheck run monitor failed")
            if self.rank == 0 and not self.main_done.is_set():
                _hard_exit(1)

    def _follow(self) -> None:
        while not self.main_done.is_set():
            if self.done_marker.exists():
                # Rank 0 wrote the report while our script is still inside it: stuck on a collective.
                time.sleep(0.5)
                if not self.main_done.is_set():
                    _hard_exit(1)
            time.sleep(0.2)

    def _token(self) -> tuple:
        sizes = []
        for r in range(self.world_size):
            try:
                sizes.append((self.report_dir / f"trace-rank{r}.jsonl").stat().st_size)
            except OSError:
                sizes.append(-1)
        return tuple(sizes)

    def _traces(self) -> dict[int, RankTrace]:
        # A reused report dir may still hold a trace of an earlier run from a rank that has not started yet:
        # only the ranks of this torchrun (same agent process as parent) count.
        ppid = os.getppid()
        return {r: t for r, t in load_traces(self.report_dir).items()
                if r < self.world_size and t.meta.get("ppid", ppid) == ppid}

    def _finalize(self) -> None:
        from distcheck.cli import command_line

        timeout = self.args.timeout
        token, last_progress, last_check = self._token(), time.monotonic(), 0.0
        stop_reason: str | None = None
        hung = False
        while True:
            time.sleep(0.2)
            now = time.monotonic()
            new = self._token()
            if new != token:
                token, last_progress = new, now
            traces = self._traces()
            own = {r: outcome_from_trace(r, traces.get(r)) for r in range(self.world_size)}
            finished = {r for r, o in own.items() if o is not None or not _alive(traces.get(r))}
            if len(finished) == self.world_size:
                break
            idle = now - last_progress
            starting = any(size < 0 for size in new)  # a rank still importing torch: see Supervisor
            # The node watcher diagnoses a hang at `timeout` (with stacks) and ends the job; this thread is the
            # backstop for when it cannot (no py-spy, no permission).
            if idle >= (max(backstop(timeout), 120.0) if starting else backstop(timeout)):
                hung = True
                break
            if idle >= min(STOP_GRACE, timeout) and now - last_check >= STOP_GRACE:
                last_check = now
                stop_reason = provably_stuck(traces, finished)
                if stop_reason:
                    break
        traces = self._traces()
        outcomes: dict[int, RankOutcome] = {}
        for r in range(self.world_size):
            trace = traces.get(r)
            o = outcome_from_trace(r, trace)
            if o is None:
                if trace is not None and _alive(trace):
                    o = RankOutcome(r, STATE_HUNG if hung else STATE_STOPPED)
                else:
                    err = trace.errors[-1] if trace is not None and trace.errors else None
                    o = RankOutcome(r, STATE_DIED if trace is not None else STATE_UNKNOWN, error=err)
            outcomes[r] = o
        report = build_report(self.report_dir, command_line(getattr(self.args, "argv", [])), self.world_size,
                              traces, outcomes, timeout, time.monotonic() - self.started_at,
                              stop_reason=stop_reason)
        write_report(report, self.report_dir)
        sys.stdout.write(render_text(report, self.report_dir))
        sys.stdout.flush()
        self.exit_code = report.exit_code
        self.done_marker.write_text("done\n")
        if not self.main_done.is_set():
            time.sleep(0.5)  # let the other ranks see the marker
            _hard_exit(self.exit_code)


def _alive(trace: RankTrace | None) -> bool:
    """Whether the rank that wrote this trace still runs (same node: its pid from the trace's meta line)."""
    if trace is None:
        return True  # not started yet
    pid = trace.meta.get("pid")
    if not isinstance(pid, int):
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
