"""The snapshot writer against the disk's own bandwidth, and the checksum candidates it could use.

    python -m benchmarks.checksums                    # 100 MB and 1 GB, 5 repetitions (about 3 minutes)
    python -m benchmarks.checksums --quick            # 10 MB, one repetition
    python -m benchmarks.checksums --dir /mnt/local-ssd/bench --sizes_mb 100 1000

(run from the repository root). Two measurements, each interleaved (the order rotates every
repetition so that a drift in machine load falls on every candidate alike):

- **Hashing alone**: MB/s of each checksum candidate over the same in-memory buffer
  (`--hash_mb`, default 256 MB), fed in 64 MiB updates: sha256 (hashlib, the format-1 checksum),
  BLAKE3 on one thread (`blake3`, the default since format 2) and on all cores, xxh3-128
  (`xxhash`) and crc32c (`google-crc32c`, whose binding takes only `bytes`: the copy counts).
  The last two are optional (`pip install xxhash google-crc32c`); a candidate whose module is
  missing is reported as not measured.
- **The writer against the disk**: for each size, the real write path of a snapshot
  (`elastic_ddp.snapshot.serialization.write_snapshot`'s frame: header, `torch.save` of the tensors
  streamed through the checksum, trailer; through `LocalDirectoryStorage.write_stream_atomically`:
  temporary file, fsync, rename, fsync of the directory) with BLAKE3 and with sha256, against a
  plain write + fsync of the same number of bytes in the same directory (`benchmarks.disk`),
  measured right before each writer run. The ratio is writer bandwidth over disk bandwidth, paired
  per repetition; the goal (issue 17) is >= 0.8 for 100 MB and 1 GB snapshots (smaller ones are
  shown without it: they end before early writeback, every 16 MiB, comes into play).

What is not in the writer figure: the copy of the live state into the staging buffers (the
training thread's part, `benchmarks.snapshot_sweep`), the manifest update and pruning (one small
file, one unlink).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/checksums.py`: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.disk import sequential_write_mb_per_s  # noqa: E402
from benchmarks.table import Row, render_markdown  # noqa: E402

UPDATE_BYTES = 64 * 2**20
WRITER_GOAL = ">= 0.8"


def _blake3(threads: int | None) -> Callable[[], object] | None:
    try:
        import blake3
    except ImportError:
        return None
    return lambda: blake3.blake3(max_threads=blake3.blake3.AUTO if threads is None else threads)


def _xxh3() -> Callable[[], object] | None:
    try:
        import xxhash
    except ImportError:
        return None
    return xxhash.xxh3_128


class _Crc32c:
    def __init__(self, module):
        self._checksum = module.Checksum()

    def update(self, data) -> None:
        self._checksum.update(bytes(data) if isinstance(data, memoryview) else data)

    def digest(self) -> bytes:
        return self._checksum.digest()


def _crc32c() -> Callable[[], object] | None:
    try:
        import google_crc32c
    except ImportError:
        return None
    if google_crc32c.implementation != "c":
        return None  # the pure-Python fallback is not a candidate
    return lambda: _Crc32c(google_crc32c)


def hash_candidates() -> dict[str, Callable[[], object] | None]:
    """Name -> factory of a running hash (None where its module is missing)."""
    return {"sha256": hashlib.sha256, "blake3, 1 thread": _blake3(1), "blake3, all cores": _blake3(None),
            "xxh3-128": _xxh3(), "crc32c": _crc32c()}


def hash_mb_per_s(factory: Callable[[], object], buffer: memoryview) -> float:
    hasher = factory()
    started = time.perf_counter()
    for start in range(0, len(buffer), UPDATE_BYTES):
        hasher.update(buffer[start:start + UPDATE_BYTES])
    hasher.digest()
    return len(buffer) / 1e6 / (time.perf_counter() - started)


def measure_hashing(size_mb: int, repetitions: int, progress: Callable[[str], None]) -> dict[str, list[float]]:
    buffer = memoryview(os.urandom(size_mb * 10**6))
    candidates = {name: factory for name, factory in hash_candidates().items() if factory is not None}
    results: dict[str, list[float]] = {name: [] for name in candidates}
    names = list(candidates)
    for repetition in range(repetitions):
        shift = repetition % len(names)
        for name in names[shift:] + names[:shift]:
            results[name].append(hash_mb_per_s(candidates[name], buffer))
            progress(f"hash {name} #{repetition + 1}: {results[name][-1]:.0f} MB/s")
    for name, factory in hash_candidates().items():
        if factory is None:
            progress(f"hash {name}: not measured (its module is not installed)")
    return results


def tensors_of(size_mb: int) -> dict[str, object]:
    """Random fp32 tensors totalling `size_mb` MB, in 16 parts (as a model's parameters would be)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    elements = size_mb * 10**6 // 4
    parts = 16
    return {f"layer{index}.weight": torch.rand(elements // parts, generator=generator) for index in range(parts)}


def writer_mb_per_s(directory: Path, tensors: dict[str, object], algorithm: str) -> float:
    """MB/s of the real snapshot write path for `tensors` (frame, checksum, atomic durable write)."""
    import torch

    from elastic_ddp.snapshot.files.file_layout import SnapshotHeader, write_framed
    from elastic_ddp.snapshot.files.backends import LocalDirectoryStorage

    storage = LocalDirectoryStorage(directory)
    header = SnapshotHeader(global_step=1, epoch=0, samples_consumed=0, world_size=1, incarnation=0,
                            wall_time=time.time(), fingerprint={}, components=("model",))
    name = f"bench-{algorithm}.pt"
    seals = []
    started = time.perf_counter()
    storage.write_stream_atomically(
        name, lambda file: seals.append(write_framed(file, header, lambda s: torch.save(tensors, s), algorithm)))
    seconds = time.perf_counter() - started
    storage.delete(name)
    return seals[0].size_bytes / 1e6 / seconds


def measure_writer(directory: Path, sizes_mb: list[int], repetitions: int,
                   progress: Callable[[str], None]) -> list[Row]:
    rows = []
    for size_mb in sizes_mb:
        tensors = tensors_of(size_mb)
        figures: dict[str, list[float]] = {"blake3": [], "sha256": []}
        disk: dict[str, list[float]] = {"blake3": [], "sha256": []}
        for repetition in range(repetitions):
            order = ["blake3", "sha256"] if repetition % 2 == 0 else ["sha256", "blake3"]
            for algorithm in order:
                disk[algorithm].append(sequential_write_mb_per_s(directory, max(1, size_mb * 10**6 // 2**20)))
                figures[algorithm].append(writer_mb_per_s(directory, tensors, algorithm))
                progress(f"writer {size_mb} MB {algorithm} #{repetition + 1}: {figures[algorithm][-1]:.0f} MB/s, "
                         f"disk {disk[algorithm][-1]:.0f} MB/s")
        for algorithm in ("blake3", "sha256"):
            which = "the default" if algorithm == "blake3" else "format 1"
            rows.append(Row("snapshot writer", f"{size_mb} MB snapshot with {algorithm}, {which}: MB/s",
                            figures[algorithm], disk[algorithm], "disk: write + fsync",
                            target=WRITER_GOAL if algorithm == "blake3" and size_mb >= 100 else ""))
        del tensors
    return rows


def hashing_rows(results: dict[str, list[float]]) -> list[Row]:
    """Each candidate's MB/s against sha256's (the format-1 checksum), medians."""
    baseline = results["sha256"]
    return [Row("checksum", f"{name}: MB/s hashing alone", figures, baseline, "sha256", paired=False)
            for name, figures in results.items() if name != "sha256"]


def measure(sizes_mb: list[int], repetitions: int, hash_mb: int, directory: Path,
            progress: Callable[[str], None] = print) -> list[Row]:
    rows = hashing_rows(measure_hashing(hash_mb, repetitions, progress))
    return rows + measure_writer(directory, sizes_mb, repetitions, progress)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.checksums", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="10 MB, one repetition, 32 MB hashed")
    parser.add_argument("--sizes_mb", type=int, nargs="+", default=None, help="snapshot sizes (default 100 1000)")
    parser.add_argument("--repetitions", type=int, default=None, help="default: 1 with --quick, else 5")
    parser.add_argument("--hash_mb", type=int, default=None, help="buffer hashed per candidate (default 256)")
    parser.add_argument("--dir", type=Path, default=None, help="where the files go (default: a temporary directory)")
    args = parser.parse_args(argv)
    for name in ("repetitions", "hash_mb"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name} {getattr(args, name)}: expected a positive integer")
    if args.sizes_mb is not None and min(args.sizes_mb) < 1:
        parser.error(f"--sizes_mb {args.sizes_mb}: expected positive sizes in MB")
    sizes = args.sizes_mb or ([10] if args.quick else [100, 1000])
    repetitions = args.repetitions or (1 if args.quick else 5)
    hash_mb = args.hash_mb or (32 if args.quick else 256)
    with tempfile.TemporaryDirectory(prefix="checksums-", dir=args.dir) as directory:
        rows = measure(sizes, repetitions, hash_mb, Path(directory),
                       progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(render_markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
