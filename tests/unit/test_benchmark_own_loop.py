"""benchmarks.own_loop's arithmetic, and its bare loop's equal work with the example (no torchrun here)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks import bare_gpt_loop, baseline_schedule, own_loop
from benchmarks.own_loop import RunResult, Workload
from benchmarks.table import parse_cell, render_markdown
from elastic_ddp.workload.sampler import even_split, micro_batches
from elastic_ddp.workload.tokens import TokenWindows


def test_steps_count_the_short_last_batch_of_every_epoch():
    assert own_loop.step_samples(100, 32, epochs=2) == [32, 32, 32, 4] * 2
    assert own_loop.step_samples(96, 32, epochs=1) == [32, 32, 32]
    default = Workload()
    assert default.windows == 6249 and len(default.step_samples()) == 196  # ~200 steps: a steady state to measure
    assert "196 steps, first 10 left out" in default.describe() and "ours with" not in default.describe()
    assert Workload(example_args=("--snapshot_every_steps", "0")).describe().endswith(
        ", ours with --snapshot_every_steps 0")
    with pytest.raises(ValueError, match="windows"):
        own_loop.step_samples(0, 32, epochs=1)


def test_workload_windows_are_those_of_the_token_file(tmp_path):
    path = tmp_path / "tokens.u16"
    (np.arange(1000) % 256).astype("<u2").tofile(path)
    workload = Workload(corpus_bytes=1000, block_size=64)
    assert workload.windows == len(TokenWindows(path, 64, 256)) == 15


def test_tokens_per_second_leaves_out_the_first_steps_and_counts_a_short_step():
    # Four slow start-up steps, then one step every 0.5 s; the last step holds 4 samples, not 32.
    step_times = [10.0, 20.0, 30.0, 40.0] + [40.0 + 0.5 * k for k in range(1, 9)]
    samples = [32] * 11 + [4]
    rate = own_loop.steady_state_tokens_per_second(step_times, samples, block_size=64, skip_steps=4)
    assert rate == pytest.approx((7 * 32 + 4) * 64 / 4.0)
    # None skipped: the window still starts at the end of the first step.
    assert own_loop.steady_state_tokens_per_second([0.0, 1.0, 3.0], [8, 8, 8], 2, 0) == pytest.approx(32 / 3)
    with pytest.raises(ValueError, match="need more than"):
        own_loop.steady_state_tokens_per_second(step_times[:5], samples[:5], 64, skip_steps=4)
    with pytest.raises(ValueError, match="step times for"):
        own_loop.steady_state_tokens_per_second(step_times, samples[:-1], 64, skip_steps=4)
    with pytest.raises(ValueError, match="do not increase"):
        own_loop.steady_state_tokens_per_second([1.0, 3.0, 3.0, 3.0], [8, 8, 8, 8], 64, skip_steps=2)


def test_step_times_come_from_the_step_events_in_step_order():
    events = [{"time": 1.0, "event": "start", "incarnation": 0},
              {"time": 3.0, "event": "step", "incarnation": 0, "global_step": 2, "epoch": 0},
              {"time": 2.0, "event": "step", "incarnation": 0, "global_step": 1, "epoch": 0},
              {"time": 3.5, "event": "snapshot_captured", "incarnation": 0, "global_step": 2, "blocked_seconds": 0.25},
              {"time": 4.0, "event": "step", "incarnation": 0, "global_step": 3, "epoch": 0},
              {"time": 4.5, "event": "snapshot_captured", "incarnation": 0, "global_step": 3, "blocked_seconds": 0.5}]
    assert own_loop.step_times_from_events(events) == [2.0, 3.0, 4.0]
    assert own_loop.snapshots_in_window(events, start=2.0, end=4.0) == (1, 0.25)
    assert own_loop.snapshots_in_window(events, start=3.5, end=4.5) == (1, 0.5)
    missing = [event for event in events if event.get("global_step") != 2 or event["event"] != "step"]
    with pytest.raises(ValueError, match="expected 1 to 2"):
        own_loop.step_times_from_events(missing)
    restarted = events + [{"time": 9.0, "event": "step", "incarnation": 1, "global_step": 4, "epoch": 0}]
    with pytest.raises(ValueError, match="2 incarnations"):
        own_loop.step_times_from_events(restarted)


def test_pairs_alternate_their_order():
    assert own_loop.pair_orders(3) == [("ours", "bare"), ("bare", "ours"), ("ours", "bare")]


def test_tables_pair_the_ratios_per_repetition():
    ours = [RunResult(9000.0, 330.0, 20.0, 0.05, 1), RunResult(9900.0, 331.0, 20.0), RunResult(5000.0, 329.0, 20.0)]
    bare = [RunResult(10000.0, 300.0, 15.0), RunResult(10000.0, 300.0, 15.0), RunResult(10000.0, 329.0, 15.0)]
    speed, memory = own_loop.rows(Workload(), ours, bare)
    assert speed.paired and speed.ratios == pytest.approx([0.9, 0.99, 0.5]) and speed.ratio == pytest.approx(0.9)
    assert memory.ratios == pytest.approx([1.1, 331 / 300, 1.0])
    summary = render_markdown([speed, memory])
    speed_line = next(line for line in summary.splitlines() if "tokens/s" in line)
    cells = [cell.strip() for cell in speed_line.strip("|").split("|")]
    assert parse_cell(cells[2]) == (9000, 5000, 9900) and parse_cell(cells[5]) == (0.9, 0.5, 0.99)
    pairs = own_loop.render_pairs(ours, bare, own_loop.pair_orders(3)).splitlines()
    assert len(pairs) == 2 + 3
    assert pairs[2].startswith("| 1 | ours then bare | 9000 | 10000 | 0.900 | 330 | 300 | 1.100 | 1 (0.050) |")
    assert pairs[3].startswith("| 2 | bare then ours |")
    line = own_loop.summary_line(ours, bare)
    assert "tokens/s 0.900 [0.500..0.990]" in line and "peak RSS per worker 1.100 [1.000..1.103]" in line


def test_the_command_line_refuses_a_run_too_short_to_measure(capsys):
    with pytest.raises(SystemExit):  # 15 windows, one step: nothing left after --skip_steps
        own_loop.main(["--repeats", "1", "--corpus_bytes", "1000", "--skip_steps", "10"])
    assert "need more than --skip_steps" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        own_loop.main(["--repeats", "0"])
    assert "--repetitions: got 0" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ equal work


def test_the_bare_loop_splits_a_global_batch_as_the_elastic_sampler_does():
    for global_samples in (0, 1, 5, 9, 16, 32, 33):
        batch = list(range(100, 100 + global_samples))
        for world_size in (1, 2, 3):
            for rank in range(world_size):
                start, stop = even_split(global_samples, world_size, rank)
                expected = micro_batches(batch[start:stop], 8)
                got = bare_gpt_loop.rank_micro_batches(np.array(batch, dtype=np.int64), rank, world_size, 8)
                assert [piece.tolist() for piece in got] == expected


def test_the_bare_loop_reads_the_windows_token_windows_reads(tmp_path):
    path = tmp_path / "tokens.u16"
    np.random.default_rng(0).integers(0, 256, size=1001, dtype=np.uint16).astype("<u2").tofile(path)
    windows = TokenWindows(path, 16, 256)
    indices = np.array([3, 0, 61], dtype=np.int64)
    inputs, targets = bare_gpt_loop.window_batch(np.memmap(path, dtype="<u2", mode="r"), indices, 16)
    expected = [windows[int(i)] for i in indices]
    assert inputs.dtype == torch.int64 and inputs.shape == (3, 16)
    assert torch.equal(inputs, torch.stack([x for x, _ in expected]))
    assert torch.equal(targets, torch.stack([y for _, y in expected]))


def test_the_bare_loop_has_the_examples_loss_optimizer_and_schedule():
    example = own_loop.load_example()
    logits, targets = torch.randn(3, 5, 256), torch.randint(0, 256, (3, 5))
    assert torch.equal(bare_gpt_loop.per_sample_loss(logits, targets), example.per_sample_loss(logits, targets))
    torch.manual_seed(0)
    model = bare_gpt_loop.GPT(256, 16, 1, 2, 16)
    config = example.GPTConfig.from_args(["--lr", "0.002"])
    theirs = example.adamw_without_decay_on_norms_and_biases(config)(model).param_groups
    mine = bare_gpt_loop.adamw_groups(model, 0.002).param_groups
    assert len(mine) == len(theirs) == 2
    for a, b in zip(mine, theirs):
        assert {k: v for k, v in a.items() if k != "params"} == {k: v for k, v in b.items() if k != "params"}
        assert [id(p) for p in a["params"]] == [id(p) for p in b["params"]]

    assert bare_gpt_loop.warmup_cosine_schedule is baseline_schedule.warmup_cosine_schedule  # tested there
