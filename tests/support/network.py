"""Jobs whose nodes are hosts of their own: a network namespace and an address each
(elastic_ddp/testbed/netns.py), for the network fault tests.

Two things a user has to give by hand today (issue 26, item 2), given here on purpose: this
machine's host name resolves to 127.0.0.1, so torch does not see that the first node holds the
endpoint's address (`--rdzv_conf ...,is_host=1` on it: without it no node hosts the store and every
agent times out after 60 s), and gloo would advertise that loopback address to its peers
(`GLOO_SOCKET_IFNAME=eth0`, the one link of every node: without it every worker group fails its
full-mesh connect, "Connection refused, remote=[127.0.0.1]").
"""

from __future__ import annotations

import pytest

from elastic_ddp.agent.rendezvous.defaults import RDZV_CONF
from elastic_ddp.testbed.local_cluster import STOCK_LAUNCHER, LocalJob, wait_for
from elastic_ddp.testbed.netns import NODE_LINK, NetworkBed
from tests.support.cluster import hold_settings

RDZV_PORT = 29400

@pytest.fixture
def network_bed():
    """Factory of opened `NetworkBed`s, each closed at the end whatever happened (a SIGTERM to the
    test run meanwhile raises SystemExit while a bed is open: elastic_ddp/testbed/netns.py)."""
    beds: list[NetworkBed] = []

    def make(nodes) -> NetworkBed:
        bed = NetworkBed(nodes)
        beds.append(bed)
        return bed.open()

    try:
        yield make
    finally:
        for bed in beds:
            bed.close()

def start_job(local_jobs, bed: NetworkBed, hold, args, nodes: list[str], nnodes: str,
              **job_options) -> LocalJob:
    """A held elastic-c10d job of one agent per namespace; the first node hosts the store."""
    held = hold_settings(hold)
    endpoint = f"{bed.address(nodes[0])}:{RDZV_PORT}"
    job = local_jobs(args, nnodes=nnodes, rdzv_backend="elastic-c10d", rdzv_endpoint=endpoint,
                     launcher=STOCK_LAUNCHER, module=held["module"],
                     env={**held["env"], "GLOO_SOCKET_IFNAME": NODE_LINK}, **job_options)
    for index, node in enumerate(nodes):
        host_options = [f"--rdzv_conf={RDZV_CONF},is_host=1"] if index == 0 else []
        job.add_node(node, hosts_store=False, local_addr=bed.address(node), command_prefix=bed.prefix(node),
                     agent_args=host_options)
        if index == 0:
            # Asked from a node: the host's own namespace may answer for any address (tests' sandboxes do).
            wait_for(lambda: bed.connects(nodes[-1], bed.address(nodes[0]), RDZV_PORT)
                     or not job.nodes[0].is_running(), 60, f"the c10d store of {nodes[0]} on {endpoint}")
    return job
