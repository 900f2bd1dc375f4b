"""The FSDP2 mesh follows `--device`, not the machine's accelerator.

Left to itself, `fully_shard` builds its mesh on `torch._C._get_accelerator()`: on a GPU machine a
`--device cpu --sharding fsdp` run had its parameters moved to cuda:0 and its first loss failed
("target is on cpu, different from other tensors on cuda:0", seen on an H200). Here the accelerator
is made to say cuda on a CPU machine: the old code then fails to build a CUDA mesh.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from elastic_ddp.training.sharding import shard_model
from elastic_ddp.workload.models import MLP

pytestmark = pytest.mark.timeout(60)


def test_a_cpu_model_is_sharded_over_a_cpu_mesh_whatever_the_accelerator(one_rank_gloo_group, monkeypatch):
    monkeypatch.setattr(torch._C, "_get_accelerator", lambda: torch.device("cuda"))
    model = shard_model(MLP())
    parameters = list(model.parameters())
    assert parameters and all(isinstance(p, DTensor) for p in parameters)
    assert {p.device_mesh.device_type for p in parameters} == {"cpu"}
    assert {p.to_local().device.type for p in parameters} == {"cpu"}
