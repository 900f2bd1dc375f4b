"""The test suite's rendezvous switch (elastic_ddp/testbed/rdzv_switch.py) in the agents' argv that
`torchrun_command` builds: unset, nothing changes; `elastic-c10d`, agents that asked for torch's
`c10d` get it instead, and nothing else; anything else is refused."""

from __future__ import annotations

import pytest

from elastic_ddp.agent.rendezvous.defaults import RDZV_CONF
from elastic_ddp.testbed.local_cluster import torchrun_command
from elastic_ddp.testbed.rdzv_switch import TEST_BACKEND_VARIABLE

pytestmark = pytest.mark.timeout(30)


def rdzv_options(rdzv_backend: str, **kwargs) -> list[str]:
    command = torchrun_command(nnodes="1:2", nproc_per_node=1, rdzv_endpoint="127.0.0.1:1", rdzv_id="run",
                               rdzv_backend=rdzv_backend, **kwargs)
    return [option for option in command if option.startswith(("--rdzv_conf", "--rdzv_backend"))]


@pytest.mark.parametrize("backend", ["c10d", "elastic-c10d", "etcd-v3"])
def test_unset_the_switch_changes_nothing(monkeypatch, backend):
    monkeypatch.delenv(TEST_BACKEND_VARIABLE, raising=False)
    assert rdzv_options(backend) == [f"--rdzv_backend={backend}", f"--rdzv_conf={RDZV_CONF}"]
    assert rdzv_options(backend, rdzv_conf=None) == [f"--rdzv_backend={backend}"]


def test_the_switch_runs_torchs_c10d_jobs_on_elastic_c10d(monkeypatch):
    monkeypatch.setenv(TEST_BACKEND_VARIABLE, "elastic-c10d")
    assert rdzv_options("c10d") == ["--rdzv_backend=elastic-c10d", f"--rdzv_conf={RDZV_CONF}"]
    assert rdzv_options("etcd") == ["--rdzv_backend=etcd", f"--rdzv_conf={RDZV_CONF}"]
    assert rdzv_options("etcd-v3") == ["--rdzv_backend=etcd-v3", f"--rdzv_conf={RDZV_CONF}"]
    monkeypatch.setenv(TEST_BACKEND_VARIABLE, "etcd-v3")  # no store where c10d's was: refused, naming the variable
    with pytest.raises(ValueError, match=TEST_BACKEND_VARIABLE):
        rdzv_options("c10d")
