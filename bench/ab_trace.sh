#!/usr/bin/env bash
# What the tracer costs in this tree (A) against another commit (B), taken in turn in one run, so that both see the
# same machine: bench_trace.py's fake-process-group figure, A B A B A; where a GPU is, the NCCL all_reduce too.
#
#     bench/ab_trace.sh HEAD~1                 # here, with .venv/bin/python
#     bench/ab_trace.sh HEAD~1 python3         # on a GPU machine, with its own torch
#
# B is a copy of that commit (git archive) in a temporary folder with its C path built there. Each side runs from its
# own folder: `python -m distcheck`, which bench_trace.py and the ranks use, imports distcheck from the working
# directory before PYTHONPATH and before an editable install. It needs git and this repository's history.
set -euo pipefail
case ${1:-} in
    -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    "") echo "usage: bench/ab_trace.sh REV [PYTHON]   (REV: the commit to compare this tree with, e.g. HEAD~1)" >&2
        exit 2 ;;
esac
rev=$1
git rev-parse --verify -q "$rev^{commit}" >/dev/null \
    || { echo "bench/ab_trace.sh: $rev is not a commit here (name one: HEAD~1, a hash, a tag)" >&2; exit 2; }
py=${2:-.venv/bin/python}
case $py in  # an absolute path that keeps a venv's link (realpath would resolve it to the base interpreter)
    */*) py=$(cd "$(dirname "$py")" 2>/dev/null && pwd)/$(basename "$py") && [ -x "$py" ] ;;
    *) py=$(command -v "$py") ;;
esac || { echo "bench/ab_trace.sh: no python ${2:-.venv/bin/python} (name one: bench/ab_trace.sh REV PYTHON)" >&2
          exit 2; }
A=$PWD
B=$(mktemp -d /tmp/distcheck-ab.XXXXXX)
trap 'rm -rf "$B"' EXIT
git archive "$rev" distcheck bench setup.py pyproject.toml | tar -x -C "$B"
for side in "$A" "$B"; do (cd "$side" && "$py" setup.py -q build_ext --inplace >/dev/null 2>&1) || true; done
for v in A B A B A; do
    echo "== $v ($([ $v = A ] && git rev-parse --short HEAD || git rev-parse --short "$rev"))"
    (cd "${!v}" && PYTHONPATH="${!v}" timeout 300 "$py" bench/bench_trace.py --fake-only --pairs 2 | tail -n +2)
done
if "$py" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    for v in A B A B; do
        echo "== NCCL all_reduce, $v"
        (cd "${!v}/bench" && PYTHONPATH="${!v}" timeout 120 "$py" -c \
            "import bench_gpu as b; b._init(); print(b.tracer_cost())")
    done
fi
