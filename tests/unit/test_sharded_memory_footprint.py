"""What the memory copies of shards and FSDP2 cost in memory (memory_shards.py, training/sharding.py).

Two ranks (real gloo, forked processes) take and exchange parts step after step, the exchanges on
their own thread and process group, as the commit does: while a step is exchanged the step before
is the one that counts (a failure then restores it); once the exchange ended and the rest was
added a rank holds its own part and its buddy's of that step only, and the same two buffers per
kind are reused (no new buffer per step); a step whose part is not finite on one rank drops
nothing. In a child process: glibc's mmap threshold fixed by `fix_mmap_threshold` hands a freed
16 MiB buffer back to the system, where the dynamic threshold (raised by a 24 MiB buffer freed
before, as FSDP2's gathers do) keeps it in the heap.

    .venv/bin/python -m pytest -q tests/unit/test_sharded_memory_footprint.py
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from elastic_ddp.runtime.distributed import DistributedContext
from elastic_ddp.snapshot.sharded.memory_checkpoint import PartWriter
from elastic_ddp.snapshot.sharded.memory_shards import ShardMemory
from elastic_ddp.training.sharding import fix_mmap_threshold

pytestmark = pytest.mark.timeout(120)

STEPS = 6
NOT_FINITE = (1, 4)  # (rank, step): this rank's part of this step holds a NaN
ELEMENTS = 4096  # per part: 16 KiB


def _address(data: memoryview) -> int:
    return torch.frombuffer(data, dtype=torch.uint8).data_ptr()


def _rank(rank: int, store_file: str, out: str) -> None:
    torch.set_num_threads(1)
    # DistributedContext.in_process_group asks for torchrun's variables; the group's store is a file
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2)
    try:
        context = DistributedContext(rank=rank, local_rank=rank, world_size=2, local_world_size=2,
                                     device=torch.device("cpu"), backend="gloo")
        memory, writer = ShardMemory(context, None), PartWriter()
        alive = []  # every part's buffer, so that no address is freed and handed out again
        seen: dict[str, list] = {"in_flight": [], "counted": [], "held_values": [], "own_buffers": [],
                                 "held_buffers": [], "views": []}

        def counted() -> None:  # as the next step's commit does first
            memory.wait()
            seen["counted"].append((memory.counted, [c.step for c in memory.own], [c.step for c in memory.held]))
            held = memory.held[-1]
            seen["held_values"].append((held.step, torch.frombuffer(held.data, dtype=torch.float32)[0].item()))
            alive.extend(c.data for c in (*memory.own, *memory.held))
            seen["own_buffers"].extend(_address(c.data) for c in memory.own)
            seen["held_buffers"].extend(_address(c.data) for c in memory.held)
            seen["views"].extend(id(c.data) for c in (*memory.own, *memory.held))

        for step in range(1, STEPS + 1):
            if step > 1:
                counted()
            value = float("nan") if (rank, step) == NOT_FINITE else float(100 * step + rank)
            index, data = writer.save({"w": torch.full((ELEMENTS,), value)}, memory.take_spare())
            finite = not math.isnan(value)
            memory.exchange(step, 0, index, data, lambda finite=finite: finite)
            seen["in_flight"].append((memory.counted, memory.uncounted))
            memory.add_rest(step, lambda: b"rest")
        counted()
        Path(out, f"rank-{rank}.json").write_text(json.dumps(seen))
    finally:
        dist.destroy_process_group()


def test_a_rank_holds_the_parts_of_the_step_that_counts_and_reuses_its_buffers(tmp_path):
    multiprocessing.set_forkserver_preload([__name__])
    mp.start_processes(_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, start_method="forkserver",
                       join=True)
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        # While step s is exchanged (on its thread) the step before counts; once it has ended, s counts.
        assert seen["in_flight"] == [[None, 1], [1, 2], [2, 3], [3, 4], [4, 5], [5, 6]]
        # (counted, own steps, held steps) once each step's exchange ended and its rest was added:
        # only that step's parts. Step 4: rank 1's part is not finite, so neither rank drops step 3
        # (the newest whole step stays), and the step counts all the same (its exchange ended).
        step_4 = [4, [3, 4], [3]] if rank == 0 else [4, [3], [3, 4]]
        assert seen["counted"] == [[1, [1], [1]], [2, [2], [2]], [3, [3], [3]], step_4, [5, [5], [5]], [6, [6], [6]]]
        partner = 1 - rank
        assert [step for step, _ in seen["held_values"]] == [1, 2, 3, 3 if rank == 0 else 4, 5, 6]
        for step, value in seen["held_values"]:
            assert value == 100 * step + partner
        # Every buffer is kept alive by the test, so a new one per step would have a new address:
        # two per kind, and a third after step 4, which dropped nothing.
        assert len(set(seen["own_buffers"])) <= 3, "own parts: a new buffer per step"
        assert len(set(seen["held_buffers"])) <= 3, "received parts: a new buffer per step"
        assert len(set(seen["views"])) <= 6, "a new view of a reused buffer per step (views of views chain)"


CHILD = textwrap.dedent("""
    import ctypes, json, sys
    from elastic_ddp.training.sharding import fix_mmap_threshold

    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    MIB = 2**20

    def rss():
        return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS:")) * 1024

    fixed = fix_mmap_threshold() if sys.argv[1] == "fixed" else None
    big = libc.malloc(24 * MIB); ctypes.memset(big, 1, 24 * MIB); libc.free(big)  # a block's gather
    pointer = libc.malloc(16 * MIB); ctypes.memset(pointer, 1, 16 * MIB)  # the next, smaller one
    before = rss(); libc.free(pointer)
    json.dump({"set": fixed, "returned": before - rss()}, sys.stdout)
""")


def _freed_and_returned(how: str) -> dict:
    environment = {key: value for key, value in os.environ.items() if key != "MALLOC_MMAP_THRESHOLD_"}
    return json.loads(subprocess.run([sys.executable, "-c", CHILD, how], capture_output=True, text=True, timeout=60,
                                     check=True, env=environment, cwd=Path(__file__).resolve().parents[2]).stdout)


def test_a_fixed_mmap_threshold_hands_a_freed_gather_back_to_the_system():
    fixed, dynamic = _freed_and_returned("fixed"), _freed_and_returned("dynamic")
    assert fixed["set"] is True
    assert fixed["returned"] >= 15 * 2**20  # the 16 MiB went back to the system
    assert dynamic["returned"] < 8 * 2**20  # the control: without the fix it stays in the heap


def test_a_threshold_the_user_set_is_left_alone(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert fix_mmap_threshold() is False
