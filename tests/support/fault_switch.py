"""`python -m tests.support.fault_switch`: the held trainer (elastic_ddp.chaos.held_train) with a
test-only fault switch that makes a worker SIGKILL itself at a precise moment of a step, which a
kill from outside can only hit by chance:

    ELASTIC_DDP_TEST_FAULT=rank=3,step=30,at=allreduce,once=/tmp/x/fired

- `at=allreduce`: rank 3 dies inside DDP's gradient all-reduce of step 30, before it sends its
  gradients (a DDP comm hook): the other ranks are inside the all-reduce and cannot finish it;
- `at=after_allreduce`: rank 3 dies after the all-reduce of step 30 has finished everywhere and
  before it applies the step itself (an optimizer pre-step hook that waits until every other rank
  has written its audit line for step 30, that is, committed it): the survivors committed a step
  whose audit line rank 3 never wrote.
- `at=forward`: rank 3 dies as DDP's forward of step 30 begins (a forward pre-hook), after the
  step boundary's collectives: the other ranks' first collective of the step is one of DDP's own
  in its forward (the buckets' rebuild in a group's second step, the buffers' broadcast of a model
  with buffers).
- `at=reform`: rank 3's whole node dies (its torchrun agent, then the worker itself, both
  SIGKILLed) when, in an in-process re-form after step 30 (training/in_process.py), the round was
  taken in process and the worker is about to form the new group: a second node lost during
  the re-form itself.
`once` names a file created when the fault fires, so that it fires once per job, whatever the
restarts. Several faults, one per moment, are separated by `;` (each with its own `once`).
Every rank installs the same hooks (with `at=allreduce`, the comm hook of torch's default
all-reduce), so that the ranks compute the same sums.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from elastic_ddp import train
from elastic_ddp.chaos.held_train import held
from elastic_ddp.runtime.distributed import agent_pid, exit_worker
from elastic_ddp.testbed.local_cluster import wait_for

FAULT_VARIABLE = "ELASTIC_DDP_TEST_FAULT"
FAULT_MOMENTS = ("allreduce", "after_allreduce", "forward", "reform")
PEERS_COMMIT_TIMEOUT_S = 120


class FaultSwitch:
    """The fault of ELASTIC_DDP_TEST_FAULT, installed into a trainer (see the module docstring)."""

    def __init__(self, spec: str):
        fields = dict(item.split("=", 1) for item in spec.split(","))
        self.rank, self.step, self.moment = int(fields["rank"]), int(fields["step"]), fields["at"]
        self.once = Path(fields["once"])
        if self.moment not in FAULT_MOMENTS:
            raise ValueError(f"{FAULT_VARIABLE}: at={self.moment!r}; expected one of {FAULT_MOMENTS}")
        self.trainer = None

    def install(self, trainer) -> None:
        if self.trainer is not None or trainer.run.ddp_model is trainer.model:
            return
        self.trainer = trainer
        if self.moment == "allreduce":  # (DDP takes one comm hook)
            # State None: the default group of the moment (a group re-formed in process is a new one).
            trainer.run.ddp_model.register_comm_hook(None, self._all_reduce)
        elif self.moment == "forward":
            trainer.run.ddp_model.register_forward_pre_hook(self._before_forward)
        elif self.moment == "reform":
            regroup = trainer.run.regroup
            form_group = regroup._form_group  # the test's way into the re-form: no public hook there

            def form_group_unless_armed(*args, **kwargs):
                if (trainer.context.rank == self.rank and trainer.global_step >= self.step
                        and not self.once.exists()):
                    self.once.touch()
                    os.kill(agent_pid(), signal.SIGKILL)  # the node's agent: its beacon closes with it
                    os.kill(os.getpid(), signal.SIGKILL)
                return form_group(*args, **kwargs)

            regroup._form_group = form_group_unless_armed
        else:
            trainer.state.optimizer.register_step_pre_hook(self._before_optimizer_step)

    def _armed(self, moment: str) -> bool:
        return (self.moment == moment and self.trainer.context.rank == self.rank
                and self.trainer.global_step + 1 == self.step and not self.once.exists())

    def _die(self) -> None:
        self.once.touch()
        os.kill(os.getpid(), signal.SIGKILL)

    def _all_reduce(self, process_group, bucket):
        if self._armed("allreduce"):
            self._die()
        return default_hooks.allreduce_hook(process_group, bucket)

    def _before_forward(self, module, inputs) -> None:
        if self._armed("forward"):
            self._die()

    def _before_optimizer_step(self, optimizer, args, kwargs) -> None:
        if not self._armed("after_allreduce"):
            return
        wait_for(self._peers_committed, PEERS_COMMIT_TIMEOUT_S, f"the other ranks to commit step {self.step}",
                 interval=0.01)
        self._die()

    def _peers_committed(self) -> bool:
        """Whether every other rank's audit log of this incarnation has its line for the step."""
        audit = self.trainer.run.run_log.audit
        for rank in range(self.trainer.context.world_size):
            if rank == self.rank:
                continue
            path = Path(self.trainer.config.audit_log) / f"audit-{audit.incarnation}-rank{rank}.jsonl"
            lines = path.read_text().splitlines() if path.exists() else []
            if not any(json.loads(line)["step"] == self.step for line in lines if line.endswith("}")):
                return False
        return True


def main() -> int:
    faults = [FaultSwitch(spec) for spec in os.environ.get(FAULT_VARIABLE, "").split(";") if spec]

    def install(trainer) -> None:
        for fault in faults:
            fault.install(trainer)

    return train.main(after_step=held(install))


if __name__ == "__main__":
    exit_worker(main())
