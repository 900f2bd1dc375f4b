"""`python -m elastic_ddp.train` refuses a bad flag with one line before anything is written (no
process group, no file), whatever the flag: a number that is not finite, a path that is a file,
CUDA where there is none."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch


@pytest.mark.timeout(60)
def test_bad_flag_fails_fast_with_one_line_before_any_process_group(tmp_path):
    result = subprocess.run([sys.executable, "-m", "elastic_ddp.train", "--keep_last", "1",
                             "--checkpoint_dir", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--keep_last: got 1; expected at least 2" in result.stderr.splitlines()[-1]
    assert not any(tmp_path.iterdir()), "nothing may be written for a rejected config"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flag, value, message", [
    ("--weight_decay", "nan", "--weight_decay: got nan; expected a finite number"),
    ("--lr", "inf", "--lr: got inf; expected a finite number"),
    ("--collective_timeout_s", "inf", "--collective_timeout_s: got inf; expected a finite number"),
    ("--checkpoint_dir", "{file}", "--checkpoint_dir: got '{file}', but '{file}' is a file; expected a directory"),
    pytest.param("--device", "cuda", "--device: got 'cuda', but CUDA is not available here; expected auto or cpu",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")),
])
def test_bad_values_fail_in_one_line_naming_the_flag(tmp_path, flag, value, message):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    value, message = value.format(file=a_file), message.format(file=a_file)
    result = subprocess.run([sys.executable, "-m", "elastic_ddp.train", "--checkpoint_dir", str(tmp_path / "ck"),
                             flag, value], capture_output=True, text=True, timeout=100)
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("python -m elastic_ddp.train: error: ") and message in last, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


@pytest.mark.timeout(60)
def test_a_ddp_worker_does_not_import_the_sharded_stack():
    """Every worker (re)start imports the trainer; DCP and FSDP2 pull in DTensor, torch._decomp and
    sympy (0.6 s of CPU per worker here, paid again at each restart): only `--sharding fsdp` may."""
    probe = ("import sys, elastic_ddp.train, elastic_ddp.snapshot.manager, elastic_ddp.training.evaluation; "
             "print(sorted(m for m in ('sympy', 'torch.distributed.checkpoint', 'torch.distributed.fsdp', "
             "'torch.distributed.tensor') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=50)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"
