"""The private torch names elastic_ddp relies on (elastic_ddp/agent/rendezvous/torch_internals.py) exist
with the shapes used there. A torch upgrade that moves one fails here first, with its name."""

from __future__ import annotations

import inspect

from torch.distributed import HashStore
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

from elastic_ddp.agent.rendezvous import torch_internals
from elastic_ddp.agent.rendezvous.liveness import DeadNodeDetector
from elastic_ddp.agent.rendezvous.state_holder import ElasticStateHolder


def handler():
    store = HashStore()
    backend = C10dRendezvousBackend(store, "pinned")
    return create_handler(store, backend, RendezvousParameters("c10d", "127.0.0.1:1", "pinned", 1, 1)), backend, store


def test_the_state_holder_sanitizes_a_state_with_the_fields_the_probes_edit():
    assert callable(getattr(torch_internals.BackendStateHolder, "_sanitize", None))
    rendezvous, backend, _ = handler()
    holder = torch_internals.BackendStateHolder(backend, torch_internals.handler_settings(rendezvous))
    state = holder.state
    for name in ("participants", "wait_list", "redundancy_list", "last_heartbeats", "complete", "round", "deadline"):
        assert hasattr(state, name), name
    holder._sanitize()  # on an empty state: runs, changes nothing


def test_the_handler_exposes_its_node_settings_and_store_and_can_be_rebuilt_around_a_holder():
    rendezvous, backend, store = handler()
    node = torch_internals.handler_node(rendezvous)
    assert isinstance(node, torch_internals.NodeDesc) and {"addr", "pid", "local_id"} <= set(vars(node))
    assert torch_internals.handler_store(rendezvous) is store
    assert torch_internals.handler_settings(rendezvous).run_id == "pinned"
    holder = torch_internals.new_state_holder(ElasticStateHolder, backend, rendezvous, node=node,
                                              detector=DeadNodeDetector(store), beacon=None)
    rebuilt = torch_internals.with_state_holder(rendezvous, holder)
    assert rebuilt._state_holder is holder and rebuilt.get_run_id() == "pinned"


def test_the_participant_epilogue_takes_a_state_and_settings():
    assert list(inspect.signature(torch_internals._remove_participant_epilogue).parameters) == ["state", "settings"]


def test_the_state_holder_takes_a_cache_duration():
    assert "cache_duration" in inspect.signature(torch_internals.BackendStateHolder.__init__).parameters


def test_the_rendezvous_loop_sleeps_through_the_module_global_delay_and_polling_can_be_shortened(monkeypatch):
    import torch.distributed.elastic.rendezvous.dynamic_rendezvous as dynamic_rendezvous

    source = inspect.getsource(dynamic_rendezvous._DistributedRendezvousOpExecutor.run)
    assert f"_delay(seconds={torch_internals.SYNC_DELAY_S})" in source
    asked = []
    monkeypatch.setattr(dynamic_rendezvous, "_delay", asked.append)
    torch_internals.poll_rendezvous_every(0.1)
    torch_internals.poll_rendezvous_every(0.1)  # twice: still one level of wrapping
    dynamic_rendezvous._delay(seconds=1)  # as torch calls it
    dynamic_rendezvous._delay(seconds=(0, 0.3))
    assert asked == [0.1, (0, 0.3)]


def test_the_cheap_method_name_is_torchs_and_torch_records_events_through_the_module_global(monkeypatch):
    import torch.distributed.elastic.rendezvous.dynamic_rendezvous as dynamic_rendezvous

    torchs = torch_internals.TORCH_GET_METHOD_NAME  # (an earlier test's handler may have patched it already)
    assert torchs.__module__ == dynamic_rendezvous.__name__
    source = inspect.getsource(dynamic_rendezvous._DistributedRendezvousOpExecutor._record)
    assert "get_method_name()" in source  # looked up in the module at each call: the patch applies
    monkeypatch.setattr(dynamic_rendezvous, "get_method_name", torchs)

    def recorder(name_of):
        return name_of()  # depth 2 from name_of: the caller of `recorder`, as from torch's _record

    def some_rendezvous_action(name_of):
        return recorder(name_of)

    expected = some_rendezvous_action(torchs)
    torch_internals.name_methods_cheaply()
    assert dynamic_rendezvous.get_method_name is not torchs
    assert some_rendezvous_action(dynamic_rendezvous.get_method_name) == expected == "some_rendezvous_action"
    assert dynamic_rendezvous.get_method_name(depth=10_000) == torchs(depth=10_000) == "no_method_name"
