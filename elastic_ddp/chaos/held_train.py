"""`python -m elastic_ddp.chaos.held_train`: `elastic_ddp.train`, held until released.

    ELASTIC_DDP_HOLD=/tmp/x/hold python -m elastic_ddp.chaos.held_train --epochs 3 ...

While the file named by ELASTIC_DDP_HOLD exists, the job cannot finish before a scenario of faults
(kills, joins, freezes) has happened, however fast the machine. Whoever plays the scenario (the
chaos harness, a test) deletes the file once it is done (`release`), and the job runs to its end
at full speed. What the file says decides how it holds:

- empty: every optimizer step of every rank ends with a sleep of HELD_STEP_S, so the job keeps
  training (its collectives keep running, so failures are seen at once) at a slow pace;
- `pause_at=N` (`pause_at`): the same pace, and every rank stops after step N until the file
  changes, the worker gets SIGTERM (torchrun stopping the group for a join must not wait) or its
  agent took a new round in process (the group re-forms for a join), so that a scenario that
  takes long (a join) happens mid-epoch;
- `run_to=N` (`run_to`): full speed up to step N, then the same stop: for a player that knows
  the step of its next fault (the chaos harness), no step is slowed down.

Being an `elastic_ddp.` module, it gets what `-m elastic_ddp.train` gets from the plugin (a store
of its own for every worker group with torch's c10d; elastic_ddp/agent/rendezvous/plugin.py).
"""

from __future__ import annotations

if __name__ == "__main__":
    # Before any other import, as in elastic_ddp.train: run warm under torchrun with our rendezvous.
    from elastic_ddp.handoff.warm_client import become_warm_worker

    become_warm_worker("elastic_ddp.chaos.held_train")

import os
import time
from collections.abc import Callable
from pathlib import Path

from elastic_ddp import train
from elastic_ddp.runtime.distributed import exit_worker

HOLD_VARIABLE = "ELASTIC_DDP_HOLD"
HELD_STEP_S = 0.05
PAUSE_POLL_S = 0.01
PAUSED_PACE, FULL_SPEED = "pause_at=", "run_to="


def read_hold(hold: str | Path) -> tuple[bool, float]:
    """What the hold file says: whether steps sleep HELD_STEP_S, and the step the job stops after
    (infinity: nowhere); (False, infinity) once it is gone."""
    try:
        text = Path(hold).read_text()
    except FileNotFoundError:
        return False, float("inf")
    for prefix, paced in ((PAUSED_PACE, True), (FULL_SPEED, False)):
        if text.startswith(prefix):
            return paced, int(text.removeprefix(prefix))
    return True, float("inf")


def _write_hold(hold: str | Path, text: str) -> None:
    temporary = Path(f"{hold}.tmp")
    temporary.write_text(text)
    os.replace(temporary, hold)  # the ranks never read half a line


def pace(hold: str | Path) -> None:
    """Hold at the slow pace, stopping nowhere."""
    _write_hold(hold, "")


def pause_at(hold: str | Path, step: int) -> None:
    """Hold at the slow pace, and stop every rank after `step` until the file changes."""
    _write_hold(hold, f"{PAUSED_PACE}{step}")


def run_to(hold: str | Path, step: int) -> None:
    """Train at full speed up to `step`, then stop every rank there until the file changes."""
    _write_hold(hold, f"{FULL_SPEED}{step}")


def release(hold: str | Path) -> None:
    """Let a held job run to its end at full speed."""
    try:
        os.unlink(hold)
    except FileNotFoundError:
        pass


def held(after_step: Callable | None = None, hold: str | None = None) -> Callable:
    """An `after_step` hook that holds the job as the module docstring says, after `after_step`."""
    hold = hold if hold is not None else os.environ.get(HOLD_VARIABLE)

    def hook(trainer) -> None:
        if after_step is not None:
            after_step(trainer)
        if not hold:
            return
        paced, stop_after = read_hold(hold)
        if trainer.global_step >= stop_after:
            trainer.run.wait_until_counted()  # the step stopped after is reported while the job waits
        # SIGTERM (torchrun restarts the group) or a round the agent took in process (a join the
        # workers take without a restart) ends a stop: the group must change before it goes on.
        while not trainer.run.drain.requested and not trainer.run.regroup.replaced() \
                and trainer.global_step >= stop_after:
            time.sleep(PAUSE_POLL_S)
            paced, stop_after = read_hold(hold)
        if paced:
            time.sleep(HELD_STEP_S)

    return hook


def main() -> int:
    return train.main(after_step=held())


if __name__ == "__main__":
    exit_worker(main())
