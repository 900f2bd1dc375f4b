"""The test suite's rendezvous-algorithm switch, unset by default (then nothing changes).

`ELASTIC_DDP_TEST_RDZV_ALGORITHM=keyed` adds `algorithm=keyed` to the `--rdzv_conf` of every agent
that `torchrun_command` builds (so every `LocalJob` and chaos plan) for the backends that have two
algorithms, `elastic-c10d` and `etcd-v3`, unless that conf names an algorithm already: the existing
cluster tests and chaos plans then run on the keyed rendezvous without editing them. torch's own
`c10d` and `etcd` backends are left as they are. A node's own `agent_args` `--rdzv_conf` replaces the
whole conf, switch included.
"""

from __future__ import annotations

import os

TEST_ALGORITHM_VARIABLE = "ELASTIC_DDP_TEST_RDZV_ALGORITHM"
# Our backends with `--rdzv_conf algorithm=` (elastic_ddp.agent.rendezvous.plugin).
ALGORITHM_BACKENDS = ("elastic-c10d", "etcd-v3")


def with_test_algorithm(rdzv_backend: str, rdzv_conf: str | None) -> str | None:
    """`rdzv_conf` with `algorithm=<the switch>` where the switch is set, `rdzv_backend` has two
    algorithms and `rdzv_conf` names none; otherwise `rdzv_conf` unchanged."""
    algorithm = os.environ.get(TEST_ALGORITHM_VARIABLE, "").strip()
    if not algorithm or rdzv_backend not in ALGORITHM_BACKENDS:
        return rdzv_conf
    if any(item.split("=", 1)[0].strip() == "algorithm" for item in (rdzv_conf or "").split(",")):
        return rdzv_conf
    return f"{rdzv_conf},algorithm={algorithm}" if rdzv_conf else f"algorithm={algorithm}"
