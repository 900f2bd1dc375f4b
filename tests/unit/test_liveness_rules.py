"""The `probe_dead_nodes` switch of the dead-node probes (the probes themselves: tests/cluster/test_liveness.py)."""

from __future__ import annotations

import pytest
from torch.distributed.elastic.rendezvous import (
    RendezvousParameters,
)

from elastic_ddp.agent.rendezvous.liveness import (
    probes_enabled,
)

pytestmark = pytest.mark.timeout(60)


def test_probes_are_on_unless_turned_off_and_a_bad_value_is_named():
    def params(**config):
        return RendezvousParameters("c10d", "127.0.0.1:1", "r", 1, 1, **config)

    assert probes_enabled(params()) and probes_enabled(params(probe_dead_nodes="1"))
    assert not probes_enabled(params(probe_dead_nodes="0"))
    with pytest.raises(ValueError, match=r"--rdzv_conf probe_dead_nodes: got 'maybe'; expected 1 or 0"):
        probes_enabled(params(probe_dead_nodes="maybe"))
