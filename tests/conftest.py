"""Shared fixtures, and the two kinds of test.

- tests/unit: fast, in one process: no subprocess, no server, no signal to another process.
  `bash tests/run.sh tests/unit` (or `-m "not slow"`) runs them in well under a minute.
- tests/cluster: real torchrun agents as nodes on 127.0.0.1, a real etcd, real signals, CLI
  subprocesses. Every test there is marked `slow` here, whatever its file says.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from elastic_ddp.testbed.local_cluster import LocalJob
from tests.support.cluster import EXTRA_TRAINING_ARGS

pytest_plugins = ["elastic_ddp.testbed.etcd_server", "tests.support.network"]  # etcd servers; network beds

# Each local node is one process of torch: one thread each keeps 2-core machines responsive.
os.environ.setdefault("OMP_NUM_THREADS", "1")

CLUSTER_TESTS = Path(__file__).parent / "cluster"


@pytest.fixture(scope="session", autouse=True)
def suite_temporary_directory(tmp_path_factory):
    """TMPDIR, for every process the suite starts, is a directory of the suite's own, removed at the
    end. torchrun makes a log directory per agent (`torchelastic_*`, torch's default `--log-dir`)
    that torch never removes, and multiprocessing's directories (`pymp-*`) of killed processes stay:
    a fresh-clone run left about 108 and 25 of them in /tmp. This process keeps the temporary
    directory it had (`gettempdir()` is cached first): pytest's directories, where a failed test's
    logs outlive the run, and this process's own multiprocessing directory, which multiprocessing
    removes at exit, after this fixture."""
    tempfile.gettempdir()
    tmp_path_factory.getbasetemp()
    directory = tempfile.mkdtemp(prefix="elastic_ddp-suite-")
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = directory
    yield directory
    if before is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before
    shutil.rmtree(directory, ignore_errors=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if CLUSTER_TESTS in Path(item.fspath).parents:
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def local_jobs(tmp_path):
    """Factory of `LocalJob`s in tmp_path; every node still running at the end is SIGKILLed."""
    jobs: list[LocalJob] = []

    def make(training_args, name="job", **kwargs) -> LocalJob:
        job = LocalJob(tmp_path / name, [*training_args, *EXTRA_TRAINING_ARGS], **kwargs)
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.stop()


@pytest.fixture
def reference_runs(tmp_path):
    """Starts the uninterrupted reference run of an equivalence check (chaos/equivalence.py
    `run_reference`) in the background: `start(training_args)` returns a Future of its checkpoint
    directory, so that it trains while the test's job waits on its scenario (pass the job's own
    arguments, EXTRA_TRAINING_ARGS included where the job has them). Waited for at the end."""
    from elastic_ddp.chaos.equivalence import run_reference  # (imports torch: cluster tests only)

    pool = ThreadPoolExecutor(max_workers=2)

    def start(training_args, name: str = "reference") -> Future:
        return pool.submit(run_reference, tmp_path / name, list(training_args))

    yield start
    pool.shutdown(wait=True)
