"""Memory copies of a sharded state (snapshot/sharded/memory_*.py). With real gloo groups in forked
processes: each rank's part taken without a collective, the parts merged and resharded by DCP onto
another world size (2 -> 3, 3 -> 2), each rank reading only the parts it needs. In this process:
a missing part found before anything loads, an index that would run code refused, the ring of
buddies (on another node whenever there is one; a single node said once), and the choice of the
newest step whose parts are all there (else the reasons why not, which the session's fallback to
the durable snapshot reports). Three ranks as three nodes train sharded, and two neighbouring nodes
die together: the survivor falls back to the durable step and says why. The kill of a node that
loses no step: tests/cluster/test_sharded_cluster.py; one rank's: tests/unit/test_sharded_training.py.

    .venv/bin/python -m pytest -q tests/unit/test_sharded_memory.py
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from elastic_ddp.runlog.reader import read_events
from elastic_ddp.runlog.schema import EVENT_LOG_NAME
from elastic_ddp.runtime.distributed import DistributedContext
from elastic_ddp.snapshot.sharded.memory_checkpoint import MergedCheckpoint, PartWriter, read_index, save_part
from elastic_ddp.snapshot.sharded.memory_restore import agree_on_memory_state
from elastic_ddp.snapshot.sharded.memory_shards import PartExchangeError, ShardCopy, ShardMemory, make_copy
from elastic_ddp.snapshot.sharded.ring import copies_on_their_own_node, node_of_each_rank, ring_partners
from elastic_ddp.snapshot.sharded.safe_reader import UnsafeCheckpointError
from elastic_ddp.training.sharding import shard_model
from elastic_ddp.workload.models import IMAGE_SHAPE, MLP
from tests.support.training import Crash, crash_at, make_trainer, small_config

pytestmark = pytest.mark.timeout(120)


def _sharded_training_state():
    torch.manual_seed(0)
    model = shard_model(MLP())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, optimizer


def _tensors(model, optimizer):
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": {"state": optimizer_state["state"]}}, optimizer_state


def _full(tensors) -> dict[str, torch.Tensor]:
    flat = {}
    for name, value in tensors["model"].items():
        flat[f"model.{name}"] = value.full_tensor().clone()
    for name, value in tensors["optimizer"]["state"].items():
        flat[f"momentum.{name}"] = value["momentum_buffer"].full_tensor().clone()
    return flat


def _rank(rank: int, world_size: int, store_file: str, loads: str | None, saves: str) -> None:
    """Load the parts in `loads` (if any) resharded onto this world, check them against the saver's
    full state, then train one step (the first time) and save this world's parts into `saves`."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world_size)
    try:
        model, optimizer = _sharded_training_state()
        tensors, optimizer_state = _tensors(model, optimizer)
        if loads is None:
            model(torch.randn(8, *IMAGE_SHAPE)).sum().backward()  # a state with momentum buffers
            optimizer.step()
        else:
            parts = Path(loads)
            merged = MergedCheckpoint({int(path.name.split("-")[1]): path.read_bytes()
                                       for path in parts.glob("index-*")}, "test")
            assert merged.missing() == []
            needed = merged.needed_parts(tensors)
            (Path(saves) / f"needed-{rank}").write_text(",".join(map(str, sorted(needed))))
            merged.load(tensors, {part: (parts / f"data-{part}").read_bytes() for part in needed})
            set_state_dict(model, optimizer, model_state_dict=tensors["model"],
                           optim_state_dict={"state": tensors["optimizer"]["state"],
                                             "param_groups": optimizer_state["param_groups"]})
        tensors, _ = _tensors(model, optimizer)
        full = _full(tensors)
        if loads is not None:
            expected = torch.load(Path(loads) / "expected.pt", weights_only=True)
            assert full.keys() == expected.keys()
            for name, value in expected.items():
                assert torch.equal(full[name], value), name
        index, data = save_part(tensors)
        (Path(saves) / f"index-{rank}").write_bytes(index)
        (Path(saves) / f"data-{rank}").write_bytes(data)
        if rank == 0:
            torch.save(full, Path(saves) / "expected.pt")
    finally:
        dist.destroy_process_group()


def _run(world_size: int, loads: Path | None, saves: Path) -> list[set[int]]:
    """The parts each rank of the new world read."""
    saves.mkdir()
    # Forked from a server that imported torch and this module once: three spawns per test had
    # each rank import torch afresh (7 imports in all; 13-31 s on 2 cores).
    multiprocessing.set_forkserver_preload([__name__])
    mp.start_processes(_rank, args=(world_size, str(saves / "store"), loads and str(loads), str(saves)),
                       nprocs=world_size, start_method="forkserver", join=True)
    return [set(map(int, path.read_text().split(","))) for path in sorted(saves.glob("needed-*"))]


def test_memory_parts_reshard_from_2_to_3_and_from_3_to_2(tmp_path):
    _run(2, None, tmp_path / "by-2")
    needed = _run(3, tmp_path / "by-2", tmp_path / "by-3")  # each rank checked what it loaded
    assert len(needed) == 3 and set().union(*needed) == {0, 1}
    needed = _run(2, tmp_path / "by-3", tmp_path / "by-2-again")
    assert len(needed) == 2 and set().union(*needed) == {0, 1, 2}
    assert all(len(parts) < 3 for parts in needed)  # each rank read only the parts it owns chunks of


def _context(rank: int = 0, world_size: int = 1, local_world_size: int = 1) -> DistributedContext:
    return DistributedContext(rank=rank, local_rank=rank % local_world_size, world_size=world_size,
                              local_world_size=local_world_size, device=torch.device("cpu"), backend="gloo")


def test_a_part_is_planned_once_while_its_structure_holds():
    writer = PartWriter()
    first, data = writer.save({"w": torch.zeros(4, 2)})
    again, data_again = writer.save({"w": torch.ones(4, 2)})
    assert again is first and bytes(data_again) != bytes(data)  # the same index, the new values
    changes = ({"w": torch.ones(4, 3)}, {"w": torch.ones(4, 2, dtype=torch.float64)}, {"v": torch.ones(4, 2)},
               {"w": torch.ones(4, 2), "v": torch.arange(3)})  # a shape, a dtype, a name, one more tensor
    for changed in changes:
        index, data = writer.save(changed)
        assert index is not first
        loaded = {name: torch.empty_like(value) for name, value in changed.items()}
        MergedCheckpoint({0: index}, "test").load(loaded, {0: data})
        assert all(torch.equal(loaded[name], value) for name, value in changed.items())


def _half_covered_index() -> bytes:
    """The index of a part that holds the first half of a (4, 2) tensor, as a rank of two writes it."""
    index, _ = save_part({"w": torch.zeros(4, 2)})
    metadata = read_index(index, "test")
    metadata.state_dict_metadata["w"].chunks[0].sizes = torch.Size([2, 2])
    return pickle.dumps(metadata)


def test_a_missing_part_is_found_and_a_planted_index_refused(tmp_path):
    index, _ = save_part({"w": torch.zeros(4, 2)})
    assert MergedCheckpoint({0: index}, "test").missing() == []
    assert MergedCheckpoint({0: _half_covered_index()}, "test").missing() == ["w"]

    class Payload:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "ran"),))

    with pytest.raises(UnsafeCheckpointError, match=r"refers to posix\.system"):
        MergedCheckpoint({0: pickle.dumps(Payload())}, "test")
    assert not (tmp_path / "ran").exists()


def test_buddies_are_on_another_node_whenever_there_is_one(monkeypatch):
    two_by_two = [0, 0, 1, 1]  # the node of each rank: 2 nodes x 2 workers
    assert [ring_partners(rank, two_by_two) for rank in range(4)] == [(2, 2), (3, 3), (0, 0), (1, 1)]
    # 3 nodes of 2 ranks: rank 1 (node 0) sends to rank 3 (node 1) and receives from rank 5 (node 2)
    assert ring_partners(1, [0, 0, 1, 1, 2, 2]) == (3, 5)
    interleaved = [0, 1, 0, 1]  # the node decides (GROUP_RANK), not the order of the ranks
    assert all(interleaved[ring_partners(rank, interleaved)[0]] != interleaved[rank] for rank in range(4))
    for nodes in (two_by_two, interleaved, [0, 1], [0, 0, 1, 1, 2, 2], [0, 0, 1, 2]):
        assert copies_on_their_own_node(nodes) == 0, nodes
    assert ring_partners(0, [0, 0]) == (1, 1) and copies_on_their_own_node([0, 0]) == 2  # one node
    assert copies_on_their_own_node([0, 0, 0, 1]) == 2  # a node with 3 of 4 ranks: 2 copies cannot leave it
    assert ring_partners(0, [0]) is None
    monkeypatch.setenv("GROUP_RANK", "3")
    assert node_of_each_rank(_context()) == [3]


def _exchange(memory: ShardMemory, step: int, check=None) -> None:
    """This rank's part of `step` (a small tensor), its exchange started and its rest added, as the
    session does right after the commit."""
    index, data = save_part({"w": torch.full((4, 2), float(step))})
    memory.exchange(step, 0, index, data, check)
    memory.add_rest(step, lambda: b"rest")


def test_a_single_node_is_said_once(one_rank_gloo_group, tmp_path, caplog):
    memory = ShardMemory(_context(), tmp_path)
    with caplog.at_level(logging.WARNING, logger="elastic_ddp.snapshot.sharded.ring"):
        for step in (1, 2):
            _exchange(memory, step)
            memory.wait()
    said = [record.getMessage() for record in caplog.records if "memory copies of shards" in record.getMessage()]
    assert len(said) == 1 and "one rank alone keeps its part in this node's memory only" in said[0]
    assert "copy is on" not in said[0]  # there is no copy at world 1
    assert [copy.step for copy in memory.own] == [2]  # step 2 counted with its rest: step 1 dropped


def test_a_step_counts_once_its_exchange_ended_and_a_stop_meanwhile_keeps_the_step_before(tmp_path, caplog):
    """Step 2's exchange is held (its part's copy not done): step 1 is the one that counts, a stop
    then writes step 1 whole (with its rest) and nothing of step 2, and the restore takes step 1.
    Released, step 2 counts and step 1 is dropped."""
    memory = ShardMemory(_context(), tmp_path)
    _exchange(memory, 1)
    memory.wait()
    copied = threading.Event()
    _exchange(memory, 2, check=copied.wait)
    assert (memory.counted, memory.uncounted) == (1, 2)
    with caplog.at_level(logging.WARNING):
        memory.settle(0.05)
    assert "has not ended within 0.05 s: step 2 does not count" in caplog.text
    memory.keep()
    assert sorted(path.name.split("-")[1] for path in tmp_path.glob("shard-*")) == ["000000001"]
    chosen, refused, _ = agree_on_memory_state(ShardMemory(_context(), tmp_path), _context())
    assert chosen.step == 1 and chosen.rest == b"rest" and not refused
    copied.set()
    memory.wait()
    assert (memory.counted, memory.uncounted) == (2, None)
    assert [copy.step for copy in memory.own] == [2]


def test_an_exchange_that_failed_raises_on_the_training_thread_and_is_logged_as_training_stops(tmp_path, caplog):
    memory = ShardMemory(_context(), tmp_path)
    _exchange(memory, 1)
    memory.wait()

    def failed_copy() -> None:
        raise RuntimeError("the device copy failed")

    _exchange(memory, 2, check=failed_copy)
    with pytest.raises(PartExchangeError, match="the exchange of step 2's memory parts .* the device copy failed"):
        memory.wait()
    assert (memory.counted, memory.uncounted) == (1, 2)  # step 2 never counts
    memory.wait()  # raised once; nothing in flight any more
    _exchange(memory, 3, check=failed_copy)
    with caplog.at_level(logging.ERROR):
        memory.settle(5.0)  # as training stops: logged, not raised
    assert "the exchange of step 3's memory parts failed (step 3 does not count here): the device copy failed" \
        in caplog.text
    assert (memory.counted, [copy.step for copy in memory.own]) == (1, [1])


def _copy(step: int, part: int, world_size: int, rest: bytes = b"rest", incarnation: int = 0) -> ShardCopy:
    index, data = save_part({"w": torch.full((4, 2), float(step))})
    context = _context(part, world_size)
    return make_copy(step, incarnation, context, index, rest, data)


def test_the_newest_step_with_every_part_is_chosen_and_newer_incomplete_ones_refused(tmp_path):
    """Step 9: part 1 lost with its copy; step 8: every part there (one without the rest, as a
    buddy's copy is). The choice is 8, and 9 is refused with the parts that are missing."""
    memory = ShardMemory(_context(), tmp_path)
    memory.own = [_copy(8, 0, 2), _copy(9, 0, 2)]
    memory.held = [_copy(8, 1, 2, rest=b"")]
    assert memory.keep() == (3, sum(len(copy.to_bytes()) for copy in [*memory.own, *memory.held]))
    torn = tmp_path / _copy(7, 0, 2).file_name
    torn.write_bytes(_copy(7, 0, 2).to_bytes()[:-3])
    chosen, refused, stored = agree_on_memory_state(ShardMemory(_context(), tmp_path), _context())
    assert not torn.exists()  # a torn copy is refused and removed
    assert (chosen.step, chosen.world_size, chosen.holders, chosen.rest) == (8, 2, {0: 0, 1: 0}, b"rest")
    assert [(item["global_step"], item["source"]) for item in refused] == [(9, "memory")]
    assert "part(s) [1] of the 2 ranks that committed it are on no node" in refused[0]["reason"]
    assert sorted(stored) == [(8, 0, 0), (8, 0, 1), (9, 0, 0)]


def test_a_step_whose_parts_were_exchanged_but_never_counted_is_not_restored(tmp_path):
    memory = ShardMemory(_context(), tmp_path)
    memory.own = [_copy(5, 0, 2), _copy(6, 0, 2, rest=b"")]  # step 6 failed inside its commit
    memory.held = [_copy(5, 1, 2, rest=b""), _copy(6, 1, 2, rest=b"")]
    memory.keep()
    chosen, refused, _ = agree_on_memory_state(memory, _context())
    assert chosen.step == 5
    assert refused[0]["global_step"] == 6 and "never counted" in refused[0]["reason"]
    memory.forget()
    assert not list(tmp_path.iterdir())


def test_a_memory_state_that_does_not_fit_the_run_is_refused(tmp_path):
    memory = ShardMemory(_context(), tmp_path)
    memory.own = [_copy(3, 0, 1, rest=b"another run's")]
    memory.keep()

    def accept(rest: bytes, description: str) -> None:
        if rest == b"another run's":
            raise ValueError(f"{description}: another model")

    chosen, refused, _ = agree_on_memory_state(memory, _context(), accept)
    assert chosen is None
    assert refused == [{"source": "memory", "global_step": 3, "host": "",
                        "reason": "refused: the memory state of step 3: another model"}]


def test_a_damaged_copy_is_removed_and_named_in_the_refusal(tmp_path):
    memory = ShardMemory(_context(), tmp_path)
    memory.own = [_copy(7, 0, 1), _copy(8, 0, 1)]
    memory.keep()
    damaged = tmp_path / _copy(8, 0, 1).file_name
    raw = bytearray(damaged.read_bytes())
    raw[-1] ^= 0xFF
    damaged.write_bytes(bytes(raw))
    chosen, refused, _ = agree_on_memory_state(ShardMemory(_context(), tmp_path), _context())
    assert chosen.step == 7 and not damaged.exists()
    assert refused[0]["global_step"] == 8
    assert refused[0]["reason"].startswith("every copy of its parts was damaged; copies found damaged and removed: "
                                           "part 0 on rank 0's node: torn or damaged")


def _node(rank: int, world_size: int, store_file: str, run: str) -> None:
    """Rank `rank` of `world_size`, alone on node `rank` (GROUP_RANK, a memory directory of its own),
    trains sharded with memory copies until an injected crash after step 5 (all ranks at once)."""
    os.environ.update(OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0",
                      LOCAL_WORLD_SIZE="1", GROUP_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world_size)
    try:
        with pytest.raises(Crash):
            make_trainer(_three_node_config(Path(run), rank), after_step=crash_at(5)).fit()
    finally:
        dist.destroy_process_group()


def _three_node_config(run: Path, node: int):
    return small_config(run, sharding="fsdp", global_batch_size=24, micro_batch_size=8, watchdog_timeout_s=0,
                        memory_dir=str(run / f"node{node}"))


def test_two_neighbouring_nodes_lost_together_fall_back_to_the_durable_step(one_rank_gloo_group, tmp_path):
    """Nodes 0, 1, 2 (a rank each; each part's copy on the next node): nodes 0 and 1 die together
    after step 5, so part 0 (on nodes 0 and 1) is gone. Node 2 alone restarts from the durable step
    4 and the restore event says why the newer memory state was refused."""
    multiprocessing.set_forkserver_preload([__name__])
    mp.start_processes(_node, args=(3, str(tmp_path / "store"), str(tmp_path)), nprocs=3,
                       start_method="forkserver", join=True)
    kept = {int(path.name.split("-")[3].split("of")[0]) for path in (tmp_path / "node2").rglob("shard-000000005-*")}
    assert kept == {1, 2}  # its own part and node 1's copy: every copy went to another node
    survivor = _three_node_config(tmp_path, 2)
    with pytest.raises(Crash):
        make_trainer(survivor, after_step=crash_at(6)).fit()
    restore = next(e for e in read_events(tmp_path / "ck" / EVENT_LOG_NAME) if e["event"] == "restore")
    assert (restore["global_step"], restore["source"], restore["world_size"]) == (4, "file", 1)
    refusal = next(item for item in restore["refused"] if item["global_step"] == 5)
    assert refusal["source"] == "memory" and refusal["reason"].startswith(
        "part(s) [0] of the 3 ranks that committed it are on no node of this group (a part and its copy were both lost)")


class _Emitted:
    """An event log that only records what is emitted."""

    def __init__(self):
        self.events: list[tuple[str, dict]] = []

    def emit(self, kind, **fields) -> None:
        self.events.append((kind.name, fields))


def test_a_keep_after_a_peers_silence_waits_for_no_exchange(tmp_path, monkeypatch):
    """A re-form the watchdog handed over (a peer silent for its timeout) keeps at once: an exchange
    in flight then involves the silent peer and cannot end, and waiting SETTLE_S for it (2 s) added
    that much to every frozen node in sharded mode. The step before it is the one kept."""
    from elastic_ddp.snapshot.sharded import memory_session
    monkeypatch.setattr(memory_session, "SETTLE_S", 60.0)  # a keep that waited would not return in this test
    events = _Emitted()
    copies = memory_session.MemoryCopies(None, _context(), events)
    copies.memory = ShardMemory(_context(), tmp_path)
    _exchange(copies.memory, 1)
    copies.memory.wait()
    held = threading.Event()
    _exchange(copies.memory, 2, check=held.wait)
    keeping = threading.Thread(target=copies.keep, args=("peer watchdog: rank 1 silent",), kwargs={"settle": False})
    keeping.start()
    keeping.join(timeout=20)
    waited = keeping.is_alive()
    held.set()
    keeping.join(timeout=60)
    assert not waited, "the keep waited for the exchange in flight"
    assert sorted(path.name.split("-")[1] for path in tmp_path.glob("shard-*")) == ["000000001"]
    assert [(kind, fields["global_step"]) for kind, fields in events.events] == [("memory_copy", 1)]
