#!/usr/bin/env bash
# The CUDA checks, on a machine with a GPU (CI has none; every test in tests/cuda skips there):
#
#   bash tests/run_cuda.sh                   # unit suite + tests/cuda, then cluster tests with every
#                                            # node's workers on the GPU (gloo: several ranks per GPU)
#   bash tests/run_cuda.sh tests/cuda        # only these (any pytest arguments)
#   PYTHON=python3 bash tests/run_cuda.sh    # an interpreter that already has a CUDA torch and the
#                                            # test extra; otherwise .venv is set up by launch/setup.sh
#                                            # (install your CUDA torch build into .venv first)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
    bash "$repo/launch/setup.sh"
    PYTHON="$repo/.venv/bin/python"
fi
cd "$repo"
"$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else
    f'tests/run_cuda.sh: torch {torch.__version__} sees no CUDA GPU here; expected a GPU machine')"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
if [[ $# -gt 0 ]]; then
    exec "$PYTHON" -m pytest -p no:cacheprovider -ra "$@"
fi
"$PYTHON" -m pytest -p no:cacheprovider -ra tests/unit tests/cuda
# Nodes on 127.0.0.1 sharing the one GPU: kills, a join, a frozen node, zero loss, sharded (FSDP2) chaos.
ELASTIC_DDP_TEST_TRAINING_ARGS="--device cuda --dist_backend gloo" "$PYTHON" -m pytest -p no:cacheprovider -ra \
    "tests/cluster/test_own_loop.py::test_a_node_lost_and_one_joining_mid_epoch_cost_the_users_loop_no_step_and_no_sample[ddp-c10d]" \
    "tests/cluster/test_frozen_peers.py::test_plain_torchrun_with_torchs_c10d_leaves_a_frozen_node_behind" \
    "tests/cluster/test_zero_loss.py::test_a_lost_node_a_join_and_a_worker_killed_inside_a_step_cost_no_committed_step" \
    "tests/cluster/test_sharded_cluster.py" \
    "tests/cluster/test_replication.py::test_a_sharded_job_without_shared_storage_survives_losing_rank_0s_node"
