"""`exit_worker`: the exit code and everything logged or printed arrive; no teardown runs."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import atexit, logging, sys
    from elastic_ddp.runtime.distributed import exit_worker
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(message)s")
    atexit.register(lambda: print("teardown ran", flush=True))
    print("printed before the exit")          # block-buffered: stdout is a pipe
    logging.getLogger("worker").info("logged before the exit")
    exit_worker(int(sys.argv[1]))
    print("after exit_worker")
""")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("code", [0, 75])
def test_the_exit_code_and_buffered_output_arrive_and_teardown_is_skipped(code):
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(code)], capture_output=True, text=True, timeout=50)
    assert done.returncode == code
    assert done.stdout == "printed before the exit\n"  # flushed; neither atexit nor later code ran
    assert "logged before the exit" in done.stderr


@pytest.mark.timeout(60)
def test_in_a_multiprocessing_child_it_raises_system_exit_for_the_caller_to_see():
    # torchrun's wrapper in a forked worker (elastic_ddp.agent.launcher) must see SystemExit(0) to put its
    # return value; os._exit there would leave the agent waiting for it forever.
    child = multiprocessing.get_context("spawn").Process(target=_raises_system_exit, args=(4,))
    child.start()
    child.join(timeout=50)
    assert child.exitcode == 0, "exit_worker did not raise SystemExit(4) in a multiprocessing child"


def _raises_system_exit(code: int) -> None:
    from elastic_ddp.runtime.distributed import exit_worker

    try:
        exit_worker(code)
    except SystemExit as raised:
        if raised.code == code:
            return
    raise AssertionError("exit_worker neither raised SystemExit nor ended the process")


@pytest.mark.timeout(60)
def test_a_kept_object_outlives_every_reference_of_its_own():
    import gc
    import weakref

    from elastic_ddp.runtime.distributed import keep_until_exit

    class Model:
        pass

    model = Model()
    alive = weakref.ref(model)
    keep_until_exit(model)
    del model
    gc.collect()
    assert alive() is not None, "freed while Python runs: the gloo deadlock keep_until_exit exists for"
