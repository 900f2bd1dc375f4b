"""Real torchrun agents on `--rdzv_conf ...,algorithm=keyed`, with etcd-v3 and with elastic-c10d: a kill
and a join.

Each node is a torchrun agent on 127.0.0.1 (elastic_ddp.testbed.local_cluster) training
`elastic_ddp.train` on a real etcd, or on a TCPStore that the test hosts; the job is held until
the scenario is done. Checks the exit codes, the final global step, that every sample of every
epoch was used exactly once, and that the last round record is the keyed rendezvous's.
"""

from __future__ import annotations

import pytest
from torch.distributed import TCPStore

from elastic_ddp import load_snapshot
from elastic_ddp.testbed.local_cluster import RDZV_CONF
from tests.support.cluster import assert_exactly_once, hold_settings, node_logs, release, world_reached

pytestmark = [pytest.mark.etcd, pytest.mark.slow, pytest.mark.timeout(300)]

BATCH, EPOCHS, DATASET = 64, 3, 4096
TRAINING_ARGS = ["--model", "mlp", "--epochs", str(EPOCHS), "--dataset_size", str(DATASET), "--global_batch_size",
                 str(BATCH), "--micro_batch_size", "16", "--snapshot_every_steps", "5", "--log_interval", "10"]


@pytest.mark.parametrize("backend", ["etcd-v3", "elastic-c10d"])
def test_keyed_rendezvous_survives_a_kill_and_takes_a_join_exactly_once(backend, local_jobs, request, tmp_path) -> None:
    if backend == "etcd-v3":
        server = request.getfixturevalue("etcd_server")
        endpoint = server.endpoint
    else:  # the store runs here, so that any node can be killed and the keys read afterwards
        server = TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, wait_for_workers=False)
        endpoint = f"127.0.0.1:{server.port}"
    job = local_jobs(TRAINING_ARGS, nproc_per_node=1, rdzv_backend=backend, rdzv_endpoint=endpoint,
                     run_id="keyed-e2e", agent_env={"OMP_NUM_THREADS": "1"},
                     rdzv_conf=f"{RDZV_CONF},algorithm=keyed", **hold_settings(tmp_path / "hold"))
    first = job.add_node("first")
    job.add_node("second")
    world_reached(job, 2)
    job.wait_for_step(job.last_step() + 5, timeout=90)
    first.kill()
    job.wait_for_event(lambda e: e["event"] == "restore" and e["world_size"] == 1, 120, "the job to go on in world 1")
    job.add_node("joiner")
    restore = job.wait_for_event(lambda e: e["event"] == "restore" and e["world_size"] == 2
                                 and e["previous_world_size"] == 1, 120, "the joiner in world 2")
    assert restore["global_step"] < EPOCHS * DATASET // BATCH, "joined too late to prove anything"
    release(tmp_path / "hold")
    exits = job.wait(timeout=180)
    assert exits["second"] == 0 and exits["joiner"] == 0, node_logs(job)
    if backend == "etcd-v3":
        record = server.etcdctl("get", "--print-value-only", "/elastic_ddp/rendezvous/keyed-e2e/keyed/record").stdout
    else:
        record = server.get(f"keyed/keyed-e2e/round/{int(server.get('keyed/keyed-e2e/latest'))}").decode()
    assert '"round": ' in record, "the nodes did not run the keyed rendezvous"
    assert load_snapshot(job.checkpoint_dir)["global_step"] == EPOCHS * DATASET // BATCH
    assert_exactly_once(job, DATASET, EPOCHS, BATCH)
