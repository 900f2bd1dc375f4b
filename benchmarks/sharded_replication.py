"""What the copies of a sharded snapshot on node-local disks cost (snapshot/sharded/node_local.py).

    python -m benchmarks.sharded_replication                   # shared, local, local0, twice each
    python -m benchmarks.sharded_replication --modes local --repetitions 1

(run from the repository root, one job at a time on the machine). Two one-rank "nodes" (processes
with GROUP_RANK 0 and 1, real gloo through a file store, one thread each) train the MLP sharded
(`--sharding fsdp`) for 41 steps with a snapshot every 4 steps, in three modes: `shared` (one
checkpoint directory), `local` (a directory each, `--snapshot_replicas 1`: every file copied to the
other node) and `local0` (a directory each, no copies). Per mode it prints the median of the
`snapshot` events' `write_seconds` (DCP write, checksums, copies, commit: training waits for all of
it), of the `snapshot_replicated` events' `seconds`, and the bytes of the step's files.

Not measured: more than two nodes, other models, a real network (both nodes are this machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from elastic_ddp.config import TrainingConfig
from elastic_ddp.runlog.reader import read_events
from elastic_ddp.runlog.schema import EVENT_LOG_NAME
from elastic_ddp.training.trainer import Trainer
from elastic_ddp.workload.data import SyntheticImageDataset
from elastic_ddp.workload.models import build_model

MODES = ("shared", "local", "local0")


def _node(rank: int, run: Path, mode: str) -> None:
    os.environ.update(OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      GROUP_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{run}/store", rank=rank, world_size=2)
    try:
        config = TrainingConfig(
            sharding="fsdp", model="mlp", device="cpu", epochs=1, dataset_size=48 * 41, global_batch_size=48,
            micro_batch_size=8, snapshot_every_steps=4, watchdog_timeout_s=0, log_interval=1000,
            checkpoint_dir=str(run / ("ck" if mode == "shared" else f"ck{rank}")),
            memory_dir=str(run / f"memory{rank}"), snapshot_replicas=0 if mode == "local0" else 1)
        Trainer(model=build_model(config.model, config.seed),
                dataset=SyntheticImageDataset(config.dataset_size, config.seed), config=config).fit()
    finally:
        dist.destroy_process_group()


def measure(run: Path, mode: str) -> dict:
    run.mkdir(parents=True)
    mp.start_processes(_node, args=(run, mode), nprocs=2, start_method="spawn", join=True)
    directory = run / ("ck" if mode == "shared" else "ck0")
    events = list(read_events(directory / EVENT_LOG_NAME))
    writes = [event["write_seconds"] for event in events if event["event"] == "snapshot"]
    copies = [event["seconds"] for event in events if event["event"] == "snapshot_replicated"]
    newest = max(directory.glob("sharded-*"))
    return {"mode": mode, "snapshots": len(writes), "write_seconds_median": statistics.median(writes),
            "replicated": len(copies), "replication_seconds_median": statistics.median(copies) if copies else None,
            "files_of_node0": {path.name: path.stat().st_size for path in sorted(newest.iterdir())}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--repetitions", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as base:
        for repetition in range(args.repetitions):
            for mode in args.modes:
                print(json.dumps(measure(Path(base) / f"{mode}-{repetition}", mode)), flush=True)


if __name__ == "__main__":
    main()
