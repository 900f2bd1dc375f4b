"""The test suite's rendezvous switches, unset by default (then nothing changes).

Our backends with two algorithms, `elastic-c10d` and `etcd-v3`, run the keyed rendezvous by default
(elastic_ddp.agent.rendezvous.plugin), so the cluster tests do too. `ELASTIC_DDP_TEST_RDZV_ALGORITHM=dynamic`
adds `algorithm=dynamic` to the `--rdzv_conf` of every agent that `torchrun_command` builds (so every
`LocalJob` and chaos plan) for those backends, unless that conf names an algorithm already: the
cluster tests then run on torch's dynamic rendezvous (kept for one release) without editing them.
`keyed` is accepted too (it adds `algorithm=keyed`, the default spelled out).

`ELASTIC_DDP_TEST_RDZV_BACKEND=elastic-c10d` runs the agents that asked for torch's own `c10d` on
`elastic-c10d` instead (the same TCPStore in the same place, `is_host` included). Most cluster
tests start their agents with `python -m elastic_ddp.agent.launcher`, which does this for `c10d`
anyway; the switch also covers the tests that run plain torchrun on `c10d`.
A node's own `agent_args` `--rdzv_conf` replaces the whole conf, switches included.
"""

from __future__ import annotations

import os

from elastic_ddp.agent.rendezvous.plugin import ALGORITHM_KEY, ALGORITHMS

TEST_ALGORITHM_VARIABLE = "ELASTIC_DDP_TEST_RDZV_ALGORITHM"
TEST_BACKEND_VARIABLE = "ELASTIC_DDP_TEST_RDZV_BACKEND"
# Our backends with `--rdzv_conf algorithm=` (elastic_ddp.agent.rendezvous.plugin).
ALGORITHM_BACKENDS = ("elastic-c10d", "etcd-v3")
# What the backend switch may replace torch's `c10d` with (the same store, where it was).
BACKENDS_FOR_C10D = ("elastic-c10d",)


def switched_rendezvous(rdzv_backend: str, rdzv_conf: str | None) -> tuple[str, str | None]:
    """`rdzv_backend` and `rdzv_conf` as the switches make them (unchanged where unset); ValueError
    naming the variable for a value it cannot honour."""
    backend = os.environ.get(TEST_BACKEND_VARIABLE, "").strip()
    if backend and backend not in BACKENDS_FOR_C10D:
        raise ValueError(f"{TEST_BACKEND_VARIABLE}: got {backend!r}; expected one of {', '.join(BACKENDS_FOR_C10D)}")
    if backend and rdzv_backend == "c10d":
        rdzv_backend = backend
    algorithm = os.environ.get(TEST_ALGORITHM_VARIABLE, "").strip()
    if algorithm and algorithm not in ALGORITHMS:
        raise ValueError(f"{TEST_ALGORITHM_VARIABLE}: got {algorithm!r}; expected one of {', '.join(ALGORITHMS)} "
                         f"(unset: the default, {ALGORITHMS[0]})")
    if not algorithm or rdzv_backend not in ALGORITHM_BACKENDS:
        return rdzv_backend, rdzv_conf
    if any(item.split("=", 1)[0].strip() == ALGORITHM_KEY for item in (rdzv_conf or "").split(",")):
        return rdzv_backend, rdzv_conf
    setting = f"{ALGORITHM_KEY}={algorithm}"
    return rdzv_backend, f"{rdzv_conf},{setting}" if rdzv_conf else setting
