"""`elastic-ddp inspect` on good, corrupt, empty, foreign and missing directories: exit codes and text.

The snapshots are real: written by `SnapshotStore.write` from real `Snapshot` bytes, then damaged
on disk the way crashes and bad disks damage them.
"""

from __future__ import annotations

import json

import pytest

from elastic_ddp.snapshot.files.snapshot_store import SnapshotStore
from elastic_ddp.tools import cli
from elastic_ddp.tools.inspection import inspect_checkpoints
from tests.support.snapshots import snapshot_bytes as make_snapshot_bytes

pytestmark = pytest.mark.timeout(60)


def snapshot_bytes(step: int, world_size: int = 2) -> bytes:
    return make_snapshot_bytes(step, epoch=step // 10, samples_consumed=step * 8, world_size=world_size)


@pytest.fixture
def good_dir(tmp_path):
    directory = tmp_path / "ck"
    store = SnapshotStore(directory, keep_last=3)
    for step in (10, 20, 30):
        store.write(step, step // 10, step * 8, snapshot_bytes(step))
    return directory


def file_of(directory, step: int):
    [entry] = [e for e in SnapshotStore(directory).manifest_entries() if e.global_step == step]
    return directory / entry.file


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def flip_a_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_good_directory_lists_every_snapshot_as_valid(good_dir, capsys):
    code, out, _ = run_cli(capsys, "inspect", str(good_dir))
    assert code == 0
    rows = [line for line in out.splitlines() if "ok (loads)" in line]
    assert [int(row.split()[0]) for row in rows] == [10, 20, 30]
    # The column before the status: the world size the snapshot was written in.
    assert all(row.split()[row.split().index("ok") - 1] == "2" for row in rows), rows
    assert "<- a restart resumes here" in rows[-1]
    assert "3 of 3 snapshots valid; newest valid: step 30" in out


def test_a_corrupt_newest_snapshot_is_flagged_and_the_previous_one_is_used(good_dir, capsys):
    flip_a_byte(file_of(good_dir, 30))
    code, out, _ = run_cli(capsys, "inspect", str(good_dir))
    assert code == 0
    bad = next(line for line in out.splitlines() if line.split()[:1] == ["30"])
    assert "BAD:" in bad and "(corrupt)" in bad
    assert "newest valid: step 20" in out


def test_a_truncated_snapshot_is_flagged(good_dir, capsys):
    path = file_of(good_dir, 20)
    path.write_bytes(path.read_bytes()[:100])
    code, out, _ = run_cli(capsys, "inspect", str(good_dir), "--checksum-only")
    assert code == 0
    assert "100 bytes, the index says" in out
    assert "ok (checksum)" in out


def test_a_directory_with_no_valid_snapshot_exits_1(good_dir, capsys):
    for step in (10, 20, 30):
        flip_a_byte(file_of(good_dir, step))
    code, out, _ = run_cli(capsys, "inspect", str(good_dir))
    assert code == 1
    assert out.count("BAD:") == 3
    assert "No valid snapshot: a run started on this directory would start from scratch." in out


def test_a_file_that_verifies_but_does_not_load_safely_is_bad_unless_only_checksums_are_asked(tmp_path, capsys):
    store = SnapshotStore(tmp_path, keep_last=2)
    store.write(5, 0, 40, b"not a torch file")  # listed with its sha256, as a format-1 file would be
    code, out, _ = run_cli(capsys, "inspect", str(tmp_path))
    assert code == 1 and "not an elastic_ddp snapshot (neither format 1 nor 2)" in out
    code, out, _ = run_cli(capsys, "inspect", str(tmp_path), "--checksum-only")
    assert code == 0 and "ok (checksum)" in out


def test_an_unreadable_manifest_is_rebuilt_from_the_files(good_dir, capsys):
    (good_dir / "manifest.json").write_text("{ torn")
    code, out, err = run_cli(capsys, "inspect", str(good_dir))
    assert code == 0
    assert "manifest.json cannot be used (see the message above): the snapshots below are indexed" in out
    assert "3 of 3 snapshots valid; newest valid: step 30" in out


def test_a_missing_manifest_is_rebuilt_from_the_files(good_dir, capsys):
    """Before, a directory of snapshot files without manifest.json was "not a checkpoint directory"."""
    (good_dir / "manifest.json").unlink()
    code, out, err = run_cli(capsys, "inspect", str(good_dir))
    assert code == 0, err
    assert "3 of 3 snapshots valid; newest valid: step 30" in out


def test_leftovers_of_interrupted_writes_are_shown(good_dir, capsys):
    (good_dir / ".snapshot-000000040-00c0ffee.pt.tmp-1234").write_bytes(b"partial")
    (good_dir / "snapshot-000000050-0badf00d.pt").write_bytes(snapshot_bytes(50))  # manifest never updated
    code, out, _ = run_cli(capsys, "inspect", str(good_dir))
    assert code == 0
    assert ".snapshot-000000040-00c0ffee.pt.tmp-1234: temporary file of an interrupted write" in out
    assert "snapshot-000000050-0badf00d.pt: not in the index" in out
    assert "newest valid: step 30" in out


def test_an_empty_directory_has_no_snapshot(tmp_path, capsys):
    code, out, _ = run_cli(capsys, "inspect", str(tmp_path))
    assert code == 1
    assert "no manifest.json: no snapshot has been completed here (yet)" in out


def a_file(root):
    (root / "file.txt").write_text("x")
    return root / "file.txt"


def a_foreign_directory(root):
    (root / "photos").mkdir()
    (root / "photos" / "cat.jpg").write_bytes(b"jpg")
    return root / "photos"


@pytest.mark.parametrize("make, message", [
    (lambda root: root / "missing", "no such directory"),
    (a_file, "not a directory"),
    (a_foreign_directory, "not an elastic_ddp checkpoint directory"),
])
def test_missing_and_foreign_paths_exit_2_with_one_line(tmp_path, capsys, make, message):
    path = make(tmp_path)
    code, out, err = run_cli(capsys, "inspect", str(path))
    assert code == 2
    assert out == ""
    assert err.startswith("elastic-ddp inspect: error: ") and message in err
    assert len(err.strip().splitlines()) == 1


def test_json_output_carries_the_same_verdicts(good_dir, capsys):
    flip_a_byte(file_of(good_dir, 30))
    code, out, _ = run_cli(capsys, "inspect", str(good_dir), "--json")
    document = json.loads(out)
    assert code == 0
    assert [(s["global_step"], s["valid"]) for s in document["snapshots"]] == [(10, True), (20, True), (30, False)]
    assert document["newest_valid_step"] == 20
    assert document == inspect_checkpoints(good_dir).to_dict()
