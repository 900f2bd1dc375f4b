"""benchmarks/recovery.py's command line: the device its workers train on, checked before any job.

    .venv/bin/python -m pytest -q tests/unit/test_benchmark_recovery.py
"""

from __future__ import annotations

import pytest
import torch

from benchmarks import recovery


class _Started(Exception):
    """What the stand-in job raises once it has seen its arguments."""


def test_cuda_workers_share_the_gpus_over_gloo(monkeypatch, tmp_path):
    seen: list[list[str]] = []

    def job(run_dir, training_args, **settings):
        seen.append(training_args)
        raise _Started

    monkeypatch.setattr(recovery, "LocalJob", job)
    for device in ("cpu", "cuda"):
        with pytest.raises(_Started):
            recovery.measure_once("ours", tmp_path, device=device)
    assert "--device" not in seen[0]
    assert seen[1][-4:] == ["--device", "cuda", "--dist_backend", "gloo"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a CUDA GPU refuses --device cuda")
def test_cuda_without_a_gpu_is_refused_in_one_line_before_any_job(monkeypatch, capsys):
    monkeypatch.setattr(recovery, "run_benchmark", lambda *a, **k: pytest.fail("a job was started"))
    with pytest.raises(SystemExit) as exited:
        recovery.main(["--device", "cuda", "--quick"])
    assert exited.value.code == 2
    assert "--device cuda: torch sees no CUDA GPU on this machine; use --device cpu" in capsys.readouterr().err
