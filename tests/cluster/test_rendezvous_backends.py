"""What our backends add to torch's rendezvous, through the handler torchrun's registry builds for
elastic-c10d (our rendezvous), and what the plugin leaves alone: prompt completion, a last
call that still applies without it, a live node waited for, and torch's default for the shared
store untouched in agents that do not run our trainer.

Handlers run in this process on a real TCPStore (one thread per "agent"); the plugin tests start a
fresh interpreter, since torch reads the entry points once per process. The same promises of our
rendezvous, one rule or one board at a time: tests/unit/test_rendezvous_rounds.py,
tests/unit/test_rendezvous_c10d.py, tests/cluster/test_rendezvous_handler.py and
tests/cluster/test_rendezvous_torch_cases.py.
"""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters, RendezvousTimeoutError
from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as registry

from elastic_ddp.agent.rendezvous.boards.c10d import BACKEND_NAME
from elastic_ddp.agent.rendezvous.defaults import SHARED_STORE_OPT_OUT
from elastic_ddp.agent.rendezvous.plugin import trains_with_elastic_ddp
from elastic_ddp.testbed.local_cluster import free_port
from tests.support.rendezvous import rendezvous_together

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def store_port():
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    yield port
    del server


def handler(port: int, run_id: str, min_nodes: int = 1, max_nodes: int = 3, **conf):
    """An elastic-c10d handler as torchrun's registry builds it, a client of the test's store."""
    return registry.create_handler(RendezvousParameters(BACKEND_NAME, f"127.0.0.1:{port}", run_id, min_nodes,
                                                        max_nodes, local_addr="127.0.0.1", is_host="0", **conf))


def exit_agent(node) -> None:
    """What a SIGKILL does to an agent, as the others see it: no more heartbeats, its beacon refuses."""
    node._board._stop.set()
    node._witness.close()


def leave(handlers) -> None:
    """End the handlers' heartbeats without closing the run (`shutdown` would close it for all)."""
    for each in handlers:
        each._board.leave()


def test_a_round_after_a_failure_completes_when_every_live_node_is_back_not_after_the_last_call(store_port):
    """Round 0 forms with three nodes; one exits; the two others rejoin. The last call is 60 s and
    the join timeout 20 s: only prompt completion can form round 1 in time."""
    conf = {"last_call_timeout": "60", "join_timeout": "20"}
    nodes = [handler(store_port, "prompt", max_nodes=3, **conf) for _ in range(3)]
    assert [info.world_size for info in rendezvous_together(nodes)] == [3, 3, 3]
    gone = nodes.pop()
    exit_agent(gone)
    second = rendezvous_together(nodes)
    assert [getattr(info, "world_size", info) for info in second] == [2, 2]
    leave(nodes)


def test_without_prompt_completion_the_last_call_applies(store_port):
    conf = {"last_call_timeout": "60", "join_timeout": "3", "prompt_completion": "0"}
    nodes = [handler(store_port, "no-prompt", max_nodes=3, **conf) for _ in range(3)]
    # The first round waits for its last call as well: three nodes at max_nodes complete it at once.
    assert [info.world_size for info in rendezvous_together(nodes)] == [3, 3, 3]
    gone = nodes.pop()
    exit_agent(gone)
    second = rendezvous_together(nodes)
    assert all(isinstance(result, RendezvousTimeoutError) for result in second), second
    leave(nodes)


def test_a_node_that_has_not_come_back_is_waited_for(store_port):
    """One survivor rejoins, the other still trains as far as anyone knows (its heartbeat is fresh,
    its beacon answers): no prompt completion; the last call (60 s) outlasts the join timeout."""
    conf = {"last_call_timeout": "60", "join_timeout": "3"}
    nodes = [handler(store_port, "waits", max_nodes=3, **conf) for _ in range(3)]
    assert [info.world_size for info in rendezvous_together(nodes)] == [3, 3, 3]
    with pytest.raises(RendezvousTimeoutError):
        nodes[0].next_rendezvous()
    leave(nodes)


OWN_LOOP_SCRIPT = str(Path(__file__).resolve().parents[2] / "docs" / "examples" / "gpt_own_loop.py")


@pytest.mark.parametrize("argv, ours", [
    (["--nnodes=1:4", "--rdzv_backend=c10d", "-m", "elastic_ddp.train", "--epochs", "1"], True),
    (["--nnodes", "2", "--module", "elastic_ddp.chaos.held_train"], True),
    (["--nnodes=1:4", "--rdzv_backend=c10d", OWN_LOOP_SCRIPT, "--epochs", "1"], True),
    (["--nnodes=1:4", "--no-python", OWN_LOOP_SCRIPT], False),
    (["--nnodes=1:4", "train.py", "--model", "elastic_ddp.x"], False),  # (no such file)
    (["--nnodes=1:4", "-m", "my_project.train"], False),
    (["-q", "tests/unit"], False),
])
def test_the_plugin_recognises_our_trainer_in_torchrun_arguments(argv, ours):
    assert trains_with_elastic_ddp(argv) is ours


def test_a_script_counts_as_ours_only_when_a_line_imports_elastic_ddp(tmp_path):
    script = tmp_path / "train.py"
    for text, ours in [("import torch\nfrom elastic_ddp import ElasticRun\n", True), ("import elastic_ddp\n", True),
                       ("  import elastic_ddp.train as t\n", True), ("# see elastic_ddp\nimport elastic_ddpx\n", False),
                       ("\xff\xfe binary", False)]:
        script.write_text(text, encoding="latin-1")
        assert trains_with_elastic_ddp(["--nnodes=1:2", str(script)]) is ours, text


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


def test_the_torchrun_console_script_gives_our_trainers_workers_their_own_store():
    """The `torchrun` command imports torch.distributed.run, whose import loads the plugins: the
    plugin then cannot import torchrun's own parser (half imported) and decides by its arguments."""
    console_script = ("import os, sys; sys.argv = {argv!r}\n"
                      "from torch.distributed.run import main\n"  # what the console script does first
                      f"print(os.environ.get({SHARED_STORE_OPT_OUT!r}, 'unset'))\n")
    for argv, expected in [(["--rdzv_backend=c10d", "-m", "elastic_ddp.train", "--epochs", "1"], "1"),
                           (["--rdzv_backend=c10d", "--nnodes", "2", OWN_LOOP_SCRIPT], "1"),
                           (["--rdzv_backend=c10d", "--no-python", OWN_LOOP_SCRIPT], "unset"),
                           (["--rdzv_backend=c10d", "-m", "my_project.train"], "unset")]:
        result = subprocess.run([sys.executable, "-c", console_script.format(argv=["torchrun", *argv])], check=False,
                                capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == expected, (argv, result.stdout, result.stderr[-2000:])


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
