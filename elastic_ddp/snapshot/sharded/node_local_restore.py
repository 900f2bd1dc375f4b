"""Restore of a sharded run whose steps are on the nodes' own disks (node_local.py).

1. `survey`: the lowest rank of each directory lists what its directory holds of each committed
   step: the manifest, and the files it lists that are there with the manifest's size. No file is
   read yet. All ranks all-gather these lists over the side group; the newest step held whole by
   size is what the memory state is weighed against (session.py): a memory state at least as new
   wins, and nothing more is read.
2. `agree`, when the memory state did not win: all ranks go through the same candidates, newest
   step first (then the manifest most directories hold). A candidate with a file on no directory is
   refused at once. For one whose every file some directory holds, the holders check their copies
   of that step alone (checksum; `trainer.snap` must load and fit this run, `.metadata` pass the
   safe reader) and all-gather what failed; a copy that failed is no longer held. The first
   candidate still held whole is the choice. Each newer step is refused with its reason (`refused`
   of the `restore` event: the files on no node of the group, and what was wrong with the copies
   found). The newest step whose every file is on two directories is never pruned afterwards (the
   candidates after the choice are checked until one is).
3. If the durable step is taken (the memory copies did not win), every directory that lacks files
   of it receives them from the lowest rank that holds each, over the same group (file_frames.py:
   checked against the manifest, written atomically); a directory without the step at all gets the
   manifest too and is committed by its rename. Then every rank's directory holds the whole step and
   DCP reshards it as on shared storage. The `restore` event names the files fetched and from where.

A directory that holds another manifest of the chosen step (a step of an abandoned trajectory, kept by
a node that missed its retraining) gets the chosen step whole, which then replaces it.

Not guaranteed: a restore when a directory that lacks files has no room for them (it fails in one
line, naming the file and the directories). After a restore from memory, the step kept from
pruning is the newest on two directories by size (its copies were not read).

Cost: a restore that the memory state wins reads no file of a step. Otherwise it reads the files
of the steps `agree` checks: the chosen one, the newer ones whose files were all there by size
(damaged copies), and those after it until one is on two directories. Before, every restore read
every file of every kept step (`--keep_last`, 3 by default).
"""

from __future__ import annotations

import logging
import socket
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from elastic_ddp.snapshot.files.checksum import checksum_of
from elastic_ddp.snapshot.files.strict_json import parse_object
from elastic_ddp.snapshot.serialization import check_compatible, snapshot_from_file
from elastic_ddp.snapshot.sharded import file_frames
from elastic_ddp.snapshot.sharded import step_directories as steps
from elastic_ddp.snapshot.sharded.node_local import NodeLocalSteps
from elastic_ddp.snapshot.sharded.safe_reader import SafeFileSystemReader

logger = logging.getLogger(__name__)

REASON_CHARS = 300


@dataclass(frozen=True)
class Held:
    """What one directory holds of one committed step."""

    step: int
    manifest: bytes
    files: tuple[str, ...]  # listed by the manifest, there and matching it
    problems: tuple[str, ...]  # why some listed files that are there are not usable


@dataclass(frozen=True)
class LocalChoice:
    """The step all ranks restore, and who holds which of its files (leaders' ranks)."""

    step: int
    checksum: str  # the manifest's
    manifest: bytes
    files: dict[str, dict]
    holders: dict[str, list[int]]
    hosts: list[str]

    @property
    def name(self) -> str:
        return f"sharded-{self.step:09d}"


def scan(root: Path) -> list[Held]:
    """What this directory holds of each committed step by size, newest first (no file is read but
    the manifests: `check_copies` reads those of one step)."""
    found = []
    for step, directory in steps.committed_steps(root):
        try:
            raw, files = steps.read_manifest(directory)
        except steps.ShardedSnapshotError as exc:
            logger.warning("sharded snapshot of step %d refused: %s", step, exc)
            continue
        held, problems = [], []
        for name, entry in files.items():
            if not (directory / name).exists():
                continue
            problem = steps.size_problem(directory / name, entry)
            if problem:
                problems.append(problem)
            else:
                held.append(name)
        found.append(Held(step, raw, tuple(sorted(held)), tuple(problems)))
    return found


def check_copies(root: Path, step: int, names: list[str], files: dict[str, dict],
                 fingerprint: dict[str, Any]) -> list[tuple[str, str]]:
    """(name, why) for each of `names`, copies of `step` in this directory, that is not the file
    `files` lists: its checksum, and for `trainer.snap` and `.metadata` their contents."""
    directory = steps.committed_directory(root, step)
    failed = []
    for name in names:
        problem = (steps.file_problem(directory / name, files[name])
                   or _content_problem(directory, name, fingerprint))
        if problem:
            failed.append((name, problem))
    return failed


def _content_problem(directory: Path, name: str, fingerprint: dict[str, Any]) -> str:
    try:
        if name == steps.TRAINER_FILE:
            plain, _ = snapshot_from_file(directory / name, str(directory / name))
            check_compatible(plain, fingerprint, str(directory))
        elif name == ".metadata":
            SafeFileSystemReader(directory).read_metadata()  # refuses an index that would run code
    except Exception as exc:  # noqa: BLE001 - any reason to refuse the file is a reason to look elsewhere
        return f"{directory / name}: {exc}"
    return ""


@dataclass
class Survey:
    """What every directory of the group holds of each committed step, by size (the same on every rank)."""

    holders: dict[tuple[int, bytes], dict[str, list[int]]]  # (step, manifest) -> file -> leaders' ranks
    problems: dict[int, list[str]]  # step -> what was wrong with the copies found
    hosts: list[str]

    @property
    def candidates(self) -> list[tuple[int, bytes]]:
        """Newest step first, then the manifest most directories hold."""
        return sorted(self.holders, key=lambda key: (-key[0], -len(self.holders[key]), checksum_of(key[1])))

    def newest_held(self, copies: int = 1) -> int | None:
        """The newest step whose every file is on `copies` directories by size: no durable step is newer."""
        for step, raw in self.candidates:
            by_file = self.holders[step, raw]
            if all(len(by_file.get(name, ())) >= copies for name in parse_object(raw)["files"]):
                return step
        return None


def survey(local: NodeLocalSteps) -> Survey:
    """What the group's directories hold, by size (a collective over the side group; no file is read
    but the manifests). The step kept from pruning is set by size here; `agree` sets it by checked copies."""
    context = local.context
    leader = local.layout.directory_of[context.rank] == context.rank
    mine = (socket.gethostname(), scan(local.root) if leader else [])
    gathered: list[Any] = [None] * context.world_size
    dist.all_gather_object(gathered, mine, group=local.group)
    holders: dict[tuple[int, bytes], dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    problems: dict[int, list[str]] = defaultdict(list)
    for rank, (_, found) in enumerate(gathered):
        for held in found:
            by_file = holders[held.step, held.manifest]  # (a step held with no usable file is a candidate too)
            for name in held.files:
                by_file[name].append(rank)
            problems[held.step] += held.problems
    surveyed = Survey(holders, problems, [host for host, _ in gathered])
    local.last_replicated_step = surveyed.newest_held(copies=2)
    return surveyed


def agree(local: NodeLocalSteps, fingerprint: dict[str, Any],
          surveyed: Survey) -> tuple[LocalChoice | None, list[dict[str, Any]]]:
    """The newest step of `surveyed` whose files the group holds, its copies checked, and the newer
    ones refused with their reasons (collectives over the side group; the same answer on every rank)."""
    holders, problems = surveyed.holders, surveyed.problems
    choice, refused = None, []
    local.last_replicated_step = None
    for step, raw in surveyed.candidates:
        files = parse_object(raw)["files"]
        by_file = holders[step, raw]
        if all(by_file.get(name) for name in files):
            _drop_damaged_copies(local, step, files, by_file, problems[step], fingerprint)
        if all(by_file.get(name) for name in files):
            if choice is None:
                choice = LocalChoice(step, checksum_of(raw), raw, files, dict(by_file), surveyed.hosts)
            if all(len(by_file[name]) >= 2 for name in files):
                local.last_replicated_step = step
                break
        elif choice is None and all(item["global_step"] != step for item in refused):  # (one reason per step)
            missing = sorted(name for name in files if not by_file.get(name))
            seen = "; ".join(problems[step][:2])
            reason = (f"file(s) {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} of its {len(files)} "
                      f"are on no node of this group (lost with their node, or damaged{': ' + seen if seen else ''})")
            refused.append({"source": "file", "global_step": step, "host": "", "reason": reason[:REASON_CHARS]})
    return choice, [item for item in refused if choice is None or item["global_step"] > choice.step]


def _drop_damaged_copies(local: NodeLocalSteps, step: int, files: dict[str, dict], by_file: dict[str, list[int]],
                         problems: list[str], fingerprint: dict[str, Any]) -> None:
    """Every holder checks its copies of `step` (`check_copies`) and all ranks all-gather what
    failed (a collective); each failed copy is removed from `by_file`, its reason added to `problems`."""
    rank = local.context.rank
    mine = [name for name, ranks in sorted(by_file.items()) if rank in ranks]
    failed = check_copies(local.root, step, mine, files, fingerprint) if mine else []
    gathered: list[Any] = [None] * local.context.world_size
    dist.all_gather_object(gathered, failed, group=local.group)
    for holder, found in enumerate(gathered):
        for name, problem in found:
            by_file[name].remove(holder)
            problems.append(problem)


def fetch(local: NodeLocalSteps, choice: LocalChoice) -> tuple[str, int, str]:
    """Copy the files of `choice` into every directory that lacks them (a collective over the side
    group). Returns what was fetched and from where (for the restore event), the serving rank and its host."""
    rank = local.context.rank
    into = _directory_to_fill(local, choice) if local.layout.directory_of[rank] == rank else None
    fetched, sources = [], []
    for name in sorted(choice.files):
        lacking = [leader for leader in local.layout.leaders if leader not in choice.holders[name]]
        if not lacking:
            continue
        source = min(choice.holders[name])
        codes = local.transfer(source, lacking, choice.step, local.root / choice.name if rank == source else into,
                               name, choice.files)
        failed = [other for other in lacking if codes[other] != file_frames.STORED]
        if failed:
            raise steps.ShardedSnapshotError(
                f"{name} of step {choice.step} could not be fetched to the checkpoint directory of rank(s) {failed} "
                f"({file_frames.REASONS.get(codes[failed[0]], 'not kept')})")
        fetched.append(name)
        sources.append(source)
    if into is not None and into.name != choice.name:
        steps.install(into, steps.committed_directory(local.root, choice.step))
    dist.barrier(group=local.group)  # every directory holds the whole step before any rank reads it
    if not fetched:
        return choice.name, 0, choice.hosts[0]
    served = sorted(set(sources))
    where = ", ".join(f"rank {source} on node {local.layout.nodes[source]} ({choice.hosts[source]})"
                      for source in served)
    names = ", ".join(fetched[:4]) + (" ..." if len(fetched) > 4 else "")
    logger.info("sharded step %d: fetched %d file(s) (%s) from %s", choice.step, len(fetched), names, where)
    return f"{choice.name}, {len(fetched)} file(s) fetched ({names}) from {where}", served[0], choice.hosts[served[0]]


def _directory_to_fill(local: NodeLocalSteps, choice: LocalChoice) -> Path:
    """The committed directory of the step when this directory has it with the chosen manifest, else a
    temporary one holding the manifest, installed once filled (replacing a directory of the step with
    another manifest: an abandoned trajectory's, which the group did not choose)."""
    final = steps.committed_directory(local.root, choice.step)
    try:
        raw, _ = steps.read_manifest(final) if final.exists() else (b"", {})
    except steps.ShardedSnapshotError:
        raw = b""
    if raw == choice.manifest:
        return final
    temporary = steps.temporary_directory(local.root, choice.step, local.incarnation)
    temporary.mkdir(parents=True, exist_ok=True)
    file_frames.write_atomically(temporary / steps.MANIFEST, choice.manifest)
    return temporary
