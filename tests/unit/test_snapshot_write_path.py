"""The fast write path: chunks hashed while they are written, early writeback, same bytes and checksum."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from elastic_ddp.snapshot.files import file_layout, writeback
from elastic_ddp.snapshot.files.checksum import checksum_of
from elastic_ddp.snapshot.files.file_layout import SnapshotHeader, verify, write_framed
from elastic_ddp.snapshot.files.backends import LocalDirectoryStorage

HEADER = SnapshotHeader(global_step=3, epoch=0, samples_consumed=96, world_size=2, incarnation=1, wall_time=1.5,
                        fingerprint={"model": "mlp"}, components=("model",))


def chunks() -> list[bytes]:
    """Small and large chunks, so that both ways through the hashing writer are taken."""
    return [os.urandom(100), os.urandom(3 * file_layout.PARALLEL_HASH_BYTES + 7), os.urandom(10),
            os.urandom(file_layout.PARALLEL_HASH_BYTES), os.urandom(5 * 2**20)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("algorithm", ["blake3", "sha256"])
def test_large_chunks_hashed_alongside_the_write_give_the_sequential_checksum(tmp_path, algorithm):
    parts = chunks()
    storage = LocalDirectoryStorage(tmp_path)
    seals = []

    def payload(file) -> None:
        for part in parts:
            assert file.write(memoryview(part)) == len(part)

    storage.write_stream_atomically("s.pt", lambda file: seals.append(write_framed(file, HEADER, payload, algorithm)))
    data = (tmp_path / "s.pt").read_bytes()
    seal = verify(data, "s.pt")  # recomputes the checksum in one sequential pass
    assert seal == seals[0] and seal.payload_bytes == sum(map(len, parts))
    assert seal.checksum.startswith(f"{algorithm}:")
    prefix = data[:len(data) - file_layout.TRAILER_BYTES]
    assert seal.checksum == checksum_of(prefix, algorithm)
    assert not [thread for thread in threading.enumerate() if thread.name.startswith("snapshot-hash")]


@pytest.mark.timeout(60)
def test_a_failing_payload_stops_the_hashing_helper_and_leaves_no_file(tmp_path):
    storage = LocalDirectoryStorage(tmp_path)

    def payload(file) -> None:
        file.write(os.urandom(2 * file_layout.PARALLEL_HASH_BYTES))
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        storage.write_stream_atomically("s.pt", lambda file: write_framed(file, HEADER, payload))
    assert list(tmp_path.iterdir()) == []
    assert not [thread for thread in threading.enumerate() if thread.name.startswith("snapshot-hash")]


@pytest.mark.timeout(60)
def test_writeback_is_started_for_every_range_and_never_past_what_was_written(tmp_path, monkeypatch):
    started: list[tuple[int, int]] = []
    monkeypatch.setattr(writeback, "start_writeback", lambda fd, offset, length: started.append((offset, length)))
    data = os.urandom(40 * 2**20 + 5)
    LocalDirectoryStorage(tmp_path).write_stream_atomically(
        "s.pt", lambda file: [file.write(memoryview(data)[start:start + 3 * 2**20])
                              for start in range(0, len(data), 3 * 2**20)])
    assert (tmp_path / "s.pt").read_bytes() == data
    # contiguous ranges from 0, each at least WRITEBACK_BYTES, none beyond the bytes written
    assert [offset for offset, _ in started] == [sum(length for _, length in started[:i]) for i in range(len(started))]
    assert len(started) == 2 and all(length >= writeback.WRITEBACK_BYTES for _, length in started)
    assert sum(length for _, length in started) <= len(data)


@pytest.mark.timeout(30)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
def test_the_real_writeback_call_is_available_on_linux_and_harmless(tmp_path):
    assert writeback.available()
    path = tmp_path / "f"
    with open(path, "wb", buffering=0) as handle:
        handle.write(b"x" * 4096)
        writeback.start_writeback(handle.fileno(), 0, 4096)
        writeback.start_writeback(handle.fileno(), 0, 0)  # nothing to do
    writeback.start_writeback(-1, 0, 4096)  # a bad descriptor is ignored: the fsync reports real errors
    assert path.read_bytes() == b"x" * 4096
