"""Same model as an uninterrupted run: compare a chaotic run with a single-process reference.

    reference = run_reference("runs/chaos/reference", training_args)
    result = compare_runs(reference, "runs/chaos/ck")

`run_reference` trains the same configuration in one process, without faults: without torchrun,
or, when the configuration asks for `--sharding fsdp` (which needs a process group), as the one
worker of `torchrun --standalone`, an uninterrupted FSDP run. `compare_runs` compares the final
parameters and the loss of every optimizer step of the surviving trajectory (the newest
incarnation's `progress` event per step; train with `--log_interval 1` to have one per step).
`final_model` reads the final parameters of either kind of run through `elastic_ddp.load_snapshot`
(the newest valid snapshot file of DDP mode, or the newest sharded step directory that verifies
against its manifest, whichever is newer; no process group needed).

Why a tolerance and not bit equality: each rank sums its share of the global batch and the
all-reduce adds the ranks' sums, so the order of the fp32 additions in every gradient depends on the
world size (and resuming changes nothing else: a restore is bit-exact). Each step then rounds
differently, by about fp32's unit roundoff (6e-8) relative to the gradient, and the differences
compound over the steps of the run. `DEFAULT_PARAMETER_TOLERANCE` and `DEFAULT_LOSS_TOLERANCE`
(1e-5) are a factor 30 above what that amounts to for the built-in MLP over 192 steps, and below
the change of loss between consecutive steps, which a wrong batch shows (docs/benchmarks-history.md;
docs/failure-semantics.md, "Same model as an uninterrupted run"). The audit log checks exactly-once.

Not comparable this way: models with batch-dependent layers (BatchNorm: per-rank statistics), and
runs whose randomness does not come from (seed, epoch, sample index).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from elastic_ddp.runlog import schema
from elastic_ddp.runlog.reader import read_events
from elastic_ddp.runlog.schema import EVENT_LOG_NAME
from elastic_ddp.snapshot.loading import load_snapshot

# Largest |reference - chaotic| of any parameter element, relative to the largest |parameter| of
# its tensor; and the largest absolute difference of a per-step mean loss.
DEFAULT_PARAMETER_TOLERANCE = 1e-5
DEFAULT_LOSS_TOLERANCE = 1e-5
# torchrun's variables: a reference run must not believe it is part of a job.
TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                      "GROUP_RANK", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")


@dataclass(frozen=True)
class Equivalence:
    """How far a chaotic run ended from the uninterrupted reference."""

    parameter_difference: float  # max over tensors of max|a - b| / max|a|
    worst_parameter: str
    loss_difference: float  # max over steps of |loss_a - loss_b|
    worst_loss_step: int | None
    steps_compared: int
    missing_steps: list[int]  # steps with a loss in the reference but not in the chaotic run

    def within(self, parameter_tolerance: float = DEFAULT_PARAMETER_TOLERANCE,
               loss_tolerance: float = DEFAULT_LOSS_TOLERANCE) -> bool:
        return (self.parameter_difference <= parameter_tolerance and self.loss_difference <= loss_tolerance
                and not self.missing_steps)

    def describe(self) -> str:
        return (f"parameters differ by at most {self.parameter_difference:.2e} (relative, in {self.worst_parameter}); "
                f"loss by at most {self.loss_difference:.2e} (step {self.worst_loss_step}) over "
                f"{self.steps_compared} steps" + (f"; {len(self.missing_steps)} steps without a loss"
                                                  if self.missing_steps else ""))


def reference_command(training_args: Sequence[str], checkpoint_dir: str | Path,
                      module: str = "elastic_ddp.train") -> list[str]:
    """The command of an uninterrupted run of `training_args`: the module alone, or, with sharding
    (FSDP2 needs a process group), its one worker under `torchrun --standalone`. Only `--sharding`
    is read: the module may be a script of the user's with flags of its own."""
    finder = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    finder.add_argument("--sharding", default="none")
    sharded = finder.parse_known_args(list(training_args))[0].sharding != "none"
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
                if sharded else [sys.executable])
    return [*launcher, "-m", module, *training_args, "--checkpoint_dir", str(checkpoint_dir)]


def run_reference(run_dir: str | Path, training_args: Sequence[str], module: str = "elastic_ddp.train",
                  timeout: float = 600) -> Path:
    """Train `training_args` in one process with no faults; return its checkpoint directory."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    checkpoint_dir = run_dir / "ck"
    env = {key: value for key, value in os.environ.items() if key not in TORCHRUN_VARIABLES}
    env.setdefault("OMP_NUM_THREADS", "1")
    with open(run_dir / "reference.log", "ab") as log:
        subprocess.run(reference_command(training_args, checkpoint_dir, module), stdout=log,
                       stderr=subprocess.STDOUT, env=env, timeout=timeout, check=True)
    return checkpoint_dir


def final_model(checkpoint_dir: str | Path) -> dict[str, torch.Tensor]:
    """The model's parameters in the newest valid snapshot of `checkpoint_dir`, by name (as in the
    model's own state dict), of a DDP or a sharded run (`load_snapshot`). Raises FileNotFoundError
    when there is neither."""
    return load_snapshot(checkpoint_dir)["model"]


def surviving_losses(checkpoint_dir: str | Path) -> dict[int, float]:
    """Loss per global step of the trajectory that survived: the newest incarnation's value wins."""
    losses: dict[int, tuple[int, float]] = {}
    for event in read_events(Path(checkpoint_dir) / EVENT_LOG_NAME):
        if event["event"] == schema.PROGRESS.name:
            step, incarnation = event["global_step"], event["incarnation"]
            if step not in losses or incarnation >= losses[step][0]:
                losses[step] = (incarnation, event["loss"])
    return {step: loss for step, (_, loss) in losses.items()}


def compare_runs(reference_dir: str | Path, chaotic_dir: str | Path) -> Equivalence:
    """Compare the newest snapshots' parameters and the per-step losses of two runs, each of them
    sharded or not (`final_model`)."""
    reference, chaotic = final_model(reference_dir), final_model(chaotic_dir)
    if reference.keys() != chaotic.keys():
        raise ValueError(f"{chaotic_dir} holds another model than {reference_dir}")
    worst_name, worst = "", 0.0
    for name, expected in reference.items():
        expected, actual = expected.double(), chaotic[name].double()
        scale = expected.abs().max().clamp(min=1e-12)
        difference = float((expected - actual).abs().max() / scale)
        if difference >= worst:
            worst_name, worst = name, difference
    expected_losses, actual_losses = surviving_losses(reference_dir), surviving_losses(chaotic_dir)
    common = sorted(set(expected_losses) & set(actual_losses))
    loss_differences = {step: abs(expected_losses[step] - actual_losses[step]) for step in common}
    worst_step = max(loss_differences, key=loss_differences.get, default=None)
    return Equivalence(
        parameter_difference=worst, worst_parameter=worst_name,
        loss_difference=loss_differences[worst_step] if worst_step is not None else 0.0,
        worst_loss_step=worst_step, steps_compared=len(common),
        missing_steps=sorted(set(expected_losses) - set(actual_losses)))

