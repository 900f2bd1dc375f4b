"""Fuzzing what elastic_ddp reads from outside: frame headers, snapshot headers and trailers, manifests.

Seeded random and mutated inputs (the same every run), counted. Each parser may refuse an input
only with its own error type, never crash with another, never allocate what an input announces
before checking it, and the store never returns a file outside its directory, whatever the
manifest says. The real transport is fuzzed with real processes in
tests/cluster/test_replication_transport.py.
"""

from __future__ import annotations

import json
import random
import struct

import pytest

from elastic_ddp.snapshot.exchange.replica_transfer import ReplicaOffer
from elastic_ddp.snapshot.exchange.transport import FrameError, FrameLimits, parse_header
from elastic_ddp.snapshot.files.checksum import checksum_of
from elastic_ddp.snapshot.files.errors import SnapshotError
from elastic_ddp.snapshot.files.file_layout import HEAD_BYTES, TRAILER_BYTES, read_seal, verify
from elastic_ddp.snapshot.files.manifest import MANIFEST_NAME, ManifestEntry
from elastic_ddp.snapshot.files.snapshot_store import SnapshotStore
from tests.support.snapshots import snapshot_bytes

pytestmark = pytest.mark.timeout(120)

VALID_HEADER = ReplicaOffer(False, 12, 1, 768, checksum_of(b"payload")).to_header()
ODD_VALUES = [None, True, False, 0, -1, 2**63, 1.5, float("inf"), "", "x" * 300, "../../etc/passwd", "/dev/zero",
              [], {}, [1, 2], {"a": {"b": []}}, "snapshot-000000001.pt", "blake3:" + "0" * 64, "sha256:zz"]


def mutations(seed: bytes, rng: random.Random, count: int):
    """`count` variants of `seed`: flipped bits, cut, extended, spliced, and pure noise."""
    for _ in range(count):
        data = bytearray(seed)
        kind = rng.randrange(5)
        if kind == 0 and data:
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        elif kind == 1:
            data = data[:rng.randrange(len(data) + 1)]
        elif kind == 2:
            data += bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        elif kind == 3 and data:
            start = rng.randrange(len(data))
            data[start:start] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        else:
            data = bytearray(rng.randrange(256) for _ in range(rng.randint(0, 64)))
        yield bytes(data)


def random_document(rng: random.Random, depth: int = 0):
    """A JSON value of random shape, often close to a replication header."""
    if depth < 2 and rng.random() < 0.5:
        document = dict(VALID_HEADER) if rng.random() < 0.5 else {}
        for _ in range(rng.randint(0, 4)):
            key = rng.choice([*VALID_HEADER, "file", "size_bytes", "x"])
            document[key] = random_document(rng, depth + 1) if rng.random() < 0.3 else rng.choice(ODD_VALUES)
        if rng.random() < 0.3 and document:
            del document[rng.choice(list(document))]
        return document
    return rng.choice(ODD_VALUES)


def test_ten_thousand_frames_are_refused_only_with_frame_errors():
    rng = random.Random(20261123)
    cases = accepted = 0
    for _ in range(2000):  # announced sizes: checked before anything is allocated
        header_bytes, payload_bytes = rng.randint(-2**63, 2**63 - 1), rng.randint(-2**63, 2**63 - 1)
        try:
            FrameLimits(max_payload_bytes=1 << 20).check(header_bytes, payload_bytes)
            assert 2 <= header_bytes <= 65536 and 0 <= payload_bytes <= 1 << 20
        except FrameError:
            pass
        cases += 1
    seeds = [json.dumps(VALID_HEADER).encode(), b'{"kind": "close"}', b"[]", b"null", b'{"token": "\\u00e9"}']
    raw_inputs = [m for seed in seeds for m in mutations(seed, rng, 1000)]
    raw_inputs += [json.dumps(random_document(rng)).encode() for _ in range(3000)]
    raw_inputs += [b"[" * 100_000, b'{"a":' * 50_000, "{}".encode("utf-16"), b"\xff" * 100, b"NaN", b'{"x": NaN}']
    for raw in raw_inputs:
        cases += 1
        try:
            offer = ReplicaOffer.from_header(parse_header(raw))
        except FrameError:
            continue
        accepted += 1
        assert offer.close or (offer.global_step >= 0 and offer.checksum.split(":")[0] in ("blake3", "sha256"))
    assert cases >= 10_000 and 0 < accepted < cases / 2, (cases, accepted)


@pytest.fixture(scope="module")
def snapshot_file() -> bytes:
    return snapshot_bytes(7, model={"w": __import__("torch").arange(64.0)})


def test_mutated_snapshot_files_never_pass_as_valid_and_fail_only_with_snapshot_errors(snapshot_file):
    rng = random.Random(7)
    original = verify(snapshot_file, "original")
    cases = 0
    for data in mutations(snapshot_file, rng, 3000):
        cases += 1
        try:
            seal = read_seal(data[:HEAD_BYTES], data[-TRAILER_BYTES:] if len(data) >= TRAILER_BYTES else data[:0],
                             len(data), "fuzzed")
        except SnapshotError:
            continue
        try:
            verified = verify(data, "fuzzed")
        except SnapshotError:
            continue
        # Only a mutation that left every checked byte as it was can pass (e.g. none at all).
        assert data == snapshot_file and verified == original == seal
    assert cases == 3000


def test_random_manifests_never_crash_the_store_or_lead_it_outside_its_directory(tmp_path, snapshot_file):
    store = SnapshotStore(tmp_path / "ck", keep_last=3)
    good = store.write(7, 0, 7, snapshot_file)
    outside = tmp_path / "secret.pt"
    outside.write_bytes(snapshot_file)
    rng = random.Random(99)
    files = [good.file, "../secret.pt", str(outside), "snapshot-000000008.pt", "snapshot-000000007-00000000.pt",
             "/dev/zero", "manifest.json", "", None, 7]
    cases = 0
    for _ in range(1500):
        entries = []
        for _ in range(rng.randint(0, 4)):
            entry = {"file": rng.choice(files), "global_step": rng.choice([7, 8, "7", -1, None, 2**70]),
                     "epoch": 0, "samples_consumed": rng.choice([0, 7, -5]),
                     "checksum": rng.choice([good.checksum, checksum_of(b"x"), "blake3:00", None]),
                     "size_bytes": rng.choice([good.size_bytes, 0, -1, 10**12, "big"]), "created_unix": 0.0}
            if rng.random() < 0.2:
                del entry[rng.choice(list(entry))]
            entries.append(entry if rng.random() > 0.1 else rng.choice(ODD_VALUES))
        document = {"format": rng.choice([1, 2, "2", None]), "snapshots": entries}
        raw = json.dumps(document).encode()
        if rng.random() < 0.2:
            raw = next(mutations(raw, rng, 1))
        (tmp_path / "ck" / MANIFEST_NAME).write_bytes(raw)
        found = store.latest_valid()
        cases += 1
        assert found is not None, "the valid snapshot file is never lost (the index falls back to the files)"
        entry, data = found
        assert data == snapshot_file and "/" not in entry.file and entry.file == good.file
        for item in entries:
            try:
                parsed = ManifestEntry.from_document(item)
            except (ValueError, KeyError, TypeError):
                continue
            assert "/" not in parsed.file and parsed.global_step >= 0
    assert cases == 1500


def test_a_trailer_that_announces_a_huge_payload_is_refused_without_reading_it(snapshot_file):
    tail = bytearray(snapshot_file[-TRAILER_BYTES:])
    struct.pack_into(">Q", tail, 0, 2**62)
    with pytest.raises(SnapshotError, match="does not close a complete snapshot"):
        read_seal(snapshot_file[:HEAD_BYTES], bytes(tail), len(snapshot_file), "fuzzed")
