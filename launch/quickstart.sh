#!/usr/bin/env bash
# One command from a fresh clone to an elastic training run that survives a failure, on this machine:
# sets up .venv, then trains with three local "nodes" (torchrun agents on 127.0.0.1), SIGKILLs one
# mid-epoch (agent and workers, as a machine dies), starts a node again, and prints the run's report
# (world sizes, steps lost, seconds without training, the plot) and whether every sample was trained
# exactly once (elastic_ddp/tools/quickstart.py). About 20-40 s after the setup.
#
#   bash launch/quickstart.sh                # extra arguments go to elastic_ddp.train
#   bash launch/quickstart.sh --plain        # two local nodes, no failure (launch/local_cluster.sh)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/launch/setup.sh"
cd "$repo"
export PYTHON="$repo/.venv/bin/python"
# A new directory per run: a second run into a finished one would find nothing left to train.
run_dir="runs/quickstart-$(date +%Y%m%d-%H%M%S)"
if [[ "${1:-}" == "--plain" ]]; then
  shift
  export RDZV_ENDPOINT="${RDZV_ENDPOINT:-127.0.0.1:$("$PYTHON" -c 'from elastic_ddp.testbed.local_cluster import free_port; print(free_port())')}"
  # A --checkpoint_dir among your arguments comes later and wins.
  exec bash launch/local_cluster.sh --epochs 3 --checkpoint_dir "$run_dir" "$@"
fi
exec "$PYTHON" -m elastic_ddp.tools.quickstart "$run_dir" --epochs 3 "$@"
