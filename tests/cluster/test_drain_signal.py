"""A SIGTERM that comes too late for a drain still ends the process, once the run is saved."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_ddp import load_snapshot
from tests.support.training import small_config

REPO = Path(__file__).resolve().parents[2]


LAST_STEP_SIGTERM = """
import os, signal, sys
from pathlib import Path
from tests.support.training import make_trainer, small_config

config = small_config(Path(sys.argv[1]))
last_step = config.epochs * config.steps_per_epoch

def after_step(trainer):
    if trainer.global_step == last_step:  # too late to drain: this was the last step
        os.kill(os.getpid(), signal.SIGTERM)

make_trainer(config, after_step=after_step).fit()
print("fit returned and the process went on", flush=True)
"""


@pytest.mark.timeout(120)
def test_a_sigterm_too_late_to_drain_still_ends_the_process_once_the_run_is_saved(tmp_path):
    # torchrun stops a group with SIGTERM; a worker that swallowed it kept its agent waiting 30 s.
    result = subprocess.run([sys.executable, "-c", LAST_STEP_SIGTERM, str(tmp_path)], cwd=REPO,
                            capture_output=True, text=True, timeout=100)
    assert result.returncode == -signal.SIGTERM, result.stdout + result.stderr
    assert "went on" not in result.stdout
    config = small_config(tmp_path)
    assert load_snapshot(config.checkpoint_dir)["global_step"] == config.epochs * config.steps_per_epoch
