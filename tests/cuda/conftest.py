"""Tests that need a CUDA GPU: every test here is skipped where torch sees none.

On a GPU machine, `bash tests/run_cuda.sh` runs them, the unit suite on that machine, and a
selection of the cluster tests with every node's workers on the GPU (docs/operations.md).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Bit-identical reruns on CUDA need deterministic cuBLAS workspaces, chosen before cuBLAS starts.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

CUDA_TESTS = Path(__file__).parent
NO_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bash tests/run_cuda.sh there)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if CUDA_TESTS in Path(item.fspath).parents:
            item.add_marker(NO_GPU)


@pytest.fixture
def deterministic_cuda():
    """cuDNN and torch restricted to deterministic kernels for the test, as before afterwards."""
    before = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
              torch.are_deterministic_algorithms_enabled())
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    torch.use_deterministic_algorithms(True)
    yield
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[:2]
    torch.use_deterministic_algorithms(before[2])


@pytest.fixture
def one_rank_nccl_group():
    """A real NCCL process group of this process alone on GPU 0, destroyed after the test; the store
    is an in-process HashStore (no port)."""
    import torch.distributed as dist

    assert not dist.is_initialized(), "a process group from an earlier test is still initialised"
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
