"""`python -m elastic_ddp.chaos.held_train`: `elastic_ddp.train`, held at a slow pace until released.

    ELASTIC_DDP_HOLD=/tmp/x/hold python -m elastic_ddp.chaos.held_train --epochs 3 ...

While the file named by ELASTIC_DDP_HOLD exists, every optimizer step of every rank ends with a
sleep of HELD_STEP_S: the job keeps training (its collectives keep running, so failures are seen
at once) but cannot finish before a scenario of faults (kills, joins, freezes) has happened,
however fast the machine. Whoever plays the scenario (the chaos harness's `on_plan_done`, a test)
deletes the file once it is done, and the job runs to its end at full speed. Trainers got 10x
faster once and rehearsals sized for the old speed broke; holding the job makes them independent
of it.

A hold file that says `pause_at=N` also stops every rank after step N, until the file changes or
the worker gets SIGTERM (torchrun stopping the group for a join must not wait): a scenario that
takes long (a join) then happens mid-epoch.

Being an `elastic_ddp.` module, it gets what `-m elastic_ddp.train` gets from the plugin (a store
of its own for every worker group with torch's c10d; elastic_ddp/agent/rendezvous/plugin.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from elastic_ddp import train
from elastic_ddp.runtime.distributed import exit_worker

HOLD_VARIABLE = "ELASTIC_DDP_HOLD"
HELD_STEP_S = 0.05
PAUSE_POLL_S = 0.01


def pause_step(hold: str) -> float:
    """The step the hold file pauses at (`pause_at=N`); infinity when it pauses nowhere."""
    try:
        text = Path(hold).read_text()
    except FileNotFoundError:
        return float("inf")
    return int(text.removeprefix("pause_at=")) if text.startswith("pause_at=") else float("inf")


def held(after_step: Callable | None = None, hold: str | None = None) -> Callable:
    """An `after_step` hook that holds the job as the module docstring says, after `after_step`."""
    hold = hold if hold is not None else os.environ.get(HOLD_VARIABLE)

    def hook(trainer) -> None:
        if after_step is not None:
            after_step(trainer)
        while hold and not trainer.drain.requested and trainer.global_step >= pause_step(hold):
            time.sleep(PAUSE_POLL_S)
        if hold and os.path.exists(hold):
            time.sleep(HELD_STEP_S)

    return hook


def main() -> int:
    return train.main(after_step=held())


if __name__ == "__main__":
    exit_worker(main())
