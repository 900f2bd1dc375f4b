"""`python -m elastic_ddp.train` refuses a bad flag with one line before anything is written."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.timeout(60)
def test_bad_flag_fails_fast_with_one_line_before_any_process_group(tmp_path):
    result = subprocess.run([sys.executable, "-m", "elastic_ddp.train", "--keep_last", "1",
                             "--checkpoint_dir", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--keep_last: got 1; expected at least 2" in result.stderr.splitlines()[-1]
    assert not any(tmp_path.iterdir()), "nothing may be written for a rejected config"
