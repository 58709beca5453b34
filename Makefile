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
STAMP := $(VENV)/.installed-$(TORCH_VERSION)

.PHONY: setup check test test-unit bench soak clean

setup: $(STAMP)

# torch goes in first, pinned, so that the unpinned "torch" in pyproject.toml is already satisfied and pip never
# pulls a multi-GB CUDA build onto a CPU machine. The editable install also compiles the tracer's C hot path
# (setup.py, optional: without a C compiler the tracer takes its Python path); a changed .c file re-runs it.
# pip byte-compiles what it installs on one core; compileall does it on every core (torch and its dependencies:
# 45 s for pip's way, 15 + 18 s this way on 2 cores). Its exit status is ignored, as pip ignores the same errors:
# torch ships a Python 3.12-only test file. The .pyc files matter: every rank imports torch.
$(STAMP): pyproject.toml setup.py distcheck/rank/_tracefast.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-compile "torch==$(TORCH_VERSION)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install --quiet --no-compile -e ".[test]"
	$(PY) -m compileall -q -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" \
		> /dev/null 2>&1 || true
	touch $(STAMP)

check: $(STAMP)
	$(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC) -m distcheck consistency --report-dir distcheck-report-check --timeout 120

# -n 3 on 2 cores: hang and timeout tests leave a core idle while they wait, a third worker fills it. worksteal:
# an idle worker takes tests queued on a busy one (plain load balancing left one worker idle for the last 80 s:
# 2:56 against 2:44 on the same tree). Ranks write .pyc files (PYTHONDONTWRITEBYTECODE unset) so the hundreds of
# rank processes do not recompile distcheck each.
test: $(STAMP)
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -n 3 --dist worksteal -q tests

test-unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

bench: $(STAMP)
	$(PY) -m pip install --quiet -e ".[test,bench]"
	$(PY) bench/run_all.py

soak: $(STAMP)
	$(PY) bench/soak.py

clean:
	rm -rf $(VENV) distcheck-report-* .pytest_cache build distcheck/rank/_tracefast*.so
