"""benchmarks/data_path.py's tokens workload: its samples, the equal work of its two paths, and the
table its quick mode prints (the timings themselves are the benchmark's; none is asserted here)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import data_path
from benchmarks.data_path import TOKEN_PATHS, TokensSetup, VariableLengthTokens
from benchmarks.table import HEADER, parse_cell


def test_a_sample_is_made_from_the_seed_and_its_index_alone():
    setup = TokensSetup(dataset_size=64, global_batch_size=32)
    dataset, again = VariableLengthTokens(setup), VariableLengthTokens(setup)
    lengths = set()
    for index in (5, 0, 63, 5):
        sample = dataset[index]
        assert sorted(sample) == ["input_ids", "labels"] and sample["input_ids"].dtype == torch.int64
        assert torch.equal(sample["input_ids"], again[index]["input_ids"])
        assert torch.equal(sample["labels"], sample["input_ids"])
        lengths.add(len(sample["input_ids"]))
    assert len(lengths) == 3  # three indices, three lengths
    assert all(16 <= len(dataset[index]["input_ids"]) <= 512 for index in range(64))
    other_seed = VariableLengthTokens(TokensSetup(dataset_size=64, global_batch_size=32, seed=1))
    assert not torch.equal(other_seed[5]["input_ids"][:16], dataset[5]["input_ids"][:16])
    with pytest.raises(IndexError, match="outside a dataset of 64"):
        dataset[64]


def test_both_paths_read_every_sample_of_rank_0s_half_once_per_epoch_in_equal_micro_batches():
    setup = TokensSetup(dataset_size=128, global_batch_size=32, micro_batch_size=8, epochs=2)
    dataset = VariableLengthTokens(setup)
    for side, path in TOKEN_PATHS.items():
        batches = list(path(dataset, 0))
        assert [len(batch["input_ids"]) for batch in batches] == [8] * 16, side
        for epoch in (batches[:8], batches[8:]):
            samples = set()
            for batch in epoch:
                assert sorted(batch) == ["attention_mask", "input_ids", "labels"]
                for ids, mask in zip(batch["input_ids"], batch["attention_mask"]):
                    samples.add(tuple(ids[mask.bool()].tolist()))
            assert len(samples) == 64, side  # 64 distinct samples: none read twice


def test_a_setup_whose_batches_do_not_split_evenly_is_refused():
    with pytest.raises(ValueError, match="dataset_size 100, global_batch_size 64"):
        TokensSetup(dataset_size=100)
    with pytest.raises(ValueError, match="world_size x micro_batch_size"):
        TokensSetup(global_batch_size=48)


def test_the_quick_mode_prints_one_paired_row_per_worker_count(capsys):
    assert data_path.main(["--quick", "--workloads", "tokens"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "| " + " | ".join(HEADER) + " |" and len(lines) == 2 + 2
    for workers, line in zip((0, 2), lines[2:]):
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        assert cells[0] == "data path" and cells[1].startswith(f"variable-length tokens, {workers} workers: samples/s")
        assert cells[4] == "plain DataLoader" and cells[6] in (">= 0.98 met", ">= 0.98 MISSED") and cells[7] == "1"
        ours, plain, ratio = (parse_cell(cells[index]) for index in (2, 3, 5))
        assert ours[0] > 0 and plain[0] > 0 and ratio[0] == pytest.approx(ours[0] / plain[0], rel=0.01)


def test_the_command_line_refuses_what_it_cannot_run(capsys):
    with pytest.raises(SystemExit):
        data_path.main(["--repetitions", "0"])
    assert "--repetitions: got 0; expected at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        data_path.main(["--num_workers", "-1"])
    assert "--num_workers: got [-1]" in capsys.readouterr().err
