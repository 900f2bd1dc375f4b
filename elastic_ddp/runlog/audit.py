"""The audit log: one JSON line per committed optimizer step per rank, for checking exactly-once.

Each worker process writes `DIR/audit-<incarnation>-rank<R>.jsonl`; a line is
`{"incarnation": I, "epoch": E, "step": S, "rank": R, "world_size": W, "samples": [...]}`. Lines
are flushed as they are written, so a SIGKILL loses none that were reported.

The oracle, `exactly_once_violations`, applies one rule to the lines of every incarnation:

    for each step, the entries of the newest incarnation that logged it survive (older ones were
    rolled back by a restore); their ranks form a whole world (0 .. W-1 of one world size W);
    then every epoch's surviving samples are the epoch's samples, each exactly once.

Two entries of the same (incarnation, step, rank) with the same samples count once: a rank may
record another rank's share of a step it committed (`record_step_for`, see docs/failure-semantics.md,
"A failure in the middle of a step"). Two that differ are reported as a conflict.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from elastic_ddp.workload.sampler import epoch_length


class AuditLog:
    """Appends this rank's committed steps to its own file."""

    def __init__(self, directory: str | Path, incarnation: int, rank: int, world_size: int):
        self.incarnation, self.rank, self.world_size = incarnation, rank, world_size
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        self._file = open(path / f"audit-{incarnation}-rank{rank}.jsonl", "a", buffering=1)

    def record_step(self, epoch: int, global_step: int, samples: list[int]) -> None:
        """This rank committed `global_step`, which trained it on `samples`."""
        self.record_step_for(self.rank, epoch, global_step, samples)

    def record_step_for(self, rank: int, epoch: int, global_step: int, samples: list[int]) -> None:
        """Record rank `rank`'s share of a step this rank committed (the plan is deterministic)."""
        self._file.write(json.dumps({
            "incarnation": self.incarnation, "epoch": epoch, "step": global_step,
            "rank": rank, "world_size": self.world_size, "samples": samples,
        }) + "\n")

    def close(self) -> None:
        self._file.close()


def read_entries(directory: str | Path) -> list[dict]:
    """Every audit line in `directory`; a torn last line (a kill mid-write) is ignored."""
    entries = []
    for path in sorted(Path(directory).glob("audit-*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return entries


def surviving_entries(entries: list[dict]) -> tuple[dict[int, list[dict]], list[str]]:
    """Per step, one entry per rank of the newest incarnation that logged it; and the problems
    (a world that is not whole, conflicting entries) found on the way."""
    newest: dict[int, int] = {}
    for entry in entries:
        newest[entry["step"]] = max(newest.get(entry["step"], entry["incarnation"]), entry["incarnation"])
    by_step: dict[int, dict[int, dict]] = defaultdict(dict)
    problems = []
    for entry in entries:
        step = entry["step"]
        if entry["incarnation"] != newest[step]:
            continue
        kept = by_step[step].setdefault(entry["rank"], entry)
        if kept is not entry and (kept["samples"] != entry["samples"] or kept["epoch"] != entry["epoch"]):
            problems.append(f"step {step}: two different entries for rank {entry['rank']} in incarnation "
                            f"{entry['incarnation']}")
    for step, ranks in sorted(by_step.items()):
        world_sizes = {entry["world_size"] for entry in ranks.values()}
        if len(world_sizes) != 1 or set(ranks) != set(range(world_sizes.pop())):
            problems.append(f"step {step}: the surviving entries (incarnation {newest[step]}) are of ranks "
                            f"{sorted(ranks)}, not a whole world")
    return {step: list(ranks.values()) for step, ranks in by_step.items()}, problems


def exactly_once_violations(entries: list[dict], dataset_size: int, epochs: int,
                            global_batch_size: int, drop_last: bool = False) -> list[str]:
    """Why the surviving trajectory does not train each sample of each epoch exactly once ([] if it does)."""
    expected_per_epoch = epoch_length(dataset_size, global_batch_size, drop_last)
    by_step, problems = surviving_entries(entries)
    by_epoch: dict[int, list[int]] = defaultdict(list)
    for step_entries in by_step.values():
        for entry in step_entries:
            by_epoch[entry["epoch"]].extend(entry["samples"])
    for epoch in range(epochs):
        samples = by_epoch.get(epoch, [])
        repeated = len(samples) - len(set(samples))
        outside = [s for s in set(samples) if not 0 <= s < dataset_size]
        if repeated or outside or len(set(samples)) != expected_per_epoch:
            problems.append(f"epoch {epoch}: {len(set(samples))} distinct samples of {expected_per_epoch} expected, "
                            f"{repeated} repeated, {len(outside)} out of range")
    extra = sorted(set(by_epoch) - set(range(epochs)))
    if extra:
        problems.append(f"samples logged for epochs {extra} beyond the {epochs} trained")
    return problems
