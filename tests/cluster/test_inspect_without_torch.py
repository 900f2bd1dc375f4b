"""`elastic-ddp inspect` on a machine without torch (an operator's laptop, a storage host): every
byte is still verified. A process of its own, where any import of torch raises ImportError; the
import-linter contract `inspect-without-torch` (tests/unit/test_layers.py) checks the imports statically."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from elastic_ddp.snapshot.files.snapshot_store import SnapshotStore
from tests.support.snapshots import snapshot_bytes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]
WITHOUT_TORCH = (
    "import sys\n"
    "sys.modules['torch'] = None  # any import of torch now raises ImportError\n"
    "from elastic_ddp.tools.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n")


def inspect_without_torch(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WITHOUT_TORCH, "inspect", *arguments], cwd=REPO,
                          capture_output=True, check=False, text=True, timeout=100)


@pytest.fixture
def two_snapshots(tmp_path) -> Path:
    directory = tmp_path / "ck"
    store = SnapshotStore(directory, keep_last=3)
    for step in (10, 20):
        store.write(step, 0, step * 8, snapshot_bytes(step, epoch=0, samples_consumed=step * 8))
    return directory


def test_checksum_only_verifies_every_snapshot_without_torch(two_snapshots):
    result = inspect_without_torch("--checksum-only", str(two_snapshots))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 of 2 snapshots valid; newest valid: step 20" in result.stdout, result.stdout


def test_plain_inspect_falls_back_to_checksums_and_says_so(two_snapshots):
    result = inspect_without_torch(str(two_snapshots))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "torch is not installed here: checksums verified, snapshots not loaded" in result.stderr, result.stderr
    assert "2 of 2 snapshots valid; newest valid: step 20" in result.stdout, result.stdout


def test_a_damaged_snapshot_is_found_without_torch(two_snapshots):
    newest = max(two_snapshots.glob("snapshot-*.pt"))
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    result = inspect_without_torch(str(two_snapshots))
    assert "1 of 2 snapshots valid; newest valid: step 10" in result.stdout, result.stdout + result.stderr
