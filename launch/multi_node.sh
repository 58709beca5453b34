#!/usr/bin/env bash
# Pre-launch check across nodes with c10d rendezvous. Run the same command on every node:
#   NNODES=2 NPROC=8 RDZV_HOST=node0.example RDZV_PORT=29400 launch/multi_node.sh [distcheck consistency args...]
# Every node must use the same RDZV_HOST:RDZV_PORT (a host all nodes reach) and RDZV_ID.
set -euo pipefail
: "${NNODES:?set NNODES}" "${NPROC:?set NPROC (ranks per node)}" "${RDZV_HOST:?set RDZV_HOST}"
exec torchrun --nnodes "$NNODES" --nproc-per-node "$NPROC" \
  --rdzv-backend c10d --rdzv-endpoint "$RDZV_HOST:${RDZV_PORT:-29400}" --rdzv-id "${RDZV_ID:-distcheck}" \
  -m distcheck consistency --report-dir "${REPORT_DIR:-distcheck-report}" --timeout "${TIMEOUT:-300}" "$@"
