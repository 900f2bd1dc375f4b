#!/usr/bin/env bash
# One command from a fresh clone to the whole test suite: sets up .venv, then runs pytest.
#
#   bash tests/run.sh                  # everything (about 15 minutes on 2 cores, plus the set-up)
#   bash tests/run.sh tests/unit       # the unit tests: one process, no servers (seconds)
#   bash tests/run.sh -m "not slow"    # the same selection by marker
#   ELASTIC_DDP_TEST_RDZV_BACKEND=elastic-c10d bash tests/run.sh tests/cluster/test_chaos.py
#                                      # the testbed's agents on torch's c10d run elastic-c10d
#                                      # (elastic_ddp/testbed/rdzv_switch.py; unset: each test's own)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/launch/setup.sh"
cd "$repo"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# torch's TCPStore looks a name up on every connection, and a resolver that drops a query makes
# glibc wait 5 s before it asks again (this sandbox's drops about one in 25: the board contract
# suite took 18.7 s, 6.8 s with a 1 s wait). The same two tries, the same answers, shorter waits.
export RES_OPTIONS="${RES_OPTIONS:-timeout:1}"
exec "$repo/.venv/bin/python" -m pytest -p no:cacheprovider -ra "$@"
