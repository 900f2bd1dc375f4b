"""Snapshots made by hand, for tests of the store, the writer and the tools."""

from __future__ import annotations

import io
from typing import Any

import torch

from elastic_ddp.snapshot.serialization import snapshot_to_bytes
from elastic_ddp.snapshot.training_state import Snapshot


def make_snapshot(step: int, *, epoch: int = 0, samples_consumed: int | None = None, world_size: int = 1,
                  model: dict[str, Any] | None = None, fingerprint: dict[str, Any] | None = None,
                  incarnation: int = 1, **components: Any) -> Snapshot:
    """A snapshot of `step` whose model is `model` (a 4x4 tensor holding the step by default)."""
    states = {"model": model if model is not None else {"weight": torch.full((4, 4), float(step))},
              "optimizer": {}, "scheduler": None, "grad_scaler": None,
              "sampler": {"epoch": epoch, "samples_consumed": step if samples_consumed is None else samples_consumed},
              "progress": {"global_step": step}, **components}
    return Snapshot(states=states, rng_per_rank=[], fingerprint=fingerprint or {}, world_size=world_size,
                    incarnation=incarnation, wall_time=0.0)


def snapshot_bytes(step: int, **kwargs: Any) -> bytes:
    return snapshot_to_bytes(make_snapshot(step, **kwargs))


def v1_snapshot_bytes(step: int) -> bytes:
    """A format-1 snapshot file as versions before 0.2 wrote it (torch.save of one plain dict)."""
    buffer = io.BytesIO()
    torch.save({"global_step": step, "epoch": 0, "samples_consumed": step,
                "model": {"weight": torch.full((4, 4), float(step))}, "optimizer": {}, "scheduler": None,
                "grad_scaler": None, "rng_per_rank": [], "fingerprint": {}, "world_size": 1, "incarnation": 1,
                "wall_time": 0.0, "extra": {}, "format_version": 1}, buffer)
    return buffer.getvalue()
