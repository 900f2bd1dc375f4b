#!/usr/bin/env bash
# One command from a fresh clone to an elastic training run on this machine:
# sets up .venv, then trains with two local "nodes" on a c10d rendezvous on 127.0.0.1.
#
#   bash launch/quickstart.sh                # extra arguments go to elastic_ddp.train
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/launch/setup.sh"
cd "$repo"
export PYTHON="$repo/.venv/bin/python"
export RDZV_ENDPOINT="${RDZV_ENDPOINT:-127.0.0.1:$("$PYTHON" -c 'from elastic_ddp.testbed.local_cluster import free_port; print(free_port())')}"
# A new directory per run: a second run into a finished one would find nothing left to train, and
# its first node would finish and close the job before the second one joined (that one then fails).
# A --checkpoint_dir among your arguments comes later and wins.
exec bash launch/local_cluster.sh --epochs 3 --checkpoint_dir "runs/quickstart-$(date +%Y%m%d-%H%M%S)" "$@"
