"""TrainingConfig: the CLI contract and one-line validation messages."""

from __future__ import annotations

import math

import pytest
import torch

from elastic_ddp.config import TrainingConfig, build_parser

CONTRACT_FLAGS = ["--epochs", "--global_batch_size", "--micro_batch_size", "--lr", "--seed", "--model",
                  "--dataset_size", "--checkpoint_dir", "--snapshot_every_steps", "--keep_last", "--use_amp",
                  "--no-use_amp", "--num_workers", "--log_interval", "--audit_log"]


def test_cli_exposes_the_contract_flags():
    help_text = build_parser().format_help()
    for flag in CONTRACT_FLAGS:
        assert flag in help_text, flag


def test_cli_parses_values_and_boolean_pairs():
    config = TrainingConfig.from_args(["--epochs", "5", "--use_amp", "--no-augment", "--model", "mlp",
                                       "--audit_log", "/tmp/audit", "--lr", "0.1"])
    assert (config.epochs, config.use_amp, config.augment, config.model, config.audit_log, config.lr) == (
        5, True, False, "mlp", "/tmp/audit", 0.1)
    assert TrainingConfig.from_args(["--no-use_amp"]).use_amp is False


@pytest.mark.parametrize("overrides, message", [
    ({"epochs": 0}, "--epochs: got 0; expected a positive integer"),
    ({"model": "resnet50"}, "--model: got 'resnet50'; expected one of mini_resnet, mlp"),
    ({"keep_last": 1}, "--keep_last: got 1; expected at least 2"),
    ({"micro_batch_size": 128, "global_batch_size": 64}, "--micro_batch_size: got 128; expected at most --global_batch_size (64)"),
    ({"snapshot_every_steps": -1}, "--snapshot_every_steps: got -1; expected 0 or more"),
    ({"lr": 0.0}, "--lr: got 0.0; expected a positive number"),
    ({"collective_timeout_s": 0}, "--collective_timeout_s: got 0; expected a positive number"),
    ({"device": "tpu"}, "--device: got 'tpu'; expected auto, cpu or cuda"),
    ({"drop_last": True, "global_batch_size": 64, "dataset_size": 10}, "--global_batch_size: got 64 with --drop_last"),
    ({"weight_decay": math.nan}, "--weight_decay: got nan; expected a finite number"),
    ({"lr": math.inf}, "--lr: got inf; expected a finite number"),
    ({"momentum": -math.inf}, "--momentum: got -inf; expected a finite number"),
    ({"collective_timeout_s": math.inf}, "--collective_timeout_s: got inf; expected a finite number"),
    ({"collective_timeout_s": 1e20}, "--collective_timeout_s: got 1e+20; expected a positive number of seconds, "
                                     "at most 604800 (a week)"),
    ({"snapshot_timeout_s": 0.0}, "--snapshot_timeout_s: got 0.0; expected a positive number of seconds"),
    ({"min_step_time_s": -1.0}, "--min_step_time_s: got -1.0; expected 0 or more"),
    ({"checkpoint_dir": ""}, "--checkpoint_dir: got an empty path; expected a directory"),
])
def test_validation_names_flag_value_and_what_is_accepted(overrides, message):
    with pytest.raises(ValueError) as excinfo:
        TrainingConfig(**overrides)
    assert message in str(excinfo.value)
    assert "\n" not in str(excinfo.value)


def test_a_checkpoint_dir_that_is_a_file_or_under_one_is_refused(tmp_path):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    for location in (a_file, a_file / "ck"):
        with pytest.raises(ValueError, match=rf"--checkpoint_dir: got '{location}', but '{a_file}' is a file; "
                                             "expected a directory, or a path where one can be created"):
            TrainingConfig(checkpoint_dir=str(location))
    assert TrainingConfig(checkpoint_dir=str(tmp_path / "new" / "ck")).checkpoint_dir.endswith("ck")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^--device: got 'cuda', but CUDA is not available here; expected auto or cpu$"):
        TrainingConfig(device="cuda")


@pytest.mark.parametrize("flag, value", [("--lr", "nan"), ("--weight_decay", "inf"), ("--collective_timeout_s", "inf")])
def test_the_command_line_refuses_non_finite_numbers_with_the_flags_line(flag, value, capsys):
    with pytest.raises(SystemExit) as excinfo:
        TrainingConfig.from_args([flag, value])
    assert excinfo.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(f"{flag}: got {float(value)}; expected a "
                                                                      "finite number")


def test_steps_per_epoch_counts_the_partial_last_batch_unless_dropped():
    assert TrainingConfig(dataset_size=100, global_batch_size=32, micro_batch_size=8).steps_per_epoch == 4
    assert TrainingConfig(dataset_size=100, global_batch_size=32, micro_batch_size=8, drop_last=True).steps_per_epoch == 3
