"""`python -m elastic_ddp.chaos` explains itself and refuses a bad plan with its reason."""

from __future__ import annotations

import json
import subprocess
import sys


def test_the_chaos_cli_explains_itself_and_refuses_bad_input(tmp_path):
    help_text = subprocess.run([sys.executable, "-m", "elastic_ddp.chaos", "--help"], capture_output=True,
                               text=True, check=True).stdout
    assert "--random" in help_text and "--plan" in help_text and "--compare" in help_text
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"faults": [{"action": "explode"}]}))
    result = subprocess.run([sys.executable, "-m", "elastic_ddp.chaos", "--plan", str(bad), "--run-dir",
                             str(tmp_path / "run"), "--", "--model", "mlp"], capture_output=True, text=True)
    assert result.returncode == 2 and "fault action: got 'explode'" in result.stderr
