"""The test suite's rendezvous switches, unset by default (then nothing changes).

`ELASTIC_DDP_TEST_RDZV_ALGORITHM=keyed` adds `algorithm=keyed` to the `--rdzv_conf` of every agent
that `torchrun_command` builds (so every `LocalJob` and chaos plan) for the backends that have two
algorithms, `elastic-c10d` and `etcd-v3`, unless that conf names an algorithm already: the existing
cluster tests then run on the keyed rendezvous without editing them.

`ELASTIC_DDP_TEST_RDZV_BACKEND=elastic-c10d` runs the agents that asked for torch's own `c10d` on
`elastic-c10d` instead (the same TCPStore in the same place, `is_host` included): the chaos plans and
most cluster tests use torch's `c10d`, so with both switches they run on the keyed rendezvous too.
A node's own `agent_args` `--rdzv_conf` replaces the whole conf, switches included.
"""

from __future__ import annotations

import os

TEST_ALGORITHM_VARIABLE = "ELASTIC_DDP_TEST_RDZV_ALGORITHM"
TEST_BACKEND_VARIABLE = "ELASTIC_DDP_TEST_RDZV_BACKEND"
# Our backends with `--rdzv_conf algorithm=` (elastic_ddp.agent.rendezvous.plugin).
ALGORITHM_BACKENDS = ("elastic-c10d", "etcd-v3")
# What the backend switch may replace torch's `c10d` with (the same store, where it was).
BACKENDS_FOR_C10D = ("elastic-c10d",)


def switched_rendezvous(rdzv_backend: str, rdzv_conf: str | None) -> tuple[str, str | None]:
    """`rdzv_backend` and `rdzv_conf` as the switches make them (unchanged where unset); ValueError
    naming the variable for a backend switch it cannot honour."""
    backend = os.environ.get(TEST_BACKEND_VARIABLE, "").strip()
    if backend and backend not in BACKENDS_FOR_C10D:
        raise ValueError(f"{TEST_BACKEND_VARIABLE}: got {backend!r}; expected one of {', '.join(BACKENDS_FOR_C10D)}")
    if backend and rdzv_backend == "c10d":
        rdzv_backend = backend
    algorithm = os.environ.get(TEST_ALGORITHM_VARIABLE, "").strip()
    if not algorithm or rdzv_backend not in ALGORITHM_BACKENDS:
        return rdzv_backend, rdzv_conf
    if any(item.split("=", 1)[0].strip() == "algorithm" for item in (rdzv_conf or "").split(",")):
        return rdzv_backend, rdzv_conf
    return rdzv_backend, f"{rdzv_conf},algorithm={algorithm}" if rdzv_conf else f"algorithm={algorithm}"
