"""`python -m elastic_ddp.train` refuses a bad flag with one line before anything is written (no
process group, no file), whatever the flag: a number that is not finite, a path that is a file,
CUDA where there is none. The refused commands run side by side (`refusals`): each one spends its
time importing torch, and the tests read their results."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

NO_CUDA = ("--device", "cuda", "--device: got 'cuda', but CUDA is not available here; expected auto or cpu")
BAD_VALUES = [
    ("--weight_decay", "nan", "--weight_decay: got nan; expected a finite number"),
    ("--lr", "inf", "--lr: got inf; expected a finite number"),
    ("--collective_timeout_s", "inf", "--collective_timeout_s: got inf; expected a finite number"),
    ("--checkpoint_dir", "{file}", "--checkpoint_dir: got '{file}', but '{file}' is a file; expected a directory"),
    *([] if torch.cuda.is_available() else [NO_CUDA]),  # (with CUDA, that command would train)
]
BAD_FLAG = ("--keep_last", "1")


def _train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "elastic_ddp.train", *args], capture_output=True, text=True,
                          timeout=100, check=False)


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    """{(flag, value): (its directory, a Future of its CompletedProcess)}: every command of this
    module, started at once, each in a directory of its own: BAD_FLAG's is its empty
    --checkpoint_dir; each of BAD_VALUES' holds a file, notes.txt, and its --checkpoint_dir is ck."""
    started = {}
    with ThreadPoolExecutor(max_workers=1 + len(BAD_VALUES)) as pool:
        directory = tmp_path_factory.mktemp("refused")
        started[BAD_FLAG] = directory, pool.submit(_train, *BAD_FLAG, "--checkpoint_dir", str(directory))
        for flag, value, _ in BAD_VALUES:
            directory = tmp_path_factory.mktemp("refused")
            a_file = directory / "notes.txt"
            a_file.write_text("x")
            started[(flag, value)] = directory, pool.submit(
                _train, "--checkpoint_dir", str(directory / "ck"), flag, value.format(file=a_file))
        yield started


def _result(refusals, flag: str, value: str) -> tuple[Path, subprocess.CompletedProcess]:
    directory, future = refusals[(flag, value)]
    return directory, future.result(timeout=110)


@pytest.mark.timeout(120)
def test_bad_flag_fails_fast_with_one_line_before_any_process_group(refusals):
    directory, result = _result(refusals, *BAD_FLAG)
    assert result.returncode == 2
    assert "--keep_last: got 1; expected at least 2" in result.stderr.splitlines()[-1]
    assert not any(directory.iterdir()), "nothing may be written for a rejected config"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flag, value, message", BAD_VALUES)
def test_bad_values_fail_in_one_line_naming_the_flag(refusals, flag, value, message):
    directory, result = _result(refusals, flag, value)
    message = message.format(file=directory / "notes.txt")
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("python -m elastic_ddp.train: error: ") and message in last, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert sorted(p.name for p in directory.iterdir()) == ["notes.txt"]


@pytest.mark.timeout(60)
def test_a_ddp_worker_does_not_import_the_sharded_stack():
    """Every worker (re)start imports the trainer; DCP and FSDP2 pull in DTensor, torch._decomp and
    sympy (0.6 s of CPU per worker here, paid again at each restart): only `--sharding fsdp` may."""
    probe = ("import sys, elastic_ddp.train, elastic_ddp.snapshot.manager, elastic_ddp.training.evaluation; "
             "print(sorted(m for m in ('sympy', 'torch.distributed.checkpoint', 'torch.distributed.fsdp', "
             "'torch.distributed.tensor') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=50, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"
