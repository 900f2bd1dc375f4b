"""Issue 26, item 2: addresses on several hosts, with the README's flags alone.

Three nodes, each a host of its own (a network namespace with its own address on a bridge:
elastic_ddp/testbed/netns.py), plain torchrun with `--rdzv_backend=elastic-c10d
--rdzv_endpoint=<n0's address>:29400 --local_addr=<own address>`. This machine's host name resolves
to 127.0.0.1 in every namespace, so stock torch makes no node host the store (every agent times
out after 60 s) and gloo advertises 127.0.0.1 to its peers. No `is_host`, no `GLOO_SOCKET_IFNAME`
here: elastic_ddp/agent/rendezvous/addresses.py.

    .venv/bin/python -m pytest tests/cluster/test_network_addresses.py -q -s
"""

from __future__ import annotations

import time

import pytest

from elastic_ddp.agent.rendezvous.defaults import RDZV_CONF
from elastic_ddp.testbed.local_cluster import LAUNCHER, STOCK_LAUNCHER, wait_for
from elastic_ddp.testbed.netns import NetworkFault, why_unavailable
from tests.support.cluster import assert_exactly_once, node_logs, release, world_reached
from tests.support.network import RDZV_PORT, start_job

UNAVAILABLE = why_unavailable()
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no network namespaces: {UNAVAILABLE}")

# How long a node may take to say what is wrong with its addresses, from its agent's start
# (torchrun's own start-up and torch's import take 2-4 s here).
SAYS_SO_WITHIN_S = 15


@pytest.fixture(autouse=True)
def _nothing_by_hand(monkeypatch):
    """The nodes inherit this environment: no interface named by hand."""
    for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(variable, raising=False)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


@pytest.mark.timeout(240)
@pytest.mark.parametrize("launcher", [STOCK_LAUNCHER, LAUNCHER])
def test_three_hosts_train_with_the_readme_flags_alone(local_jobs, network_bed, tmp_path, launcher):
    """n0 hosts the store because its eth0 holds the endpoint's address, and every node's workers
    use eth0 for gloo (each is needed for a world of three to form), which trains to the end,
    exactly once."""
    nodes = ["n0", "n1", "n2"]
    bed = network_bed(nodes)
    hold = tmp_path / "hold"
    dataset_size, epochs, batch = 768, 4, 48
    args = ["--model", "mlp", "--epochs", str(epochs), "--dataset_size", str(dataset_size),
            "--global_batch_size", str(batch), "--snapshot_every_steps", "20", "--log_interval", "10"]
    job = start_job(local_jobs, bed, hold, args, nodes, nnodes="3:3", launcher=launcher)
    try:
        world_reached(job, 3)
        job.wait_for_step(job.last_step() + 3, 30)
    finally:
        release(hold)
    codes = job.wait(120)
    assert codes == {"n0": 0, "n1": 0, "n2": 0}, f"{codes}\n{node_logs(job)}"
    assert_exactly_once(job, dataset_size, epochs, batch)


@pytest.mark.timeout(60)
def test_a_node_that_would_publish_loopback_says_so_at_once(local_jobs, network_bed, tmp_path):
    """n1 started without --local_addr would publish its host name, which resolves to 127.0.0.1:
    it stops within seconds, its last line naming the --local_addr to pass (its own address)."""
    bed = network_bed(["n0", "n1"])
    job = local_jobs(["--model", "mlp"], nnodes="1:2", rdzv_backend="elastic-c10d",
                     rdzv_endpoint=f"{bed.address('n0')}:{RDZV_PORT}", launcher=STOCK_LAUNCHER)
    started = time.monotonic()
    node = job.add_node("n1", hosts_store=False, command_prefix=bed.prefix("n1"))
    code = node.wait(SAYS_SO_WITHIN_S)
    took = time.monotonic() - started
    line = _last_line(node.log_text())
    print(f"a node publishing loopback stopped {took:.1f} s after its start: {line}")
    assert code != 0, node.log_text()
    assert "a loopback address" in line and f"--local_addr={bed.address('n1')}" in line, node.log_text()


@pytest.mark.timeout(90)
def test_a_node_that_cannot_reach_the_endpoint_says_so_within_seconds(local_jobs, network_bed, tmp_path):
    """The endpoint's node is cut off: n1 warns in one line within seconds, naming the endpoint,
    and stops with one line naming it once `read_timeout` has passed (not torch's traceback)."""
    bed = network_bed(["n0", "n1"])
    bed.apply(NetworkFault.parse("partition n0"))
    endpoint = f"{bed.address('n0')}:{RDZV_PORT}"
    read_timeout_s = 5  # the first probe gives up after 2 s (c10d.store.PROBE_TIMEOUT_S): the warning comes first
    job = local_jobs(["--model", "mlp"], nnodes="1:2", rdzv_backend="elastic-c10d", rdzv_endpoint=endpoint,
                     launcher=STOCK_LAUNCHER, rdzv_conf=f"{RDZV_CONF},read_timeout={read_timeout_s}")
    started = time.monotonic()
    node = job.add_node("n1", hosts_store=False, local_addr=bed.address("n1"), command_prefix=bed.prefix("n1"))
    said = f"cannot reach the rendezvous endpoint --rdzv_endpoint={endpoint}"
    wait_for(lambda: said in node.log_text(), SAYS_SO_WITHIN_S, "n1's line naming the unreachable endpoint",
             still_possible=lambda: None if node.is_running() else f"n1 exited: {node.log_text()[-3000:]}")
    warned_s = time.monotonic() - started
    code = node.wait(read_timeout_s + SAYS_SO_WITHIN_S)
    stopped_s = time.monotonic() - started
    line = _last_line(node.log_text())
    print(f"unreachable endpoint: warned {warned_s:.1f} s after the agent's start, stopped after {stopped_s:.1f} s: "
          f"{line}")
    assert code != 0, node.log_text()
    assert said in line, node.log_text()
