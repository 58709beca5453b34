"""Every environment variable distcheck passes between its processes, in one place.

    DISTCHECK_REPORT_DIR=out python -m distcheck run -- train.py   # what the launcher sets for each rank, by hand

A variable is the contract between the process that sets it (the launcher, the zygote, a rank, the pytest pool)
and the one that reads it, which often runs other code of another package (supervise/ sets, rank/ reads): both
import the name from here, so neither imports the other's package for a string. Plain constants: importing this
module costs nothing (``python -m distcheck`` reads ZYGOTE before any other import).
"""
from __future__ import annotations

# Set by the launcher (run/compare) or the user, read in every rank.
REPORT_DIR = "DISTCHECK_REPORT_DIR"  # where the rank's per-rank files go
SUPERVISED = "DISTCHECK_SUPERVISED"  # "1": a distcheck supervisor watches this rank (run --nproc, compare)
BACKEND = "DISTCHECK_BACKEND"  # force gloo or nccl
LOG = "DISTCHECK_LOG"  # the ranks' logging level
SAMPLE = "DISTCHECK_SAMPLE"  # "0": no sampling of where each rank's main thread is (rank/sampler.py)
STRAGGLER_LOOKS = "DISTCHECK_STRAGGLER_LOOKS"  # the live line when 70% of the last N looks name one rank ("0": none)
TRACE_HOT_PATH = "DISTCHECK_TRACE_HOT_PATH"  # "python": leave the tracer's C path out
FINGERPRINT_KERNEL = "DISTCHECK_FINGERPRINT_KERNEL"  # "triton": CUDA fingerprints from the Triton kernel
FLIGHT_RECORDER = "DISTCHECK_FLIGHT_RECORDER"  # "0": no Flight Recorder dumps
AUTOCHECK = "DISTCHECK_AUTOCHECK"  # "0": no zero-code checks
DRIFT_STEPS = "DISTCHECK_DRIFT_STEPS"  # the steps after which replicas are fingerprinted
AUTO_RECORD_STEPS = "DISTCHECK_AUTO_RECORD_STEPS"  # compare: how many steps the ranks record by themselves
CAPTURE_MODULE = "DISTCHECK_CAPTURE_MODULE"  # compare: per-module summaries of the first step
CAPTURE_SIDE = "DISTCHECK_CAPTURE_SIDE"  # compare: "reference" or "parallel"
STDERR_KEEP = "DISTCHECK_STDERR_KEEP"  # bytes of a rank's stderr kept at each end of stderr-rank<R>.txt
STACK_SIGNAL = "DISTCHECK_STACK_SIGNAL"  # the faulthandler fallback's signal
STORE_FDS = "DISTCHECK_STORE_FDS"  # rank 0 only: "<listening socket fd>,<lifeline read fd>" of the store it hosts

# The process tree (supervise/procs.py): who started what, so that nothing is left behind.
RUN_ID = "DISTCHECK_RUN_ID"  # every process of one run carries it, whatever started it
ROLE = "DISTCHECK_ROLE"  # what a distcheck process is (launcher, node watcher, stderr copier)
LAUNCHER = "DISTCHECK_LAUNCHER"  # the launcher's pid, for processes that outlive a rank
AGENT_PID = "DISTCHECK_AGENT_PID"  # a torchrun rank forked by the zygote: the agent's pid (its parent is the zygote)
PTRACER = "DISTCHECK_PTRACER"  # the pid a rank lets ptrace it (Yama scope 1), when it is not the parent
ZYGOTE = "DISTCHECK_ZYGOTE"  # "1": a private zygote per launcher; a socket path: a shared one; unset or "0": none
PYSPY = "DISTCHECK_PYSPY"  # the py-spy binary, when it is not next to python or on PATH

# The pytest pool (testing/).
POOL_BACKEND = "DISTCHECK_POOL_BACKEND"
POOL_AUTH = "DISTCHECK_POOL_AUTH"
POOL_ADDR = "DISTCHECK_POOL_ADDR"
POOL_DIR = "DISTCHECK_POOL_DIR"
POOL_WORKER = "DISTCHECK_POOL_WORKER"  # set on each pool rank: whatever the rank starts inherits it
KEEP_POOL_DIRS = "DISTCHECK_KEEP_POOL_DIRS"

# Set by torchrun's agent in each rank. A rank names them in its stack-hook file (contract/stack_hook_file.py): the
# node watcher learns each attempt's world from there, since /proc/<pid>/environ of a rank that a zygote forked
# shows the zygote's environment, not the one torchrun gave the rank.
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                 "TORCHELASTIC_MAX_RESTARTS")
