"""Progress in real runs of the built-in MLP in one process (`python -m elastic_ddp.train`): first
with its stderr on a pseudo-terminal (the bar), then resumed with stderr on a pipe (log lines; the
recorded multi-node run of tests/cluster/test_report_run.py checks them under torchrun too), with
TensorBoard scalars.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pty
import select
import subprocess
import sys
import textwrap
import time

import pytest

TRAIN = [sys.executable, "-m", "elastic_ddp.train", "--model", "mlp", "--epochs", "2", "--dataset_size", "512",
         "--global_batch_size", "64", "--micro_batch_size", "32", "--log_interval", "2", "--snapshot_every_steps", "4"]


# ------------------------------------------------------------------------------------ real runs

def run_on_a_terminal(argv: list[str], timeout: float) -> tuple[int, str]:
    """Run `argv` with stderr on a fresh pseudo-terminal (as under an interactive torchrun)."""
    master, slave = pty.openpty()
    process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    output, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # the child closed the terminal
                    break
                if not chunk:
                    break
                output += chunk
            elif process.poll() is not None:
                break
        return process.wait(timeout=max(1.0, deadline - time.monotonic())), output.decode(errors="replace")
    finally:
        os.close(master)
        if process.poll() is None:
            process.kill()


def read_scalar_steps(board) -> dict[str, list[int]]:
    """The steps of each scalar in `board`, read in another process: TensorBoard's protobuf must
    not be imported into this one, where etcd3 needs its own (elastic_ddp/agent/rendezvous/etcd/client.py)."""
    reader = textwrap.dedent(f"""
        import json
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        board = EventAccumulator({str(board)!r}); board.Reload()
        print(json.dumps({{tag: [event.step for event in board.Scalars(tag)] for tag in board.Tags()["scalars"]}}))
    """)
    result = subprocess.run([sys.executable, "-c", reader], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_real_runs_show_a_bar_on_a_terminal_log_lines_elsewhere_and_tensorboard_scalars(tmp_path):
    checkpoint_dir, board = tmp_path / "ck", tmp_path / "tb"
    flags = ["--checkpoint_dir", str(checkpoint_dir), "--tensorboard_dir", str(board)]
    code, output = run_on_a_terminal(TRAIN + ["--epochs", "1"] + flags, timeout=150)
    assert code == 0, output[-3000:]
    assert "\repoch 1/1:" in output and "8/8 [" in output and "step/s" in output
    assert "samples/s, world 1]" in output
    assert "no snapshot in" in output and "finished: 1 epochs, step 8" in output  # log lines above the bar

    resumed = subprocess.run(TRAIN + flags, capture_output=True, text=True, timeout=150)  # stderr: a pipe
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    lines = resumed.stderr.splitlines()
    assert "\r" not in resumed.stderr
    assert any(line.endswith("relaunched: world 1 -> 1, resumed from step 8 (epoch 2/2) from a snapshot file") for line in lines)
    assert any("epoch 2/2, step 2/8 of the epoch: loss" in line and line.endswith("samples/s, world 1")
               for line in lines), lines
    assert any("epoch 2/2 done: 8 steps in" in line for line in lines)

    if importlib.util.find_spec("tensorboard") is None:
        assert "the tensorboard package is not installed" in resumed.stderr
        return
    steps = read_scalar_steps(board)
    # Every 2 steps, both runs together; the resume did not repeat or lose a point.
    for tag in ("train/loss", "train/lr", "train/samples_per_second", "cluster/world_size"):
        assert steps[tag] == [2, 4, 6, 8, 10, 12, 14, 16], (tag, steps)
