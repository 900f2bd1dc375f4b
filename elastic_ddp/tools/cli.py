"""`elastic-ddp`: look at runs after the fact, check snapshots, rehearse failures.

    elastic-ddp report runs/job1/ck          # what happened: text summary + report.png
    elastic-ddp inspect runs/job1/ck         # which snapshots exist and which would restore
    elastic-ddp chaos --random 8 --run-dir runs/chaos -- --model mlp --epochs 2

Exit status (every subcommand): 0 success; 1 the command ran but found nothing usable (`inspect`:
no valid snapshot; `chaos`: a promise broke); 2 bad arguments, or a path that is missing or is
not what the command reads; 3 `report` printed its summary but could not draw the plot.
Training itself is `torchrun ... -m elastic_ddp.train` (see README.md), not a subcommand.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from elastic_ddp import __version__

EXIT_OK, EXIT_NOTHING_USABLE, EXIT_USAGE, EXIT_NO_PLOT = 0, 1, 2, 3
PROG = "elastic-ddp"

EXIT_STATUS_TEXT = """exit status: 0 success; 1 nothing usable found (inspect: no valid snapshot; chaos: a
promise broke); 2 bad arguments or a missing or foreign path; 3 report printed its summary but
could not draw the plot."""

REPORT_EXAMPLES = """examples:
  elastic-ddp report runs/job1/ck                 # CHECKPOINT_DIR, where events.jsonl is by default
  elastic-ddp report runs/job1                    # a directory with one */events.jsonl below it
  elastic-ddp report /logs/job1-events.jsonl --plot /tmp/job1.png
  elastic-ddp report runs/job1/ck --json | jq .lost_steps_total

The summary covers duration, epochs, world sizes over time, failures and joins, restores, work
lost, time without training, snapshot sizes and write times, and throughput; the plot shows loss
and throughput against step and time, the world size as a band, and each failure and restore."""

INSPECT_EXAMPLES = """examples:
  elastic-ddp inspect runs/job1/ck
  elastic-ddp inspect runs/job1/ck --checksum-only     # skip loading each snapshot (faster)
  elastic-ddp inspect s3://bucket/job1 --json

Each snapshot the manifest lists is checked as a restart would check it: size and checksum against
the manifest, then a safe load (weights_only=True). Exit status 0 when at least one is valid,
1 when none is (a run started here would start from scratch), 2 when the path is missing or is
not a checkpoint directory."""

CHAOS_EXAMPLES = """examples:
  elastic-ddp chaos --random 8 --seed 3 --run-dir runs/chaos -- --model mlp --epochs 2
  elastic-ddp chaos --plan my-plan.json --run-dir runs/rehearsal -- --epochs 3

Plays a fault plan (kills, freezes, joins) against a local elastic job and checks every promise.
`elastic-ddp chaos --help` lists all its options."""


class CliError(Exception):
    """A message for the user and the exit status that goes with it."""

    def __init__(self, message: str, exit_code: int = EXIT_USAGE):
        super().__init__(message)
        self.exit_code = exit_code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Look at elastic_ddp runs after the fact, check snapshots, rehearse failures.",
        epilog="examples:\n  elastic-ddp report runs/job1/ck\n  elastic-ddp inspect runs/job1/ck\n"
               "  elastic-ddp chaos --random 8 --run-dir runs/chaos -- --model mlp --epochs 2\n\n" + EXIT_STATUS_TEXT,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    report = commands.add_parser(
        "report", help="summarise a run from its event log and plot it", epilog=REPORT_EXAMPLES,
        description="Summarise a run from its event log (text) and draw it (PNG).",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    report.add_argument("run_dir", metavar="RUN_DIR",
                        help="the run's --checkpoint_dir, a directory above it, or the event log file itself")
    report.add_argument("--plot", metavar="PNG", type=Path,
                        help="where to write the plot (default: report.png beside the event log)")
    report.add_argument("--no-plot", action="store_true", help="print the summary only")
    report.add_argument("--json", action="store_true", help="print the summary as JSON instead of text")
    report.set_defaults(handler=run_report)

    inspect = commands.add_parser(
        "inspect", help="list the snapshots of a checkpoint directory and verify each", epilog=INSPECT_EXAMPLES,
        description="List the snapshots of a checkpoint directory with step, epoch, size and age, and "
                    "verify each one.", formatter_class=argparse.RawDescriptionHelpFormatter)
    inspect.add_argument("checkpoint_dir", metavar="CHECKPOINT_DIR", help="the run's --checkpoint_dir (path or URL)")
    inspect.add_argument("--checksum-only", action="store_true",
                         help="check size and sha256 only; do not load each snapshot")
    inspect.add_argument("--json", action="store_true", help="print the result as JSON")
    inspect.set_defaults(handler=run_inspect)

    # Parsed by the chaos module itself (see main), so that its own --help and `--` work as usual.
    commands.add_parser("chaos", help="rehearse failures on a local elastic job (see: elastic-ddp chaos --help)",
                        epilog=CHAOS_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format=f"{PROG}: %(levelname)s: %(message)s", stream=sys.stderr)
    try:
        if argv[:1] == ["chaos"]:
            return run_chaos(argv[1:])
        args = build_parser().parse_args(argv)
        return args.handler(args)
    except CliError as exc:
        command = argv[0] if argv and not argv[0].startswith("-") else ""
        print(f"{PROG}{' ' + command if command else ''}: error: {exc}", file=sys.stderr)
        return exc.exit_code


# ------------------------------------------------------------------------------------ commands

def run_report(args: argparse.Namespace) -> int:
    from elastic_ddp.runlog.run_history import HistoryError, load_history
    from elastic_ddp.tools.report import format_summary, summarise

    try:
        history = load_history(args.run_dir)
    except HistoryError as exc:
        raise CliError(str(exc)) from exc
    summary = summarise(history)
    plot_path, plot_error = None, None
    if not args.no_plot:
        from elastic_ddp.tools.plot import PlotUnavailable, render_plot

        try:
            plot_path = render_plot(history, args.plot or history.event_log.with_name("report.png"))
        except PlotUnavailable as exc:
            plot_error = str(exc)
    if args.json:
        document = summary.to_dict()
        document["plot"] = str(plot_path) if plot_path else None
        print(json.dumps(document, indent=1))
    else:
        print(format_summary(summary, str(plot_path) if plot_path else None))
    if plot_error:
        print(f"{PROG} report: no plot: {plot_error}", file=sys.stderr)
        return EXIT_NO_PLOT
    return EXIT_OK


def run_inspect(args: argparse.Namespace) -> int:
    from elastic_ddp.tools.inspection import InspectionError, format_inspection, inspect_checkpoints

    load = not args.checksum_only
    if load and not torch_importable():
        # A machine without torch (an operator's laptop, a storage host) still verifies every byte.
        print(f"{PROG} inspect: torch is not installed here: checksums verified, snapshots not loaded "
              "(as --checksum-only)", file=sys.stderr)
        load = False
    try:
        inspection = inspect_checkpoints(args.checkpoint_dir, load=load)
    except InspectionError as exc:
        raise CliError(str(exc)) from exc
    if args.json:
        print(json.dumps(inspection.to_dict(), indent=1))
    else:
        print(format_inspection(inspection, loaded=load))
    return EXIT_OK if inspection.newest_valid is not None else EXIT_NOTHING_USABLE


def torch_importable() -> bool:
    """Whether `import torch` can work here (found, and not blocked), without importing it."""
    return importlib.util.find_spec("torch") is not None


def run_chaos(argv: list[str]) -> int:
    """Hand the arguments to the chaos harness (imported only now: it is the heaviest command)."""
    try:
        from elastic_ddp.chaos import cli as chaos_cli
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("elastic_ddp.chaos"):
            raise
        raise CliError(f"the chaos harness is not available in this installation ({exc})") from exc
    parser = argparse.ArgumentParser(prog=f"{PROG} chaos", epilog=CHAOS_EXAMPLES,
                                     description="Rehearse failures on a local elastic job.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    chaos_cli.add_arguments(parser)
    return int(chaos_cli.run(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
