#!/usr/bin/env bash
# Pre-launch check on one node: every local GPU (or N CPU ranks) runs distcheck consistency.
#   launch/single_node.sh [NPROC] [extra distcheck consistency args...]
#   launch/single_node.sh 8 --model my_pkg.model:build --parallel fsdp
set -euo pipefail
NPROC=${1:-$(python -c 'import torch; print(max(torch.cuda.device_count(), 2))')}
shift || true
exec torchrun --standalone --nproc-per-node "$NPROC" -m distcheck consistency --report-dir "${REPORT_DIR:-distcheck-report}" "$@"
