"""`--compile`: the training step runs through torch.compile around DDP (a real one-rank gloo
group, so DDP's DDPOptimizer and `no_sync` over two micro-batches are on the path), snapshots keep
the model's own parameter names, and a run interrupted and resumed equals an eager uninterrupted one.

The backend here is aot_eager (the graphs traced and run through AOTAutograd, without inductor's
code generation): inductor's first compile of this MLP takes 22 s on a 2-core machine (4 s with its
on-disk cache warm), too long for the unit suite; docs/custom-model.md has those figures.

    .venv/bin/python -m pytest -q tests/unit/test_compile.py
"""

from __future__ import annotations

import functools

import pytest
import torch

from elastic_ddp import load_snapshot
from tests.support.training import Crash, crash_at, make_trainer, small_config


@pytest.fixture
def compiled_with_aot_eager(monkeypatch):
    calls: list[torch.nn.Module] = []
    real = torch.compile

    def compile_(module, **kwargs):
        calls.append(module)
        return real(module, **{**kwargs, "backend": "aot_eager"})

    monkeypatch.setattr(torch, "compile", functools.wraps(real)(compile_))
    yield calls
    torch._dynamo.reset()


def test_a_compiled_run_resumes_to_the_eager_runs_parameters(one_rank_gloo_group, monkeypatch, tmp_path,
                                                             compiled_with_aot_eager):
    # What torchrun gives a worker: the trainer then wraps the model in DDP over the group.
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    eager = small_config(tmp_path / "eager", watchdog_timeout_s=0)  # its heartbeats would need a TCPStore
    make_trainer(eager).fit()
    compiled = small_config(tmp_path / "compiled", compile=True, watchdog_timeout_s=0)
    with pytest.raises(Crash):
        make_trainer(compiled, after_step=crash_at(5)).fit()
    make_trainer(compiled).fit()
    assert len(compiled_with_aot_eager) == 2
    assert all(isinstance(module, torch.nn.parallel.DistributedDataParallel) for module in compiled_with_aot_eager)
    expected, got = load_snapshot(eager.checkpoint_dir), load_snapshot(compiled.checkpoint_dir)
    assert got["global_step"] == expected["global_step"] == 12
    assert got["model"].keys() == expected["model"].keys()  # no _orig_mod. prefix
    for name, value in expected["model"].items():
        torch.testing.assert_close(got["model"][name], value, rtol=0, atol=1e-6)


def test_a_compiled_sharded_run_equals_the_eager_unsharded_one(one_rank_gloo_group, tmp_path, compiled_with_aot_eager):
    eager = small_config(tmp_path / "eager")
    make_trainer(eager).fit()
    compiled = small_config(tmp_path / "compiled", compile=True, sharding="fsdp")
    make_trainer(compiled).fit()
    assert len(compiled_with_aot_eager) == 1
    expected, got = load_snapshot(eager.checkpoint_dir)["model"], load_snapshot(compiled.checkpoint_dir)["model"]
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-6)
