"""How torchrun finds etcd-v3 and what the handler it builds does, against a real etcd.

The registration tests start a fresh interpreter: the entry point is read when torch's
rendezvous package is first imported. They need elastic_ddp installed in the venv
(`pip install -e . --no-deps`), as the setup scripts do.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from typing import TYPE_CHECKING, Any

import pytest
from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousConnectionError, RendezvousParameters
from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as registry

from elastic_ddp.agent.rendezvous import EtcdUnavailableError, create_etcd_v3_handler
from elastic_ddp.agent.rendezvous.defaults import SHARED_STORE_OPT_OUT
from elastic_ddp.testbed.local_cluster import free_port

if TYPE_CHECKING:
    from elastic_ddp.testbed.etcd_server import EtcdServer

pytestmark = pytest.mark.timeout(60)

FAST_RDZV = {"join_timeout": "30", "last_call_timeout": "1", "keep_alive_interval": "1",
             "keep_alive_max_attempt": "5"}


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", **env})


def params(endpoint: str, run_id: str = "run", min_nodes: int = 1, max_nodes: int = 1, **conf: Any
           ) -> RendezvousParameters:
    return RendezvousParameters("etcd-v3", endpoint, run_id, min_nodes, max_nodes, **conf)


def test_fresh_interpreter_registers_etcd_v3_and_loads_etcd3_only_when_used() -> None:
    result = run_python(
        "import os, sys\n"
        "import torch.distributed.elastic.rendezvous\n"
        "from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as registry\n"
        "print('etcd-v3' in registry._registry, 'elastic-c10d' in registry._registry, 'etcd3' in sys.modules)\n"
        "import elastic_ddp.agent.rendezvous\n"
        "print('etcd3' in sys.modules)\n"
        "import elastic_ddp.agent.rendezvous.etcd.client\n"
        "from google.protobuf.internal import api_implementation\n"
        "print(api_implementation.Type(), os.environ.get('PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION'))\n")
    assert result.returncode == 0, result.stderr
    registered, registered_c10d, loaded_by_plugin, loaded_by_package, implementation, leaked = result.stdout.split()
    assert registered == registered_c10d == "True"
    assert loaded_by_plugin == "False", "loading the plugin must not import the etcd client"
    assert loaded_by_package == "False", "importing the rendezvous package must not import the etcd client"
    assert implementation == "python", "etcd3 needs the pure-Python protobuf"
    assert leaked == "None", "the workers must not inherit PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"


def test_protobuf_loaded_first_gives_a_clear_import_error() -> None:
    result = run_python("from google.protobuf import descriptor_pb2\nimport elastic_ddp.agent.rendezvous.etcd.client\n")
    assert result.returncode != 0
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("ImportError:") and "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python" in last_line


@pytest.mark.etcd
def test_registry_builds_a_handler_that_never_shares_the_agent_store(
        shared_etcd_server: EtcdServer, run_id: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(SHARED_STORE_OPT_OUT, "0")
    with caplog.at_level(logging.WARNING):
        handler = registry.create_handler(params(shared_etcd_server.endpoint, run_id))
    assert handler.get_backend() == "etcd-v3"
    assert handler.use_agent_store is False
    assert f"{SHARED_STORE_OPT_OUT}=0 is ignored" in caplog.text


@pytest.mark.etcd
def test_single_node_rendezvous_gives_rank_zero_and_its_own_address(shared_etcd_server: EtcdServer,
                                                                   run_id: str) -> None:
    handler = create_etcd_v3_handler(params(shared_etcd_server.endpoint, run_id, local_addr="127.0.0.1",
                                                  **FAST_RDZV))
    info = handler.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)
    # Workers start their own TCPStore at the address rank 0's agent published, not the agent's.
    assert info.bootstrap_store_info.master_addr == "127.0.0.1"
    assert handler.num_nodes_waiting() == 0
    assert handler.shutdown()
    assert handler.is_closed()


@pytest.mark.etcd
def test_two_nodes_meet_and_agree_on_the_workers_master(shared_etcd_server: EtcdServer, run_id: str) -> None:
    handlers = [create_etcd_v3_handler(params(shared_etcd_server.endpoint, run_id, 2, 2,
                                                    local_addr=f"127.0.0.{i + 1}", **FAST_RDZV))
                for i in range(2)]
    infos: dict[int, Any] = {}
    threads = [threading.Thread(target=lambda i=i: infos.__setitem__(i, handlers[i].next_rendezvous()))
               for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=45)
    assert sorted(info.rank for info in infos.values()) == [0, 1]
    masters = {(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port) for i in infos.values()}
    rank0 = next(index for index, info in infos.items() if info.rank == 0)
    assert masters == {(f"127.0.0.{rank0 + 1}", next(iter(masters))[1])}
    for handler in handlers:
        handler.shutdown()


@pytest.mark.etcd
def test_a_finished_run_id_stays_closed_until_its_keys_are_deleted(shared_etcd_server: EtcdServer, run_id: str) -> None:
    """As docs/etcd.md says: reuse a run id only after `etcdctl del --prefix <key_prefix>/<run_id>/`."""

    def handler() -> Any:
        return create_etcd_v3_handler(params(shared_etcd_server.endpoint, run_id, local_addr="127.0.0.1",
                                                   **FAST_RDZV))

    finished = handler()
    finished.next_rendezvous()
    finished.set_closed()
    finished.shutdown()
    with pytest.raises(RendezvousClosedError):
        handler().next_rendezvous()
    shared_etcd_server.etcdctl("del", "--prefix", f"/elastic_ddp/rendezvous/{run_id}/")
    relaunched = handler()
    assert relaunched.next_rendezvous().rank == 0
    relaunched.shutdown()


@pytest.mark.timeout(30)
def test_unreachable_etcd_at_start_names_every_endpoint_and_the_last_error() -> None:
    endpoints = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    with pytest.raises(EtcdUnavailableError) as raised:
        create_etcd_v3_handler(params(",".join(endpoints), retry_timeout="1"))
    message = str(raised.value)
    assert all(endpoint in message for endpoint in endpoints)
    assert "Connection refused" in message and "retry_timeout=1s" in message
    assert isinstance(raised.value, RendezvousConnectionError)


# --- --rdzv_conf validation: no etcd needed, every message names the key, value and the rule ---

