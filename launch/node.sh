#!/usr/bin/env bash
# Start this machine's torchrun agent for an elastic_ddp job. Run it on every node; arguments
# after the script name go to `python -m elastic_ddp.train` (see --help there).
#
#   RDZV_ENDPOINT=10.0.0.5:29400 RDZV_ID=job1 NNODES=1:4 NPROC_PER_NODE=2 \
#       bash launch/node.sh --epochs 10 --checkpoint_dir /shared/runs/job1
#   RDZV_BACKEND=etcd-v3 RDZV_ENDPOINT=etcd1:2379,etcd2:2379,etcd3:2379 RDZV_ID=job1 bash launch/node.sh ...
#
# Settings (environment variables, defaults in brackets):
#   NNODES          min:max nodes of the elastic job                 [1:4]
#   NPROC_PER_NODE  worker processes on this node (GPUs per node)    [1]
#   RDZV_BACKEND    elastic-c10d (torch's c10d with our additions), c10d or etcd-v3 [elastic-c10d]
#   RDZV_ENDPOINT   host:port (c10d) or comma-separated etcd members [127.0.0.1:29400]
#   RDZV_ID         job id, the same on every node                    [elastic-ddp]
#   MAX_RESTARTS    worker-group restarts before the agent gives up   [10]
#   RDZV_CONF       torchrun --rdzv_conf (timeouts, heartbeats, etcd TLS/auth keys)
#                   [the shipped timing, see docs/operations.md; for etcd-v3, append its keys]
#   MONITOR_INTERVAL seconds between the agent's worker checks        [0.1]
#   LAUNCHER        the agent program: torch.distributed.run (plain torchrun: with elastic-c10d or
#                   etcd-v3 its workers are forked warm by the warm-worker server that our
#                   rendezvous plugin starts, docs/operations.md "Warm workers") or
#                   elastic_ddp.agent.launcher (the same server for any backend and -m module; it
#                   runs c10d as elastic-c10d)                       [torch.distributed.run]
#   PYTHON          interpreter with elastic_ddp installed            [.venv/bin/python, else python3]
#   OMP_NUM_THREADS threads per worker                                 [1]
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$repo/.venv/bin/python" ]]; then PYTHON="$repo/.venv/bin/python"; else PYTHON=python3; fi
fi

# Keep these in step with elastic_ddp/agent/rendezvous/defaults.py (tests/cluster/test_launch_recipes.py checks).
DEFAULT_RDZV_CONF="join_timeout=300,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=5"
DEFAULT_MONITOR_INTERVAL=0.1
DEFAULT_LAUNCHER=torch.distributed.run

nnodes="${NNODES:-1:4}"
nproc="${NPROC_PER_NODE:-1}"
backend="${RDZV_BACKEND:-elastic-c10d}"
endpoint="${RDZV_ENDPOINT:-127.0.0.1:29400}"
run_id="${RDZV_ID:-elastic-ddp}"
max_restarts="${MAX_RESTARTS:-10}"
rdzv_conf="${RDZV_CONF:-$DEFAULT_RDZV_CONF}"
monitor_interval="${MONITOR_INTERVAL:-$DEFAULT_MONITOR_INTERVAL}"
launcher="${LAUNCHER:-$DEFAULT_LAUNCHER}"

case "$backend" in
  elastic-c10d|c10d|etcd-v3) ;;
  *) echo "launch/node.sh: RDZV_BACKEND: got '$backend'; expected elastic-c10d, c10d or etcd-v3" >&2; exit 2 ;;
esac
case "$launcher" in
  elastic_ddp.agent.launcher|torch.distributed.run) ;;
  *) echo "launch/node.sh: LAUNCHER: got '$launcher'; expected elastic_ddp.agent.launcher or torch.distributed.run" >&2; exit 2 ;;
esac
if ! [[ "$nnodes" =~ ^[0-9]+(:[0-9]+)?$ ]]; then
  echo "launch/node.sh: NNODES: got '$nnodes'; expected N or MIN:MAX, e.g. 1:4" >&2; exit 2
fi
if ! [[ "$nproc" =~ ^[1-9][0-9]*$ ]]; then
  echo "launch/node.sh: NPROC_PER_NODE: got '$nproc'; expected a positive integer" >&2; exit 2
fi

# The agent-shared TCPStore breaks restarts and joins (docs/failure-semantics.md).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

exec "$PYTHON" -m "$launcher" \
  --nnodes="$nnodes" --nproc_per_node="$nproc" \
  --rdzv_backend="$backend" --rdzv_endpoint="$endpoint" --rdzv_id="$run_id" \
  --rdzv_conf="$rdzv_conf" --max_restarts="$max_restarts" --monitor_interval="$monitor_interval" \
  -m elastic_ddp.train "$@"
