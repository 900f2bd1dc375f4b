"""The audit log: one JSON line per committed optimizer step per rank, for checking exactly-once.

Each worker process writes `DIR/audit-<incarnation>-rank<R>.jsonl`; a line is
`{"incarnation": I, "epoch": E, "step": S, "rank": R, "world_size": W, "samples": [...]}`. Lines
are flushed as they are written, so a SIGKILL loses none that were reported. After a chaotic run,
`surviving_samples_by_epoch` keeps, for each step, the entries of the newest incarnation that logged
it (older ones were rolled back by a restore); each epoch's samples must then be the dataset once.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path


class AuditLog:
    """Appends this rank's committed steps to its own file."""

    def __init__(self, directory: str | Path, incarnation: int, rank: int, world_size: int):
        self.incarnation, self.rank, self.world_size = incarnation, rank, world_size
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        self._file = open(path / f"audit-{incarnation}-rank{rank}.jsonl", "a", buffering=1)

    def record_step(self, epoch: int, global_step: int, samples: list[int]) -> None:
        self._file.write(json.dumps({
            "incarnation": self.incarnation, "epoch": epoch, "step": global_step,
            "rank": self.rank, "world_size": self.world_size, "samples": samples,
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


def surviving_samples_by_epoch(entries: list[dict]) -> dict[int, list[int]]:
    """Per epoch, the samples of the surviving trajectory (newest incarnation per step)."""
    newest_incarnation: dict[int, int] = {}
    for entry in entries:
        step = entry["step"]
        newest_incarnation[step] = max(newest_incarnation.get(step, entry["incarnation"]), entry["incarnation"])
    samples: dict[int, list[int]] = defaultdict(list)
    for entry in entries:
        if entry["incarnation"] == newest_incarnation[entry["step"]]:
            samples[entry["epoch"]].extend(entry["samples"])
    return dict(samples)


def exactly_once_violations(entries: list[dict], dataset_size: int, epochs: int,
                            global_batch_size: int, drop_last: bool = False) -> list[str]:
    """Why the surviving trajectory does not train each sample of each epoch exactly once ([] if it does)."""
    expected_per_epoch = dataset_size - (dataset_size % global_batch_size if drop_last else 0)
    by_epoch = surviving_samples_by_epoch(entries)
    problems = []
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
