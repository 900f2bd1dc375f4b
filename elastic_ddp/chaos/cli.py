"""`python -m elastic_ddp.chaos`: rehearse failures on a local elastic job before paying for a cluster.

    # a seeded random plan of 8 faults over 1 to 4 nodes, then compare with an uninterrupted run
    python -m elastic_ddp.chaos --random 8 --seed 3 --run-dir runs/chaos --compare -- \\
        --model mlp --no-augment --epochs 2 --dataset_size 4096 --global_batch_size 64 --log_interval 1

    # a plan written by hand (format: elastic_ddp/chaos/plan.py)
    python -m elastic_ddp.chaos --plan my-plan.json --run-dir runs/rehearsal -- --epochs 3 ...

    # network faults ("partition_node", "heal_node", "blip_node"): as root, each node a host of its own
    python -m elastic_ddp.chaos --plan partition.json --run-dir runs/net -- --epochs 3 ...

Arguments after `--` go to the training module (`--module`, default elastic_ddp.train; your own
must accept elastic_ddp's `--checkpoint_dir` and `--audit_log`, as `TrainingConfig.from_args`
does). The report is printed and, with `--report`, written as JSON. Exit status: 0 when every
promise held (and, with `--compare`, the final model matches the uninterrupted run), 1 otherwise,
2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from elastic_ddp.chaos.equivalence import (
    DEFAULT_LOSS_TOLERANCE,
    DEFAULT_PARAMETER_TOLERANCE,
    compare_runs,
    run_reference,
)
from elastic_ddp.chaos.harness import STORES, ChaosHarness, expected_final_step
from elastic_ddp.chaos.plan import FaultPlan, PlanError, random_plan


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The chaos command's options (also used by `elastic-ddp chaos`)."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--plan", type=Path, help="Fault plan as a JSON file.")
    source.add_argument("--random", type=int, metavar="FAULTS", help="Draw a plan of at least FAULTS faults.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the random plan and of random targets.")
    parser.add_argument("--initial-nodes", type=int, default=3, help="Nodes at the start (random plans).")
    parser.add_argument("--min-nodes", type=int, default=1, help="Fewest nodes (random plans; torchrun --nnodes).")
    parser.add_argument("--max-nodes", type=int, default=4, help="Most nodes (random plans; torchrun --nnodes).")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="Training processes per node.")
    parser.add_argument("--store", choices=STORES, default="standalone",
                        help="Where the c10d rendezvous store runs: a process of its own, so that every node "
                             "can be killed, or the first node, as plain torchrun does it.")
    parser.add_argument("--run-dir", type=Path, required=True,
                        help="Where the logs, snapshots (ck/), events and audit files go.")
    parser.add_argument("--module", default="elastic_ddp.train", help="Training module torchrun runs.")
    parser.add_argument("--deadline", type=float, default=900, help="Seconds the whole run may take.")
    parser.add_argument("--compare", action="store_true",
                        help="Also train without faults in one process (with --sharding fsdp: the one worker of "
                             "torchrun --standalone) and compare final parameters and per-step losses, of DDP "
                             "snapshots or sharded steps (use a model without BatchNorm and --log_interval 1).")
    parser.add_argument("--report", type=Path, help="Write the report as JSON here.")
    parser.add_argument("--save-plan", type=Path, help="Write the plan that was played as JSON here.")
    parser.add_argument("training_args", nargs=argparse.REMAINDER,
                        help="-- followed by the training module's arguments.")


def build_plan(args: argparse.Namespace, total_steps: int) -> FaultPlan:
    if args.plan is not None:
        return FaultPlan.load(args.plan)
    return random_plan(args.seed, total_steps, faults=args.random, initial_nodes=args.initial_nodes,
                       min_nodes=args.min_nodes, max_nodes=args.max_nodes, nproc_per_node=args.nproc_per_node)


def run(args: argparse.Namespace) -> int:
    """Play the plan, print the report; 0 when every promise held."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s chaos: %(message)s", datefmt="%H:%M:%S")
    training_args = args.training_args[1:] if args.training_args[:1] == ["--"] else args.training_args
    try:
        _, total_steps = expected_final_step(training_args)
        plan = build_plan(args, total_steps)
    except (PlanError, ValueError) as exc:
        print(f"elastic_ddp.chaos: {exc}", file=sys.stderr)
        return 2
    if args.save_plan:
        plan.save(args.save_plan)
    print("plan:", *(f"  {i}: {fault.describe()}" for i, fault in enumerate(plan.faults)), sep="\n")
    try:
        harness = ChaosHarness(args.run_dir, training_args, plan, nproc_per_node=args.nproc_per_node,
                               store=args.store, module=args.module, deadline_s=args.deadline)
        report = harness.run()
    except PlanError as exc:
        print(f"elastic_ddp.chaos: the plan cannot be followed: {exc}", file=sys.stderr)
        return 2
    document = report.to_dict()
    print(report.summary())
    ok = report.ok
    if args.compare:
        reference = run_reference(args.run_dir / "reference", training_args, module=args.module)
        equivalence = compare_runs(reference, harness.job.checkpoint_dir)
        matches = equivalence.within()
        print(f"  same model as an uninterrupted run: {'yes' if matches else 'NO'} ({equivalence.describe()}; "
              f"tolerances {DEFAULT_PARAMETER_TOLERANCE:g} / {DEFAULT_LOSS_TOLERANCE:g})")
        document["equivalence"] = {**vars(equivalence), "within_tolerance": matches}
        ok = ok and matches
    if args.report:
        args.report.write_text(json.dumps(document, indent=1, default=str) + "\n")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m elastic_ddp.chaos",
                                     description="Run a local elastic job and break it as a fault plan says.",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))
