"""`python -m elastic_ddp.train` for tests: held at a slow pace until the test releases it.

    ELASTIC_DDP_TEST_HOLD=/tmp/x/hold python -m tests.support.held_train --epochs 3 ...

While the file named by ELASTIC_DDP_TEST_HOLD exists, every optimizer step of every rank ends with
a sleep of HELD_STEP_S: the job keeps training (its collectives keep running, so failures are seen
at once) but cannot finish before the test's scenario (kills, joins, freezes) has happened,
however fast the machine. The test deletes the file once the scenario is done, and the job runs
to its end at full speed. Trainers got 10x faster once and tests sized for the old speed broke;
holding the job makes them independent of it.
"""

from __future__ import annotations

import os
import time

from elastic_ddp import train
from elastic_ddp.distributed import exit_worker

HOLD_VARIABLE = "ELASTIC_DDP_TEST_HOLD"
HELD_STEP_S = 0.05


def main() -> int:
    hold = os.environ.get(HOLD_VARIABLE)

    def after_step(trainer) -> None:
        if hold and os.path.exists(hold):
            time.sleep(HELD_STEP_S)

    return train.main(after_step=after_step)


if __name__ == "__main__":
    exit_worker(main())
