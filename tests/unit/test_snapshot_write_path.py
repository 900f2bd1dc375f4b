"""The fast write path: chunks hashed while they are written, early writeback, same bytes and checksum."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from elastic_ddp.snapshot.files import file_layout, writeback
from elastic_ddp.snapshot.files.backends import LocalDirectoryStorage
from elastic_ddp.snapshot.files.checksum import checksum_of
from elastic_ddp.snapshot.files.file_layout import SnapshotHeader, verify, write_framed

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


def test_a_snapshot_is_saved_without_torchs_zip_crc32_and_the_option_is_left_as_it_was(tmp_path):
    """The frame's checksum covers every byte; torch.load never checks the CRC32 records, which cost
    a pass of their own over the state (0.24 s per GB) inside every memory copy a stopping worker keeps."""
    import io
    import zipfile

    import torch

    from elastic_ddp.snapshot.serialization import snapshot_from_bytes, snapshot_to_bytes
    from tests.support.snapshots import make_snapshot

    if not hasattr(torch.serialization, "set_crc32_options"):
        pytest.skip("this torch always computes the CRC32 (before 2.5)")
    before = torch.serialization.get_crc32_options()
    data = snapshot_to_bytes(make_snapshot(4, model={"w": torch.arange(1000.0)}))
    assert torch.serialization.get_crc32_options() == before
    seal = verify(data, "s.pt")
    payload = zipfile.ZipFile(io.BytesIO(data[seal.payload_start:seal.payload_start + seal.payload_bytes]))
    records = [info for info in payload.infolist() if info.file_size]
    assert records and all(info.CRC == 0 for info in records)
    assert torch.equal(snapshot_from_bytes(data, "s.pt").states["model"]["w"], torch.arange(1000.0))


@pytest.mark.parametrize("size", [0, 1, 8 * 2**20 + 3])
def test_a_hash_over_every_core_is_the_same_checksum(size):
    from elastic_ddp.snapshot.files.checksum import new_hasher

    data = os.urandom(size)
    one, every = new_hasher(), new_hasher(all_cores=True)
    one.update(data)
    every.update(memoryview(data))
    assert one.hexdigest() == every.hexdigest()


@pytest.mark.parametrize("fingerprint_chars", [0, 1, 17, 63, 500])
def test_the_payload_starts_aligned_whatever_the_headers_length(fingerprint_chars):
    header = SnapshotHeader(3, 0, 96, 2, 1, 1.5, {"model": "m" * fingerprint_chars}, ("model",))
    import io

    buffer = io.BytesIO()
    seal = write_framed(buffer, header, lambda file: file.write(b"payload"))
    assert seal.payload_start % file_layout.PAYLOAD_ALIGNMENT == 0
    assert verify(buffer.getvalue(), "s.pt").header == header  # the padding is JSON whitespace


def test_a_file_written_before_the_padding_still_restores(monkeypatch):
    """Older files start their payload anywhere: their model's records are copied out, not viewed."""
    import torch

    from elastic_ddp.snapshot.serialization import snapshot_from_bytes, snapshot_to_bytes
    from tests.support.snapshots import make_snapshot

    monkeypatch.setattr(file_layout, "PAYLOAD_ALIGNMENT", 1)
    data = bytearray(snapshot_to_bytes(make_snapshot(5, model={"w": torch.arange(64.0)}, fingerprint={"k": "xyz"})))
    monkeypatch.undo()
    assert verify(bytes(data), "old.pt").payload_start % 16 != 0
    restored = snapshot_from_bytes(data, "old.pt", model_as_views=True)
    assert torch.equal(restored.states["model"]["w"], torch.arange(64.0))
    assert restored.states["model"]["w"].data_ptr() % 16 == 0
