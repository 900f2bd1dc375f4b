"""The test suite's rendezvous-algorithm switch (elastic_ddp/testbed/rdzv_switch.py) in the agents'
argv that `torchrun_command` builds: unset, nothing changes (our backends run their default, the keyed
rendezvous); `dynamic` (or `keyed`), our two backends get it; anything else is refused."""

from __future__ import annotations

import pytest

from elastic_ddp.agent.rendezvous.defaults import RDZV_CONF
from elastic_ddp.testbed.local_cluster import torchrun_command
from elastic_ddp.testbed.rdzv_switch import TEST_ALGORITHM_VARIABLE, TEST_BACKEND_VARIABLE

pytestmark = pytest.mark.timeout(30)


def rdzv_options(rdzv_backend: str, **kwargs) -> list[str]:
    command = torchrun_command(nnodes="1:2", nproc_per_node=1, rdzv_endpoint="127.0.0.1:1", rdzv_id="run",
                               rdzv_backend=rdzv_backend, **kwargs)
    return [option for option in command if option.startswith(("--rdzv_conf", "--rdzv_backend"))]


def rdzv_conf_options(rdzv_backend: str, **kwargs) -> list[str]:
    return [option for option in rdzv_options(rdzv_backend, **kwargs) if option.startswith("--rdzv_conf")]


@pytest.mark.parametrize("backend", ["c10d", "elastic-c10d", "etcd-v3"])
def test_unset_the_switch_changes_nothing(monkeypatch, backend):
    monkeypatch.delenv(TEST_ALGORITHM_VARIABLE, raising=False)
    monkeypatch.delenv(TEST_BACKEND_VARIABLE, raising=False)
    assert f"--rdzv_backend={backend}" in rdzv_options(backend)
    assert rdzv_conf_options(backend) == [f"--rdzv_conf={RDZV_CONF}"]
    assert rdzv_conf_options(backend, rdzv_conf=None) == []


@pytest.mark.parametrize("backend", ["elastic-c10d", "etcd-v3"])
@pytest.mark.parametrize("algorithm", ["dynamic", "keyed"])
def test_the_switch_adds_the_algorithm_to_our_backends(monkeypatch, backend, algorithm):
    monkeypatch.delenv(TEST_BACKEND_VARIABLE, raising=False)
    monkeypatch.setenv(TEST_ALGORITHM_VARIABLE, algorithm)
    assert rdzv_conf_options(backend) == [f"--rdzv_conf={RDZV_CONF},algorithm={algorithm}"]
    assert rdzv_conf_options(backend, rdzv_conf=None) == [f"--rdzv_conf=algorithm={algorithm}"]
    # A conf that names its algorithm keeps it (tests of one algorithm stay what they are).
    assert rdzv_conf_options(backend, rdzv_conf="a=1,algorithm=other") == ["--rdzv_conf=a=1,algorithm=other"]


def test_an_algorithm_the_backends_do_not_have_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv(TEST_ALGORITHM_VARIABLE, "fancy")
    with pytest.raises(ValueError, match=rf"{TEST_ALGORITHM_VARIABLE}: got 'fancy'; expected one of keyed, dynamic"):
        rdzv_options("etcd-v3")


@pytest.mark.parametrize("backend", ["c10d", "etcd"])
def test_the_switch_leaves_torchs_own_backends_alone(monkeypatch, backend):
    monkeypatch.delenv(TEST_BACKEND_VARIABLE, raising=False)
    monkeypatch.setenv(TEST_ALGORITHM_VARIABLE, "dynamic")
    assert rdzv_conf_options(backend) == [f"--rdzv_conf={RDZV_CONF}"]


def test_the_backend_switch_runs_torchs_c10d_jobs_on_elastic_c10d(monkeypatch):
    monkeypatch.setenv(TEST_BACKEND_VARIABLE, "elastic-c10d")
    monkeypatch.setenv(TEST_ALGORITHM_VARIABLE, "dynamic")
    assert rdzv_options("c10d") == ["--rdzv_backend=elastic-c10d", f"--rdzv_conf={RDZV_CONF},algorithm=dynamic"]
    assert rdzv_options("etcd") == ["--rdzv_backend=etcd", f"--rdzv_conf={RDZV_CONF}"]
    monkeypatch.setenv(TEST_BACKEND_VARIABLE, "etcd-v3")  # no store where c10d's was: refused, naming the variable
    with pytest.raises(ValueError, match=TEST_BACKEND_VARIABLE):
        rdzv_options("c10d")
