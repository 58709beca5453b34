"""The CUDA paths on a real GPU (run it where one is: the CPU suite tests these with stand-ins).

    python bench/bench_gpu.py                                    # 1 rank on NCCL, in this process
    python -m distcheck run --nproc 1 -- bench/bench_gpu.py --compiled-ddp    # compiled + DDP under distcheck

In one process with a 1-rank NCCL group: (1) what the tracer adds to a 1024-float all_reduce (the C or Python hot
path, against the unwrapped function, alternating rounds, fastest of each); (2) CUDA-event completion: a traced
all_reduce queued behind a long matmul ends when the GPU ran it, not when the call returned; (3) the fingerprint
pass over about 1 GB of float32 parameters in HBM against one ``torch.sum`` over the same tensors; (4) what
torch's Flight Recorder holds for NCCL (names, states). With ``--compiled-ddp`` (under ``distcheck run``): a
compiled fullgraph step with a functional all_reduce and a DDP model train on the GPU; the report's trace then
names the compiled collective's line and DDP's bucket all-reduce. Prints one JSON line.
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


def fingerprints(repeats: int = 9) -> dict:
    from distcheck.checks.fingerprint import fingerprint_many

    gen = torch.Generator(device="cuda").manual_seed(0)
    tensors = [torch.randn(4096, 4096, device="cuda", generator=gen) for _ in range(16)]  # 16 x 64 MiB
    tensors += [torch.randn(4096, device="cuda", generator=gen) for _ in range(32)]
    named = [(f"t{i}", t) for i, t in enumerate(tensors)]
    nbytes = sum(t.numel() * 4 for t in tensors)

    def timed(fn) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    sums = lambda: [t.sum() for t in tensors]  # noqa: E731
    fps = lambda: fingerprint_many(named)  # noqa: E731
    timed(sums), timed(fps)
    s = [timed(sums) for _ in range(repeats)]
    f = [timed(fps) for _ in range(repeats)]
    return {"gb": nbytes / 1e9, "sum_ms": statistics.median(s) * 1e3, "fingerprint_ms": statistics.median(f) * 1e3,
            "ratio": statistics.median(f) / statistics.median(s),
            "hbm_read_gbs": nbytes / statistics.median(s) / 1e9}


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
    args = parser.parse_args()
    if not torch.cuda.is_available() or not dist.is_nccl_available():
        print("bench_gpu: no CUDA GPU with NCCL here: skipped (docs/performance.md's GPU figures come from a lent machine)")
        return
    if args.compiled_ddp:
        compiled_ddp()
        return
    _init()
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "tracer": tracer_cost(),
           "completion": completion(), "fingerprint": fingerprints(), "flight_recorder": flight_recorder()}
    print(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
