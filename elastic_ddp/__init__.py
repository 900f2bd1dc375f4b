"""elastic_ddp: elastic, fault-tolerant training for PyTorch DDP under torchrun.

The public API is imported lazily: torchrun imports this package at start-up (for the etcd-v3
plugin), and that must stay cheap and must not fail.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["ElasticRun", "LoopContractError", "Trainer", "TrainingConfig", "load_snapshot", "run_worker",
           "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("ElasticRun", "LoopContractError"):
        from elastic_ddp.training import elastic_run
        return getattr(elastic_run, name)
    if name == "Trainer":
        from elastic_ddp.training.trainer import Trainer
        return Trainer
    if name == "TrainingConfig":
        from elastic_ddp.config import TrainingConfig
        return TrainingConfig
    if name == "run_worker":
        from elastic_ddp.training.worker_main import run_worker
        return run_worker
    if name == "load_snapshot":
        from elastic_ddp.snapshot.loading import load_snapshot
        return load_snapshot
    raise AttributeError(f"module 'elastic_ddp' has no attribute {name!r}")
