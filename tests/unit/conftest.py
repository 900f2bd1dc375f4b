"""Fixtures of the unit tests (one process, seconds; see tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture
def one_rank_gloo_group() -> Iterator[None]:
    """A real gloo process group of this process alone (rank 0 of 1), destroyed after the test.

    Its store is an in-process HashStore, so no port is chosen and two test runs on one machine
    cannot collide; gloo binds its own ephemeral port. Request it before `monkeypatch`, so that the
    patches are undone before the group is destroyed.
    """
    assert not dist.is_initialized(), "a process group from an earlier test is still initialised"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
