#!/usr/bin/env bash
# Run an elastic job of several "nodes" (torchrun agents) on this one machine, with the c10d
# rendezvous on 127.0.0.1. Arguments go to elastic_ddp.train.
#
#   NODES=2 NPROC_PER_NODE=1 bash launch/local_cluster.sh --epochs 3 --checkpoint_dir runs/local
#
# Each node logs to RUN_LOGS/nodeN.log [runs/local-logs]. While it runs, add a node from another
# shell with the same RDZV_ENDPOINT and RDZV_ID:
#   RDZV_ENDPOINT=127.0.0.1:29400 RDZV_ID=local bash launch/node.sh --epochs 3 --checkpoint_dir runs/local
# or kill one as a machine dies, the agent *and* its workers (they run in their own sessions):
#   agent=$(cat runs/local-logs/node1.pid); kill -KILL $(pgrep -P "$agent") "$agent"
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
nodes="${NODES:-2}"
logs="${RUN_LOGS:-runs/local-logs}"
export RDZV_ENDPOINT="${RDZV_ENDPOINT:-127.0.0.1:29400}"
export RDZV_ID="${RDZV_ID:-local}"
export NNODES="${NNODES:-1:4}"
if ! [[ "$nodes" =~ ^[1-9][0-9]*$ ]]; then
  echo "launch/local_cluster.sh: NODES: got '$nodes'; expected a positive integer" >&2; exit 2
fi
mkdir -p "$logs"
port="${RDZV_ENDPOINT##*:}"

pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; }
trap cleanup INT TERM

for ((i = 0; i < nodes; i++)); do
  bash "$here/node.sh" "$@" >"$logs/node$i.log" 2>&1 &
  pids+=($!)
  echo "$!" >"$logs/node$i.pid"  # the agent's pid (node.sh execs torchrun); its workers are its children
  if ((i == 0)); then
    # The first node hosts the c10d store: wait until it listens before the others dial in.
    for _ in $(seq 600); do
      (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
      kill -0 "${pids[0]}" 2>/dev/null || break
      sleep 0.1
    done
  fi
done
echo "local_cluster: $nodes nodes on $RDZV_ENDPOINT (logs in $logs); following node0:" >&2
tail -n +1 -f "$logs/node0.log" --pid="${pids[0]}" | grep --line-buffered -E "INFO|ERROR|WARNING" || true
# The job succeeded if a node finished it; nodes killed by a signal on purpose (exit > 128) do not
# make it fail, but any node that failed on its own does.
finished=0 failed=0
for pid in "${pids[@]}"; do
  code=0
  wait "$pid" || code=$?
  if ((code == 0)); then finished=1; elif ((code <= 128)); then failed=$code; fi
done
if ((failed)); then exit "$failed"; fi
((finished)) || { echo "local_cluster: no node finished the job (all were killed)" >&2; exit 1; }
