"""`python -m elastic_ddp.handoff.warm_start MODULE ARGS...`: `python -m MODULE ARGS...`, forked warm when it can be.

`python -m elastic_ddp.agent.launcher` has torchrun start each worker this way in place of `python -m
MODULE ARGS...`, so that any module's workers start warm, not only those whose first lines call
`warm_client.become_warm_worker` themselves (`warm_client.WARM_MODULES`). With plain torchrun and our
backends, `-m elastic_ddp.handoff.warm_start my_project.train ARGS...` does the same for a module of yours.

This process hands MODULE and its arguments to the agent's warm-worker server
(`warm_client.become_warm_worker`), which forks the worker from its warm state; when no server
answers, it runs MODULE cold itself, in this process. Either way MODULE sees what `python -m MODULE
ARGS...` gives it: `__name__ == "__main__"` and `sys.argv == [MODULE's file, *ARGS]` (runpy).

Not guaranteed: while MODULE runs, `sys.modules["__main__"]` is runpy's temporary module, and a
traceback that ends a cold run shows runpy's frames first.

Torch-free, and it imports nothing of elastic_ddp but warm_client: the client pays for every import
at every worker start.
"""

from __future__ import annotations

import runpy
import sys

from elastic_ddp.handoff.warm_client import become_warm_worker

USAGE = "usage: python -m elastic_ddp.handoff.warm_start MODULE [ARGS...]"


def main(argv: list[str]) -> None:
    """Run the module `argv[0]` with the arguments `argv[1:]`, warm or cold (see the module docstring)."""
    if not argv:
        raise SystemExit(USAGE)
    module, *arguments = argv
    sys.argv = [sys.argv[0], *arguments]  # runpy puts MODULE's file in argv[0], here or in the server's child
    become_warm_worker(module)  # returns only when the run stays in this process
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
