"""The CUDA paths on a real GPU (run it where one is: the CPU suite tests these with stand-ins).

    python bench/bench_gpu.py                                    # 1 rank on NCCL, in this process
    python bench/bench_gpu.py --stragglers                       # 2 ranks on this GPU under distcheck run
    python -m distcheck run --nproc 1 -- bench/bench_gpu.py --compiled-ddp    # compiled + DDP under distcheck

In one process with a 1-rank NCCL group: (1) what the tracer adds to a 1024-float all_reduce (the C or Python hot
path, against the unwrapped function, alternating rounds, fastest of each), and what leaving a ring-completed op
open saves (``tracer_open_ab``); (2) CUDA-event completion: a traced all_reduce queued behind a long matmul ends
when the GPU ran it, not when the call returned; (3) the fingerprint pass: the Triton kernel's sums against
torch's on tensors of every dtype, its first call's cost, then the pass over about 1 GB of float32 and over 512
small tensors against one ``torch.sum`` per tensor, and the kernel's settings; (4) what torch's Flight Recorder
holds for NCCL (names, states). ``--stragglers``: a data-loading and a compute straggler on CUDA tensors
(bench/_gpu_straggler.py) and what the report names. With ``--compiled-ddp`` (under ``distcheck run``): a compiled
fullgraph step with a functional all_reduce and a DDP model train on the GPU; the report's trace then names the
compiled collective's line and DDP's bucket all-reduce. Prints one JSON line. Figures: docs/performance.md, GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist


def _init() -> None:
    if not dist.is_initialized():
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    torch.cuda.set_device(0)


def tracer_cost(rounds: int = 15, iters: int = 2000) -> dict:
    from distcheck.rank import tracer as trace

    out = tempfile.mkdtemp()
    tr = trace.install(out, 0)
    x = torch.ones(1024, device="cuda")
    traced = dist.all_reduce
    plain = traced.__distcheck_original__
    times = {"plain": [], "traced": []}
    for fn in (plain, traced):
        for _ in range(200):
            fn(x)
    torch.cuda.synchronize()
    for _ in range(rounds):
        for name, fn in (("plain", plain), ("traced", traced)):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn(x)
            host = time.perf_counter() - t0  # host side: what the caller pays per launch
            torch.cuda.synchronize()
            times[name].append(host / iters)
    hot = "python" if tr._fast is None else "c"
    trace.uninstall()
    p, t = min(times["plain"]), min(times["traced"])
    return {"hot_path": hot, "plain_us": p * 1e6, "traced_us": t * 1e6, "adds_us": (t - p) * 1e6,
            "median_adds_us": (statistics.median(times["traced"]) - statistics.median(times["plain"])) * 1e6}


def tracer_open_ab(rounds: int = 30, iters: int = 2000) -> dict:
    """What leaving a ring-completed NCCL op's record open without a Python call saves: two wrappers of the same
    all_reduce in one tracer, one whose cached sig says AFTER_NOTHING (today), one made to say AFTER_EVENT (before:
    CudaCompletions.add found the sig among the ring's and returned), against the plain op, alternating rounds."""
    from distcheck.rank import tracer as trace

    tr = trace.install(tempfile.mkdtemp(), 0)
    x = torch.ones(1024, device="cuda")
    plain = dist.all_reduce.__distcheck_original__
    new = dist.all_reduce
    keep = trace.AFTER_NOTHING
    trace.AFTER_NOTHING = trace.AFTER_EVENT  # only while the old-style wrapper describes its call
    old = tr.wrap(plain, "all_reduce", funcol=False)
    old(x)
    trace.AFTER_NOTHING = keep
    times: dict = {"plain": [], "open": [], "event_then_ring": []}
    fns = (("plain", plain), ("open", new), ("event_then_ring", old))
    for _, fn in fns:
        for _ in range(200):
            fn(x)
    for _ in range(rounds):
        for name, fn in fns:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn(x)
            times[name].append((time.perf_counter() - t0) / iters)
            torch.cuda.synchronize()
    trace.uninstall()
    return {name: {"fastest_us": min(v) * 1e6, "median_us": statistics.median(v) * 1e6}
            for name, v in times.items()}


def completion() -> dict:
    from distcheck.analysis.trace_events import load_traces
    from distcheck.rank import tracer as trace

    out = tempfile.mkdtemp()
    trace.install(out, 0)
    a = torch.randn(8192, 8192, device="cuda")
    x = torch.ones(1 << 20, device="cuda")
    torch.cuda.synchronize()
    t_call = time.time()
    for _ in range(20):
        a = a @ a / 8192  # about 0.1 s of GPU work queued ahead of the collective
    dist.all_reduce(x)
    returned = time.time()
    torch.cuda.synchronize()
    done = time.time()
    trace.current().note({"ev": "exit", "ok": True, "code": 0})
    trace.uninstall()
    (ev,) = load_traces(out)[0].events[-1:]
    return {"call_returned_after_s": returned - t_call, "gpu_done_after_s": done - t_call,
            "traced_end_after_s": (ev.t_end or 0) - t_call, "end_from": ev.extra.get("completion", "cuda event"),
            "ends_with_the_gpu": ev.t_end is not None and ev.t_end >= returned}


def _timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def _torch_path():
    """fingerprint_many with the Triton kernel left out (the default: DISTCHECK_FINGERPRINT_KERNEL unset)."""
    from unittest import mock

    from distcheck.rank.checks import fingerprint_kernel

    return mock.patch.object(fingerprint_kernel, "rows_for", lambda *a: None)


_FIRST_CALL = """
import time, torch
from distcheck.rank.checks.fingerprint import fingerprint_many
x = torch.ones(4096, device="cuda")
torch.cuda.synchronize()
t0 = time.perf_counter()
fingerprint_many([("x", x)])
print(time.perf_counter() - t0)
"""


def fingerprint_first_call() -> dict:
    """What the kernel's first use costs a process: Triton's import and compile with an empty cache (a fresh
    TRITON_CACHE_DIR), then in a new process with that cache filled (every later run on the machine)."""
    import subprocess
    import sys

    cache = tempfile.mkdtemp()
    env = {**os.environ, "TRITON_CACHE_DIR": cache}
    runs = [subprocess.run([sys.executable, "-c", _FIRST_CALL], env=env, capture_output=True, text=True,
                           timeout=120) for _ in range(2)]
    return {"cold_s": runs[0].stdout.strip() or runs[0].stderr[-500:], "cached_s": runs[1].stdout.strip()}


def fingerprint_sums_agree() -> dict:
    """The kernel's sums against torch's on random tensors of every dtype, odd sizes, views and huge values."""
    from distcheck.rank.checks.fingerprint import MIN_CHUNK_NUMEL, fingerprint_many

    gen = torch.Generator(device="cuda").manual_seed(1)
    base = torch.randn(MIN_CHUNK_NUMEL * 40 + 17, device="cuda", generator=gen)
    named = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
                  torch.int8, torch.uint8, torch.bool):
        for numel in (1, 7, 4096, MIN_CHUNK_NUMEL - 1, MIN_CHUNK_NUMEL * 16 + 3, MIN_CHUNK_NUMEL * 33):
            t = base[:numel] * 1e6
            t = t > 0 if dtype is torch.bool else t.to(dtype)
            named.append((f"{dtype}-{numel}", t))
    named.append(("big_ints", torch.randint(-2 ** 62, 2 ** 62, (MIN_CHUNK_NUMEL * 20,), device="cuda",
                                            generator=gen)))
    named.append(("odd_view", base[3:MIN_CHUNK_NUMEL * 4]))
    named.append(("transposed", base[:1000 * 300].view(1000, 300).t()))
    with _torch_path():
        expected = fingerprint_many(named)
    got = fingerprint_many(named)
    differ = [n for n in expected if expected[n] != got[n]]
    return {"tensors": len(named), "differ": differ}


def fingerprints(repeats: int = 15) -> dict:
    """The pass over about 1 GB of float32 in HBM (16 x 64 MiB + 32 small) and over 512 tensors of 1 MiB, each
    against one torch.sum per tensor (the issue's 'one HBM read'), with the kernel and with torch's sums; the
    kernel's first call (its compile) and the card's read bandwidth from a large copy."""
    from distcheck.rank.checks import fingerprint_kernel
    from distcheck.rank.checks.fingerprint import fingerprint_many

    gen = torch.Generator(device="cuda").manual_seed(0)
    big = [torch.randn(4096, 4096, device="cuda", generator=gen) for _ in range(16)]  # 16 x 64 MiB
    big += [torch.randn(4096, device="cuda", generator=gen) for _ in range(32)]
    many = [torch.randn(512, 512, device="cuda", generator=gen) for _ in range(512)]  # a model of many tensors
    out: dict = {"kernel": fingerprint_kernel.available(), "span": fingerprint_kernel.SPAN,
                 "block": fingerprint_kernel.BLOCK, "warps": fingerprint_kernel.WARPS}
    out["first_call_s"] = _timed(lambda: fingerprint_many([("x", big[-1])]))  # compiles, or loads Triton's cache
    for label, tensors in (("1gb", big), ("many", many)):
        named = [(f"t{i}", t) for i, t in enumerate(tensors)]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        sums = lambda: [t.sum() for t in tensors]  # noqa: E731
        fps = lambda: fingerprint_many(named)  # noqa: E731

        def torch_fps() -> None:
            with _torch_path():
                fingerprint_many(named)
        for fn in (sums, fps, torch_fps):
            _timed(fn)
        s = statistics.median(_timed(sums) for _ in range(repeats))
        f = statistics.median(_timed(fps) for _ in range(repeats))
        t = statistics.median(_timed(torch_fps) for _ in range(repeats))
        out[label] = {"gb": nbytes / 1e9, "sum_ms": s * 1e3, "fingerprint_ms": f * 1e3, "ratio": f / s,
                      "torch_path_ms": t * 1e3, "torch_path_ratio": t / s, "fingerprint_read_gbs": nbytes / f / 1e9,
                      "sum_read_gbs": nbytes / s / 1e9}
    src, dst = torch.empty(1 << 28, device="cuda"), torch.empty(1 << 28, device="cuda")  # 1 GiB each
    _timed(lambda: dst.copy_(src))
    c = statistics.median(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    out["copy_read_plus_write_gbs"] = 2 * src.numel() * 4 / c / 1e9
    return out


def fingerprint_configs() -> list[dict]:
    """The kernel's pass over the 1 GB set at a few (SPAN, BLOCK, WARPS): the defaults come from this table."""
    from distcheck.rank.checks import fingerprint_kernel as fk
    from distcheck.rank.checks.fingerprint import fingerprint_many

    gen = torch.Generator(device="cuda").manual_seed(0)
    named = [(f"t{i}", torch.randn(4096, 4096, device="cuda", generator=gen)) for i in range(16)]
    saved = fk.SPAN, fk.BLOCK, fk.WARPS
    rows = []
    for _ in range(50):  # the card's clocks up first: the first setting timed ran 20 to 40% slow otherwise
        fingerprint_many(named)
    for span, block, warps in ((1 << 16, 4096, 16), (1 << 16, 2048, 8), (1 << 17, 4096, 16), (1 << 15, 4096, 16),
                               (1 << 16, 8192, 16), (1 << 16, 4096, 8), (1 << 16, 4096, 16)):
        fk.SPAN, fk.BLOCK, fk.WARPS = span, block, warps
        _timed(lambda: fingerprint_many(named))
        ms = statistics.median(_timed(lambda: fingerprint_many(named)) for _ in range(11)) * 1e3
        rows.append({"span": span, "block": block, "warps": warps, "ms": ms,
                     "gbs": 16 * 4096 * 4096 * 4 / ms / 1e6})
    fk.SPAN, fk.BLOCK, fk.WARPS = saved
    return rows


def stragglers_on_cuda() -> dict:
    """Two ranks on this GPU (gloo over CUDA tensors: NCCL refuses two ranks on one GPU) under distcheck run, rank 1
    slow at loading data, then at computing: what the report names, from traces whose ends are CUDA events."""
    import subprocess
    import sys

    from distcheck.analysis import stragglers
    from distcheck.analysis.trace_events import load_traces
    from distcheck.contract import samples_file

    out = {}
    for mode in ("data", "compute"):
        folder = tempfile.mkdtemp()
        t0 = time.perf_counter()
        res = subprocess.run([sys.executable, "-m", "distcheck", "run", "--nproc", "2", "--oversubscribe", "--report-dir", folder,
                              "--", os.path.join(os.path.dirname(__file__), "_gpu_straggler.py"), "--mode", mode],
                             capture_output=True, text=True, timeout=240)
        took = time.perf_counter() - t0
        try:
            report = json.load(open(os.path.join(folder, "report.json")))
        except OSError:
            out[mode] = {"exit": res.returncode, "stderr": res.stderr[-2000:]}
            continue
        traces = load_traces(folder)
        t1 = time.perf_counter()
        late = stragglers.analyze(traces, samples_file.read_all(folder))
        analysis = time.perf_counter() - t1
        notes = [w for w in report.get("warnings", []) if "arrived last" in str(w)]
        out[mode] = {"exit": res.returncode, "run_s": took, "named": report["stragglers"]["named"],
                     "ranks": report["stragglers"]["ranks"], "note": notes[:1], "analysis_s": analysis,
                     "named_again": late.named,
                     "ended": {r: sum(e.t_end is not None for e in t.events) for r, t in traces.items()},
                     "records": {r: len(t.events) for r, t in traces.items()}}
    return out


def flight_recorder() -> dict:
    from distcheck.rank.flight_recorder import _rings

    dist.all_reduce(torch.ones(8, device="cuda"))
    torch.cuda.synchronize()
    time.sleep(1.0)  # NCCL's watchdog discovers completions on its own schedule
    out = {}
    for ring, fn in _rings():
        t0 = time.perf_counter()
        d = json.loads(fn(True, False))
        took = time.perf_counter() - t0
        last = d["entries"][-1] if d.get("entries") else {}
        out[ring] = {"entries": len(d.get("entries") or []), "dump_ms": took * 1e3,
                     "last_name": last.get("profiling_name"), "last_state": last.get("state"),
                     "completed_after_created_ms": (int(last.get("time_discovered_completed_ns") or 0)
                                                    - int(last.get("time_created_ns") or 0)) / 1e6 if last else None}
    return out


def compiled_ddp() -> None:
    import torch.distributed._functional_collectives as funcol
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))

    @torch.compile(fullgraph=True, backend="inductor")
    def step(x: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(x * 2, "sum", dist.group.WORLD)  # COMPILED ALL_REDUCE

    for _ in range(3):
        step(torch.ones(64, device="cuda"))
    model = DDP(torch.nn.Linear(256, 256).cuda())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.randn(8, 256, device="cuda")).sum().backward()  # DDP BACKWARD
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compiled-ddp", action="store_true")
    parser.add_argument("--stragglers", action="store_true", help="only the 2-rank straggler runs on this GPU")
    args = parser.parse_args()
    os.environ.setdefault("DISTCHECK_FINGERPRINT_KERNEL", "triton")  # the kernel is opt-in; this measures it
    if not torch.cuda.is_available() or not dist.is_nccl_available():
        print("bench_gpu: no CUDA GPU with NCCL here: skipped (docs/performance.md's GPU figures come from a lent machine)")
        return
    if args.compiled_ddp:
        compiled_ddp()
        return
    if args.stragglers:
        print(json.dumps({"device": torch.cuda.get_device_name(0), "stragglers": stragglers_on_cuda()}))
        return
    _init()
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "tracer": tracer_cost(),
           "tracer_open_ab": tracer_open_ab(),
           "completion": completion(), "fingerprint_first_call": fingerprint_first_call(),
           "fingerprint_sums_agree": fingerprint_sums_agree(),
           "fingerprint": fingerprints(), "fingerprint_configs": fingerprint_configs(),
           "flight_recorder": flight_recorder()}
    print(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
