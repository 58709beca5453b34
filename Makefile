# distcheck set-up, checks and tests. Everything runs from a local .venv created here.
#   make check   create .venv, install torch + distcheck, run the built-in consistency check on 2 CPU ranks
#   make test    the test suite, both tiers, 3 xdist workers (what .ci/run runs)
#   make test-unit   the unit tier alone (no process launched; seconds)
#   make bench   the benchmarks quoted in docs/performance.md
#   make soak    50 runs each of a correct FSDP2 and DDP script under distcheck run --nproc 2: zero findings
# GPU users: make check TORCH_VERSION=2.13.0 TORCH_INDEX=https://download.pytorch.org/whl/cu128
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
TORCH_INDEX ?=
NPROC ?= 2
PY := $(VENV)/bin/python
# what runs from the venv writes .pyc files, whatever the caller's environment says (see the set-up)
RUN := env -u PYTHONDONTWRITEBYTECODE
WARM_IMPORTS := import sys; sys.modules["numpy"] = None; \
	import torch, torch.distributed.tensor.parallel, torch.distributed.fsdp, torch._dynamo
STAMP := $(VENV)/.installed-$(TORCH_VERSION)

.PHONY: setup check test test-unit bench soak clean

setup: $(STAMP)

# torch goes in first, pinned, so that the unpinned "torch" in pyproject.toml is already satisfied and pip never
# pulls a multi-GB CUDA build onto a CPU machine. The editable install also compiles the tracer's C hot path and
# the Flight Recorder dump scanner (setup.py, optional: without a C compiler both take their Python paths); a
# changed .c file re-runs it.
# pip byte-compiles nothing (--no-compile): a module's .pyc is written by the first process that imports it (every
# target below runs with PYTHONDONTWRITEBYTECODE unset), and the suite imports only ~2,600 of site-packages' ~6,000
# modules; compileall of all of them took 25 s of a 59 s set-up. What every rank, test worker and the tests' zygote
# import (torch, DTensor, FSDP2, torch._dynamo: 1,600 modules) is imported once here, while pip installs distcheck
# beside it (numpy kept out: pip may be writing it then), so that their .pyc files exist before the suite: the
# zygote and the 3 workers importing them at once took 23 s with no .pyc files, 9 s after that one import (13 s).
# The venv's own pip (23.2, from ensurepip) installs everything, so it is not upgraded first (5 s and a download).
# distcheck builds with the venv's setuptools and wheel (--no-build-isolation; pyproject.toml's build-system, put
# in first) instead of an isolated build env fetched every time (6 s).
$(STAMP): pyproject.toml setup.py distcheck/rank/_tracefast.c distcheck/contract/_frscan.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --no-compile "torch==$(TORCH_VERSION)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(RUN) $(PY) -W ignore -c '$(WARM_IMPORTS)' & warm=$$!; \
	$(PY) -m pip install --quiet --no-compile "setuptools>=64" wheel && \
	$(PY) -m pip install --quiet --no-compile --no-build-isolation -e ".[test]"; installed=$$?; \
	wait $$warm; exit $$installed
	touch $(STAMP)

check: $(STAMP)
	$(RUN) $(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC) -m distcheck consistency \
		--report-dir distcheck-report-check --timeout 120

# -n 3 on 2 cores: hang and timeout tests leave a core idle while they wait, a third worker fills it. worksteal:
# an idle worker takes tests queued on a busy one (plain load balancing left one worker idle for the last 80 s:
# 2:56 against 2:44 on the same tree).
test: $(STAMP)
	$(RUN) $(PY) -m pytest -n 3 --dist worksteal -q tests

test-unit: $(STAMP)
	$(RUN) $(PY) -m pytest -q tests/unit

bench: $(STAMP)
	$(PY) -m pip install --quiet --no-compile --no-build-isolation -e ".[test,bench]"
	$(RUN) $(PY) bench/run_all.py

soak: $(STAMP)
	$(RUN) $(PY) bench/soak.py

clean:
	rm -rf $(VENV) distcheck-report-* .pytest_cache build distcheck/rank/_tracefast*.so
