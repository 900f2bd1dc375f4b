"""The CUDA-specific paths: device selection, the process-group backend, pinned loader batches, and
snapshot captures that race the training stream's queued work.

    bash tests/run_cuda.sh tests/cuda/test_cuda_paths.py
"""

from __future__ import annotations

import pytest
import torch

from elastic_ddp.runtime.distributed import DistributedContext
from elastic_ddp.snapshot.files.snapshot_store import SnapshotStore
from elastic_ddp.snapshot.serialization import snapshot_from_bytes
from elastic_ddp.training.trainer import Trainer
from elastic_ddp.workload.data import EpochSampleView, SyntheticImageDataset, plan_loader
from elastic_ddp.workload.sampler import ElasticSampler
from tests.support.training import make_trainer, small_config


def test_local_rank_n_trains_on_gpu_n_and_gloo_lets_ranks_share_a_gpu(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    context = DistributedContext.from_env("cuda")
    assert context.device == torch.device("cuda", 0) and context.backend == "nccl"
    assert context.collective_device == context.device
    gpus = torch.cuda.device_count()
    monkeypatch.setenv("LOCAL_RANK", str(gpus))  # one rank more than this node has GPUs
    shared = DistributedContext.from_env("cuda", "gloo")
    assert shared.backend == "gloo" and shared.device == torch.device("cuda", 0)
    assert shared.collective_device == torch.device("cpu")
    with pytest.raises(ValueError, match=r"^--nproc_per_node: local rank \d+ has no GPU of its own \(this node has "
                                         r"\d+\); expected at most one process per GPU under nccl, or --dist_backend gloo$"):
        DistributedContext.from_env("cuda")


def test_loader_batches_arrive_pinned_from_worker_processes():
    dataset = SyntheticImageDataset(64, seed=0)
    view = EpochSampleView(dataset, seed=0, transform=None)
    sampler = ElasticSampler(len(dataset), global_batch_size=16, seed=0)
    plans = sampler.plan_epoch_remainder(0, 1, 8)
    batches = list(plan_loader(view, 0, plans, num_workers=2, pin_memory=True))
    assert batches and all(tensor.is_pinned() for batch in batches for tensor in batch)
    on_device = [tensor.to("cuda", non_blocking=True) for tensor in batches[0]]
    torch.cuda.synchronize()
    assert all(torch.equal(a.cpu(), b) for a, b in zip(on_device, batches[0]))


def test_every_snapshot_holds_exactly_the_committed_step_despite_non_blocking_copies(tmp_path):
    """A snapshot after every step, captured through pinned staging with non_blocking copies while
    the next step's work is queued: each must equal the parameters right after its step."""
    config = small_config(tmp_path, device="cuda", model="mini_resnet", snapshot_every_steps=1, keep_last=100,
                          use_amp=True)
    committed: dict[int, dict[str, torch.Tensor]] = {}

    def remember(trainer: Trainer) -> None:
        # .cpu() waits for the step's kernels; the snapshot's copy did not wait for this.
        committed[trainer.global_step] = {name: value.detach().cpu().clone()
                                          for name, value in trainer.model.state_dict().items()}
    make_trainer(config, after_step=remember).fit()

    store = SnapshotStore(config.checkpoint_dir)
    entries = store.manifest_entries()
    assert len(entries) == len(committed) == config.epochs * config.steps_per_epoch
    for entry in entries:
        snapshot = snapshot_from_bytes(store.read_verified(entry), entry.file)
        for name, value in committed[snapshot.global_step].items():
            assert torch.equal(snapshot.states["model"][name], value), (snapshot.global_step, name)
