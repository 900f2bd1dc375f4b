"""Import torch._dynamo in the background while a cold worker starts.

torch.optim imports torch._dynamo at the first optimizer call and at every `step`
(`torch/optim/optimizer.py`: `_disable_dynamo`, `_use_grad_for_differentiable`), even when nothing
is compiled: 1.4-1.8 s of a cold worker's start after a failure or a join, on the critical path
(docs/failure-semantics.md, "Recovery speed"). `start_prefetching_dynamo` starts that import on a
daemon thread as soon as the worker has imported torch, so that it runs while the main thread
waits for its peers in `init_process_group` and for the restore; when the optimizer needs the
module, it waits for the import in progress (Python's per-module import locks) or finds it done.

Workers forked warm by the agent's warm-worker server have torch._dynamo already (the server
imported it): nothing to do there. A failure of the background import is ignored: the optimizer's own
import then runs as it would have.
"""

from __future__ import annotations

import importlib
import sys
import threading

MODULE = "torch._dynamo"


def start_prefetching_dynamo() -> threading.Thread | None:
    """Start importing torch._dynamo on a daemon thread; None when it is imported already."""
    if MODULE in sys.modules:
        return None
    thread = threading.Thread(target=_import_quietly, name="elastic-ddp-prefetch", daemon=True)
    thread.start()
    return thread


def _import_quietly() -> None:
    try:
        importlib.import_module(MODULE)
    except Exception:  # noqa: BLE001 - the optimizer's own import will raise it where it matters
        pass
