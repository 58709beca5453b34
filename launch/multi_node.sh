#!/usr/bin/env bash
# distcheck across nodes with c10d rendezvous. Run the same command on every node:
#   NNODES=2 NPROC=8 RDZV_HOST=node0.example RDZV_PORT=29400 launch/multi_node.sh [distcheck consistency args...]
#   NNODES=2 NPROC=8 RDZV_HOST=node0.example CMD=run launch/multi_node.sh -- train.py --lr 0.1
# Every node must use the same RDZV_HOST:RDZV_PORT (a host all nodes reach) and RDZV_ID. REPORT_DIR may be
# node-local: the node watchers exchange their summaries through torchrun's rendezvous store, the node of global
# rank 0 writes the one report there, and every other node prints one line saying where it is.
set -euo pipefail
: "${NNODES:?set NNODES}" "${NPROC:?set NPROC (ranks per node)}" "${RDZV_HOST:?set RDZV_HOST}"
exec torchrun --nnodes "$NNODES" --nproc-per-node "$NPROC" \
  --rdzv-backend c10d --rdzv-endpoint "$RDZV_HOST:${RDZV_PORT:-29400}" --rdzv-id "${RDZV_ID:-distcheck}" \
  -m distcheck "${CMD:-consistency}" --report-dir "${REPORT_DIR:-distcheck-report}" --timeout "${TIMEOUT:-300}" "$@"
