"""The test suite's rendezvous switch, unset by default (then nothing changes).

`ELASTIC_DDP_TEST_RDZV_BACKEND=elastic-c10d` runs the agents that `torchrun_command` builds (so every
`LocalJob` and chaos plan) and that asked for torch's own `c10d` on `elastic-c10d` instead (the
same TCPStore in the same place, `is_host` included, with elastic_ddp's rendezvous). Most cluster
tests start their agents with `python -m elastic_ddp.agent.launcher`, which does this for `c10d`
anyway; the switch also covers the tests that run plain torchrun on `c10d`.
"""

from __future__ import annotations

import os

TEST_BACKEND_VARIABLE = "ELASTIC_DDP_TEST_RDZV_BACKEND"
# What the switch may replace torch's `c10d` with (the same store, where it was).
BACKENDS_FOR_C10D = ("elastic-c10d",)


def switched_backend(rdzv_backend: str) -> str:
    """`rdzv_backend` as the switch makes it (unchanged where unset); ValueError naming the variable
    for a value it cannot honour."""
    backend = os.environ.get(TEST_BACKEND_VARIABLE, "").strip()
    if backend and backend not in BACKENDS_FOR_C10D:
        raise ValueError(f"{TEST_BACKEND_VARIABLE}: got {backend!r}; expected one of {', '.join(BACKENDS_FOR_C10D)}")
    return backend if backend and rdzv_backend == "c10d" else rdzv_backend
