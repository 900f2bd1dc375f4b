"""The exactly-once oracle itself: every way a trajectory can break the rule must be reported.

The rule (elastic_ddp/runlog/audit.py): for each step, the entries of the newest incarnation that
logged it survive; their ranks form a whole world; each epoch's surviving samples are the epoch's
samples exactly once. Every slow test trusts this oracle, so it is tested here on hand-made logs.
"""

from __future__ import annotations

from elastic_ddp.runlog.audit import AuditLog, exactly_once_violations, read_entries

DATASET, BATCH = 8, 4  # 2 steps per epoch


def entry(step: int, rank: int, samples: list[int], incarnation: int = 1, world_size: int = 2,
          epoch: int | None = None) -> dict:
    return {"incarnation": incarnation, "epoch": (step - 1) // 2 if epoch is None else epoch, "step": step,
            "rank": rank, "world_size": world_size, "samples": samples}


def clean_epoch(incarnation: int = 1) -> list[dict]:
    """Epoch 0 on two ranks: steps 1 and 2, samples 0-7 once."""
    return [entry(1, 0, [0, 1], incarnation), entry(1, 1, [2, 3], incarnation),
            entry(2, 0, [4, 5], incarnation), entry(2, 1, [6, 7], incarnation)]


def violations(entries: list[dict], epochs: int = 1) -> list[str]:
    return exactly_once_violations(entries, DATASET, epochs, BATCH)


def test_a_clean_epoch_passes():
    assert violations(clean_epoch()) == []


def test_an_empty_log_is_reported_for_every_epoch():
    assert len(violations([], epochs=2)) == 2


def test_a_repeated_sample_is_reported():
    entries = clean_epoch()
    entries[3] = entry(2, 1, [6, 0])  # 0 twice, 7 never
    [problem] = violations(entries)
    assert "1 repeated" in problem and "7 distinct samples of 8" in problem


def test_a_missing_sample_is_reported():
    entries = clean_epoch()
    entries[3] = entry(2, 1, [6])
    [problem] = violations(entries)
    assert "7 distinct samples of 8" in problem and "0 repeated" in problem


def test_a_sample_outside_the_dataset_is_reported():
    entries = clean_epoch()
    entries[3] = entry(2, 1, [6, 99])
    assert "1 out of range" in violations(entries)[0]


def test_a_rolled_back_incarnation_does_not_count_and_its_replacement_does():
    # Incarnation 1 trained step 2 on other samples, then was rolled back: incarnation 2 redid it.
    entries = [*clean_epoch()[:2], entry(2, 0, [0, 1]), entry(2, 1, [2, 3]),
               entry(2, 0, [4, 5], incarnation=2), entry(2, 1, [6, 7], incarnation=2)]
    assert violations(entries) == []


def test_a_rollback_whose_redo_is_missing_is_reported():
    # Incarnation 2 logged step 2 only on rank 0: the old step 2 does not survive, the new is short.
    entries = [*clean_epoch(), entry(2, 0, [4, 5], incarnation=2)]
    problems = violations(entries)
    assert any("not a whole world" in problem for problem in problems)
    assert any("6 distinct samples of 8" in problem for problem in problems)


def test_a_world_that_is_not_whole_is_reported_even_when_the_samples_add_up():
    # Rank 1's line of step 2 is missing, but rank 0's line names all four samples.
    entries = [*clean_epoch()[:2], entry(2, 0, [4, 5, 6, 7])]
    [problem] = violations(entries)
    assert "step 2" in problem and "ranks [0], not a whole world" in problem


def test_mixed_world_sizes_in_one_step_are_reported():
    entries = [*clean_epoch()[:2], entry(2, 0, [4, 5]), entry(2, 1, [6, 7], world_size=3)]
    assert "not a whole world" in violations(entries)[0]


def test_a_step_completed_for_a_dead_rank_counts_once():
    # Rank 0 committed step 2 after rank 1 died mid-step, and recorded rank 1's share for it; rank 1
    # had logged its own line too: the two identical lines count as one.
    entries = [*clean_epoch(), entry(2, 1, [6, 7])]
    assert violations(entries) == []


def test_two_different_lines_for_one_rank_and_step_are_reported():
    entries = [*clean_epoch(), entry(2, 1, [7, 6])]
    assert "two different entries for rank 1" in violations(entries)[0]


def test_samples_of_an_epoch_beyond_the_run_are_reported():
    entries = [*clean_epoch(), entry(3, 0, [0, 1]), entry(3, 1, [2, 3])]
    assert "beyond the 1 trained" in violations(entries)[-1]


def test_drop_last_expects_only_full_batches():
    entries = [entry(1, 0, [0, 1], world_size=2), entry(1, 1, [2, 3], world_size=2)]
    assert exactly_once_violations(entries, dataset_size=6, epochs=1, global_batch_size=4, drop_last=True) == []


def test_the_log_round_trips_and_a_torn_last_line_is_ignored(tmp_path):
    log = AuditLog(tmp_path, incarnation=7, rank=1, world_size=2)
    log.record_step(0, 1, [2, 3])
    log.record_step_for(0, 0, 1, [0, 1])
    log.close()
    with open(tmp_path / "audit-7-rank1.jsonl", "a") as handle:
        handle.write('{"incarnation": 7, "ep')
    entries = read_entries(tmp_path)
    assert [(e["rank"], e["samples"], e["world_size"]) for e in entries] == [(1, [2, 3], 2), (0, [0, 1], 2)]
