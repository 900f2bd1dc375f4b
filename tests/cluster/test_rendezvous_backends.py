"""What our backends add to torch's rendezvous (elastic_ddp/agent/rendezvous/handler.py), and what the
plugin leaves alone: shipped timing that a user's value overrides, prompt completion, a last call
that arrivals restart, faster polling, and torch's default for the shared store untouched in agents that do not run our trainer.

Handlers run in this process on a real TCPStore (one thread per "agent"); the plugin tests start a
fresh interpreter, since torch reads the entry points once per process. The handlers here are
`--rdzv_conf algorithm=dynamic` (torch's dynamic rendezvous with our additions, kept for one release;
they read its internals); the keyed rendezvous, the default, has the same promises tested in
tests/unit/test_keyed_rounds.py, tests/unit/test_keyed_c10d.py and tests/cluster/test_keyed_*.py.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import threading
from datetime import datetime, timedelta, timezone

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters, RendezvousTimeoutError
from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as registry
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

from elastic_ddp.agent.rendezvous.c10d import BACKEND_NAME
from elastic_ddp.agent.rendezvous.defaults import SHARED_STORE_OPT_OUT, SHIPPED_RDZV_DEFAULTS
from elastic_ddp.agent.rendezvous.plugin import trains_with_elastic_ddp
from elastic_ddp.testbed.local_cluster import free_port, wait_for
from tests.support.rendezvous import rendezvous_together

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def store_port():
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    yield port
    del server


def handler(port: int, run_id: str, min_nodes: int = 1, max_nodes: int = 3, **conf):
    return registry.create_handler(RendezvousParameters(BACKEND_NAME, f"127.0.0.1:{port}", run_id, min_nodes,
                                                        max_nodes, **{"algorithm": "dynamic", **conf}))


def stop(handlers) -> None:
    for each in handlers:
        each._stop_heartbeats()


def test_the_shipped_timing_fills_what_the_user_left_out_and_a_user_value_wins(store_port):
    mine = handler(store_port, "timing", last_call_timeout="7", keep_alive_max_attempt="9")
    settings = mine._settings
    assert settings.timeout.last_call == timedelta(seconds=7)  # the user's
    assert settings.keep_alive_max_attempt == 9  # the user's
    assert settings.keep_alive_interval == timedelta(seconds=SHIPPED_RDZV_DEFAULTS["keep_alive_interval"])
    assert settings.timeout.join == timedelta(seconds=SHIPPED_RDZV_DEFAULTS["join_timeout"])
    assert settings.timeout.close == timedelta(seconds=30)  # torch's own: no close_timeout is shipped


def test_a_round_after_a_failure_completes_when_every_live_node_is_back_not_after_the_last_call(store_port):
    """Round 1 forms with three nodes; one exits; the two others rejoin. The last call is 60 s and
    the join timeout 20 s: only prompt completion can form round 2 in time."""
    conf = {"last_call_timeout": "60", "join_timeout": "20"}
    nodes = [handler(store_port, "prompt", max_nodes=3, **conf) for _ in range(3)]
    assert [info.world_size for info in rendezvous_together(nodes)] == [3, 3, 3]
    gone = nodes.pop()
    gone._stop_heartbeats()
    gone._state_holder._beacon.close()  # its agent "exits": the kernel refuses its port from now on
    second = rendezvous_together(nodes)
    assert [getattr(info, "world_size", info) for info in second] == [2, 2]
    stop(nodes)


def test_without_prompt_completion_the_last_call_applies(store_port):
    conf = {"last_call_timeout": "60", "join_timeout": "3", "prompt_completion": "0"}
    nodes = [handler(store_port, "no-prompt", max_nodes=3, **conf) for _ in range(3)]
    # The first round waits for its last call as well: three nodes at max_nodes complete it at once.
    assert [info.world_size for info in rendezvous_together(nodes)] == [3, 3, 3]
    gone = nodes.pop()
    gone._stop_heartbeats()
    gone._state_holder._beacon.close()
    second = rendezvous_together(nodes)
    assert all(isinstance(result, RendezvousTimeoutError) for result in second), second
    stop(nodes)


def test_a_node_that_has_not_come_back_is_waited_for(store_port):
    """One survivor rejoins, the other still trains as far as anyone knows (its heartbeat is fresh,
    its beacon answers): no prompt completion; the last call (60 s) outlasts the join timeout."""
    conf = {"last_call_timeout": "60", "join_timeout": "3"}
    nodes = [handler(store_port, "waits", max_nodes=3, **conf) for _ in range(3)]
    assert [info.world_size for info in rendezvous_together(nodes)] == [3, 3, 3]
    with pytest.raises(RendezvousTimeoutError):
        nodes[0].next_rendezvous()
    stop(nodes)


def rendezvous_state(handler):
    """The rendezvous state as the backend holds it now (not the handler's cached copy); torch's
    empty state before anyone wrote one."""
    response = handler._state_holder._backend.get_state()
    return pickle.loads(response[0]) if response is not None else _RendezvousState()


def enter_in_background(handler) -> threading.Thread:
    thread = threading.Thread(target=handler.next_rendezvous, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("extend", ["1", "0"])
def test_a_node_arriving_during_the_last_call_restarts_it_unless_switched_off(store_port, extend):
    """A reaches min_nodes (1) and starts a 60 s last call; B arrives during it. With the switch on
    B's joining write moves the deadline to 60 s after B's arrival; off, it stays A's (torch's
    behaviour). A third node (max_nodes) then completes the round at once either way."""
    conf = {"last_call_timeout": "60", "join_timeout": "30", "extend_last_call": extend}
    nodes = [handler(store_port, f"extends-{extend}", max_nodes=3, **conf) for _ in range(3)]
    a, b, c = nodes
    threads = [enter_in_background(a)]
    wait_for(lambda: rendezvous_state(a).deadline is not None, 20, "A's round to start its last call")
    first_deadline = rendezvous_state(a).deadline
    b_arrives = datetime.now(timezone.utc)
    threads.append(enter_in_background(b))
    wait_for(lambda: len(rendezvous_state(a).participants) == 2, 20, "B to join the round")
    deadline = rendezvous_state(a).deadline
    if extend == "1":
        assert deadline >= b_arrives + timedelta(seconds=60) and deadline > first_deadline
    else:
        assert deadline == first_deadline
    assert c.next_rendezvous().world_size == 3  # max_nodes: complete without the last call
    for thread in threads:
        thread.join(timeout=20)
    assert not any(thread.is_alive() for thread in threads)
    stop(nodes)


def test_a_bad_extend_last_call_value_is_refused_naming_the_key(store_port):
    with pytest.raises(ValueError, match="--rdzv_conf extend_last_call: got 'maybe'"):
        handler(store_port, "bad-extend", extend_last_call="maybe")


@pytest.mark.parametrize("argv, ours", [
    (["--nnodes=1:4", "--rdzv_backend=c10d", "-m", "elastic_ddp.train", "--epochs", "1"], True),
    (["--nnodes", "2", "--module", "elastic_ddp.chaos.held_train"], True),
    (["--nnodes=1:4", "train.py", "--model", "elastic_ddp.x"], False),
    (["--nnodes=1:4", "-m", "my_project.train"], False),
    (["-q", "tests/unit"], False),
])
def test_the_plugin_recognises_our_trainer_in_torchrun_arguments(argv, ours):
    assert trains_with_elastic_ddp(argv) is ours


def fresh_interpreter(argv: list[str]) -> str:
    """SHARED_STORE_OPT_OUT after torch's registry loaded the plugins, in a new interpreter whose
    sys.argv is `argv` (as torchrun's would be), and whether torch's c10d handler shares its store."""
    code = (f"import sys; sys.argv = {['torchrun', *argv]!r}\n"
            "import os\n"
            "from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as registry\n"
            "assert 'elastic-c10d' in registry._registry and 'etcd-v3' in registry._registry\n"
            f"print(os.environ.get({SHARED_STORE_OPT_OUT!r}, 'unset'))\n")
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60,
                            env={"PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_torchs_shared_store_default_is_untouched_unless_our_trainer_runs():
    """torch's own test_use_agent_store_is_true_by_default failed once the plugin set the variable
    at load; now only an agent that runs our trainer gets it."""
    assert fresh_interpreter(["--rdzv_backend=c10d", "-m", "my_project.train"]) == "unset"
    assert fresh_interpreter(["--rdzv_backend=c10d", "train.py"]) == "unset"
    assert fresh_interpreter(["--rdzv_backend=c10d", "-m", "elastic_ddp.train", "--epochs", "1"]) == "1"


def test_torchs_c10d_handler_shares_its_store_by_default_with_the_plugin_installed(store_port):
    """torch's own assertion (test_use_agent_store_is_true_by_default), with our plugin loaded."""
    code = (f"from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry as r\n"
            f"h = r.create_handler(RendezvousParameters('c10d', '127.0.0.1:{store_port}', 'torch', 1, 1))\n"
            "print(h.use_agent_store)\n")
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60,
                            env={"PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"
