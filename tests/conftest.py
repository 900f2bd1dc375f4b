"""Shared fixtures: local multi-node jobs that are always cleaned up."""

from __future__ import annotations

import os

import pytest

from elastic_ddp.audit import exactly_once_violations, read_entries
from elastic_ddp.local_cluster import LocalJob

# Each local node is one process of torch: one thread each keeps 2-core machines responsive.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def local_jobs(tmp_path):
    """Factory of `LocalJob`s in tmp_path; every node still running at the end is SIGKILLed."""
    jobs: list[LocalJob] = []

    def make(training_args, name="job", **kwargs) -> LocalJob:
        job = LocalJob(tmp_path / name, training_args, **kwargs)
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.stop()


def assert_exactly_once(job: LocalJob, dataset_size: int, epochs: int, global_batch_size: int) -> None:
    problems = exactly_once_violations(read_entries(job.audit_dir), dataset_size, epochs, global_batch_size)
    assert not problems, problems


def node_logs(job: LocalJob) -> str:
    return "\n".join(f"===== {node.name}\n{node.log_text()[-4000:]}" for node in job.nodes)
