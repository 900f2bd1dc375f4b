"""What a checkpoint directory holds, and whether each snapshot in it would be restored.

    elastic-ddp inspect runs/job1/ck

Reads the directory through `SnapshotStore`'s public methods only: its index (the manifest's
entries, or, when the manifest is missing or unusable, the entries rebuilt from the self-describing
snapshot files), then each entry's bytes checked against its size and checksum (`read_verified`)
and, unless `load=False`, loaded the way a restore loads them (`torch.load(weights_only=True)`).
So "valid" here means what it means to a restart: the newest valid snapshot is the one training
resumes from (when every node sees this directory). Files the index does not list are shown too:
a snapshot file written by a writer that died before its manifest update, or a temporary file of
an interrupted write.

Not checked: whether a snapshot fits the model and data of the run you will start (the restore
compares its fingerprint and says so).
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from elastic_ddp.runlog.schema import EVENT_LOG_NAME
from elastic_ddp.snapshot.files.backends import TEMPORARY_PATTERN, is_url
from elastic_ddp.snapshot.files.errors import SnapshotStoreError
from elastic_ddp.snapshot.files.manifest import MANIFEST_NAME, SNAPSHOT_PATTERN, ManifestEntry
from elastic_ddp.snapshot.files.snapshot_store import SnapshotStore
from elastic_ddp.tools.text import format_bytes, format_duration

# Files a run leaves in its checkpoint directory besides snapshots and the manifest (.memory-scope
# and .store-id: left by older versions).
RUN_FILES = {EVENT_LOG_NAME, "report.png", "memory-scope", ".memory-scope", ".store-id"}


class InspectionError(Exception):
    """The location is missing, or is not a checkpoint directory."""


@dataclass
class SnapshotStatus:
    """One indexed snapshot and what checking it found."""

    entry: ManifestEntry
    valid: bool = False
    problem: str | None = None
    world_size: int | None = None  # of the run that wrote it (known once loaded)

    def to_dict(self) -> dict[str, Any]:
        """The entry's fields but its checksum, then the verdict (one snapshot in `--json`)."""
        listed = {name: value for name, value in asdict(self.entry).items() if name != "checksum"}
        return {**listed, "valid": self.valid, "problem": self.problem, "world_size": self.world_size}


@dataclass
class CheckpointInspection:
    location: str
    manifest_present: bool
    index_rebuilt: bool = False  # the manifest was missing or unusable: entries come from the files
    snapshots: list[SnapshotStatus] = field(default_factory=list)  # oldest first
    unlisted_snapshot_files: list[str] = field(default_factory=list)
    temporary_files: list[str] = field(default_factory=list)

    @property
    def newest_valid(self) -> SnapshotStatus | None:
        return next((s for s in reversed(self.snapshots) if s.valid), None)

    def to_dict(self) -> dict[str, Any]:
        document = asdict(self)
        document["snapshots"] = [snapshot.to_dict() for snapshot in self.snapshots]
        newest = self.newest_valid
        document["newest_valid_step"] = newest.entry.global_step if newest else None
        return document


def inspect_checkpoints(location: str | os.PathLike, load: bool = True) -> CheckpointInspection:
    """Check every snapshot the manifest at `location` lists. Raises InspectionError when
    `location` does not exist or holds files but none of a checkpoint directory."""
    _check_location(location)
    store = SnapshotStore(location)
    names = set(store.storage.list_names())
    inspection = CheckpointInspection(location=store.describe(), manifest_present=MANIFEST_NAME in names)
    index = store.index()
    inspection.index_rebuilt = index.rebuilt
    entries = index.entries
    for entry in entries:
        inspection.snapshots.append(_check_entry(store, entry, load))
    listed = {entry.file for entry in entries}
    inspection.unlisted_snapshot_files = sorted(n for n in names if SNAPSHOT_PATTERN.match(n) and n not in listed)
    inspection.temporary_files = sorted(n for n in names if TEMPORARY_PATTERN.match(n))
    ours = MANIFEST_NAME in names or entries or inspection.unlisted_snapshot_files or inspection.temporary_files
    if names and not ours and not names & RUN_FILES:
        shown = ", ".join(sorted(names)[:5]) + (", ..." if len(names) > 5 else "")
        raise InspectionError(f"{inspection.location}: not an elastic_ddp checkpoint directory (no {MANIFEST_NAME} "
                              f"and no snapshot-*.pt; it holds {shown}); give the run's --checkpoint_dir")
    return inspection


def _check_location(location: str | os.PathLike) -> None:
    if is_url(location):
        return  # remote storage: listing it tells
    path = Path(location)
    if not path.exists():
        raise InspectionError(f"{path}: no such directory")
    if not path.is_dir():
        raise InspectionError(f"{path}: not a directory; give the run's --checkpoint_dir")


def _check_entry(store: SnapshotStore, entry: ManifestEntry, load: bool) -> SnapshotStatus:
    status = SnapshotStatus(entry)
    try:
        data = store.read_verified(entry)
        if load:
            from elastic_ddp.snapshot.files.errors import SnapshotError
            from elastic_ddp.snapshot.serialization import snapshot_from_bytes  # imports torch: only when loading

            try:
                status.world_size = snapshot_from_bytes(data, store.describe(entry.file)).world_size
            except SnapshotError as exc:
                raise SnapshotStoreError(str(exc)) from exc
    except SnapshotStoreError as exc:
        status.problem = str(exc)
        return status
    status.valid = True
    return status


def format_inspection(inspection: CheckpointInspection, now: float | None = None, loaded: bool = True) -> str:
    """The table `elastic-ddp inspect` prints."""
    now = time.time() if now is None else now
    lines = [f"Checkpoint directory {inspection.location}"]
    if inspection.index_rebuilt:
        problem = "is missing" if not inspection.manifest_present else "cannot be used (see the message above)"
        lines.append(f"  {MANIFEST_NAME} {problem}: the snapshots below are indexed from their own headers, as a "
                     "restart indexes them")
    elif not inspection.manifest_present:
        lines.append(f"  no {MANIFEST_NAME}: no snapshot has been completed here (yet)")
    elif not inspection.snapshots:
        lines.append(f"  {MANIFEST_NAME} lists no snapshot, or cannot be read (see the message above)")
    if inspection.snapshots:
        header = f"  {'step':>9}  {'epoch':>5}  {'samples':>9}  {'size':>9}  {'age':>13}  {'world':>5}  status"
        lines.append(header)
        newest = inspection.newest_valid
        for snapshot in inspection.snapshots:
            entry = snapshot.entry
            world = str(snapshot.world_size) if snapshot.world_size is not None else "-"
            status = f"ok ({'loads' if loaded else 'checksum'})" if snapshot.valid else f"BAD: {snapshot.problem}"
            if snapshot is newest:
                status += "  <- a restart resumes here"
            age = format_duration(max(0.0, now - entry.created_unix)) + " ago"
            lines.append(f"  {entry.global_step:>9}  {entry.epoch:>5}  {entry.samples_consumed:>9}  "
                         f"{format_bytes(entry.size_bytes):>9}  {age:>13}  {world:>5}  {status}")
    for name in inspection.unlisted_snapshot_files:
        lines.append(f"  {name}: not in the index (a write that did not complete, or a format-1 file without "
                     "its manifest entry); not restored")
    for name in inspection.temporary_files:
        lines.append(f"  {name}: temporary file of an interrupted write; removed by the next snapshot")
    newest = inspection.newest_valid
    if newest is not None:
        valid = sum(1 for s in inspection.snapshots if s.valid)
        lines.append(f"{valid} of {len(inspection.snapshots)} snapshots valid; newest valid: step "
                     f"{newest.entry.global_step} ({newest.entry.file})")
    else:
        lines.append("No valid snapshot: a run started on this directory would start from scratch.")
    return "\n".join(lines)
