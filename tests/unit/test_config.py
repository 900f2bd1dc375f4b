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
    ({"model": "resnet50"}, "--model: got 'resnet50'; expected mini_resnet or mlp or gpt, or an import path package.module:callable"),
    ({"keep_last": 1}, "--keep_last: got 1; expected at least 2"),
    ({"micro_batch_size": 128, "global_batch_size": 64}, "--micro_batch_size: got 128; expected at most --global_batch_size (64)"),
    ({"snapshot_every_steps": -1}, "--snapshot_every_steps: got -1; expected 0 or more"),
    ({"lr": 0.0}, "--lr: got 0.0; expected a positive number"),
    ({"collective_timeout_s": 0}, "--collective_timeout_s: got 0; expected a positive number"),
    ({"device": "tpu"}, "--device: got 'tpu'; expected auto, cpu or cuda"),
    ({"dist_backend": "mpi"}, "--dist_backend: got 'mpi'; expected auto, nccl or gloo"),
    ({"device": "cpu", "dist_backend": "nccl"}, "--dist_backend: got 'nccl' with --device cpu (the CPU here); "
                                                "expected auto or gloo"),
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
    ({"seed": 2**64}, "--seed: got 18446744073709551616; expected an integer from 0 to 18446744073709551615"),
    ({"seed": -1}, "--seed: got -1; expected an integer from 0 to"),
    ({"event_log": ""}, "--event_log: got an empty path; expected a file path"),
    ({"snapshot_budget": 0.0}, "--snapshot_budget: got 0.0; expected a share of training time above 0 and at most 0.5"),
    ({"snapshot_budget": math.nan}, "--snapshot_budget: got nan; expected a finite number"),
    ({"snapshot_max_interval_s": 0.0}, "--snapshot_max_interval_s: got 0.0; expected a positive number of seconds"),
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


def test_the_largest_seed_torch_takes_is_accepted():
    assert TrainingConfig(seed=2**64 - 1).seed == 2**64 - 1


@pytest.mark.parametrize("flag", ["event_log", "audit_log", "tensorboard_dir"])
def test_a_log_location_under_a_file_is_refused_before_training(tmp_path, flag):
    """Before, these passed validation and crashed every worker at start: a restart loop."""
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    location = a_file / "logs"
    with pytest.raises(ValueError, match=rf"^--{flag}: got '{location}', but '{a_file}' is a file; expected a "):
        TrainingConfig(**{flag: str(location)})
    assert getattr(TrainingConfig(**{flag: str(tmp_path / "new" / "logs")}), flag).endswith("logs")


def test_an_event_log_that_is_a_directory_or_a_log_dir_that_is_a_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match=rf"^--event_log: got '{tmp_path}', which is a directory; expected a file"):
        TrainingConfig(event_log=str(tmp_path))
    a_file = tmp_path / "audit"
    a_file.write_text("x")
    with pytest.raises(ValueError, match=rf"^--audit_log: got '{a_file}', but '{a_file}' is a file"):
        TrainingConfig(audit_log=str(a_file))


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


# ------------------------------------------------------------------ workload flags, config files


def last_error_line(capsys) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_optimizer_betas_loss_and_evaluation_flags():
    config = TrainingConfig.from_args(["--optimizer", "adamw", "--betas", "0.8", "0.95", "--loss", "mse",
                                       "--eval_dataset", "synthetic", "--eval_every_steps", "5"])
    assert (config.optimizer, config.betas, config.loss, config.eval_dataset, config.eval_every_steps) == (
        "adamw", (0.8, 0.95), "mse", "synthetic", 5)
    default = TrainingConfig()
    assert (default.optimizer, default.betas, default.dataset, default.dataset_size, default.augment) == (
        "sgd", (0.9, 0.999), "synthetic", 4096, True)


@pytest.mark.parametrize("overrides, message", [
    ({"optimizer": "adam"}, "--optimizer: got 'adam'; expected one of sgd, adamw"),
    ({"betas": (0.9, 1.0)}, "--betas: got 0.9 1.0; expected two numbers in [0, 1)"),
    ({"betas": (0.9,)}, "--betas: got 0.9; expected two numbers in [0, 1)"),
    ({"loss": "hinge"}, "--loss: got 'hinge'; expected cross_entropy or mse or token_cross_entropy, or an import path package.module:callable"),
    ({"dataset": "cifar10"}, "--dataset: got 'cifar10'; expected synthetic or tokens, or an import path"),
    ({"model": "pkg.mod:"}, "--model: got 'pkg.mod:'; expected mini_resnet or mlp or gpt, or an import path"),
    ({"eval_dataset": "a-b:c"}, "--eval_dataset: got 'a-b:c'; expected synthetic, or an import path"),
    ({"eval_every_steps": 10}, "--eval_every_steps: got 10 without --eval_dataset; expected --eval_dataset too"),
    ({"eval_every_steps": -1, "eval_dataset": "synthetic"}, "--eval_every_steps: got -1; expected 0 or more"),
    ({"dataset": "pkg.data:train", "dataset_size": 100},
     "--dataset_size: got 100 with --dataset pkg.data:train; it applies to the built-in synthetic dataset only"),
    ({"dataset": "pkg.data:train", "augment": False},
     "--augment: got False with --dataset pkg.data:train; it applies to the built-in synthetic dataset only"),
    ({"dataset": "pkg.data:train", "eval_dataset": "synthetic"},
     "--eval_dataset: got synthetic with --dataset pkg.data:train; the built-in held-out set goes with the built-in"),
])
def test_workload_flags_are_refused_in_one_line(overrides, message):
    with pytest.raises(ValueError) as excinfo:
        TrainingConfig(**overrides)
    assert message in str(excinfo.value) and "\n" not in str(excinfo.value)


def test_a_users_dataset_leaves_the_builtin_only_settings_unset():
    config = TrainingConfig(dataset="pkg.data:train", model="pkg.models:net")
    assert config.dataset_size is None and config.augment is None
    with pytest.raises(ValueError, match="not the built-in one"):
        config.steps_per_epoch


def test_flags_are_never_abbreviated(capsys):
    # argparse's prefix matching took `--dataset x` as `--dataset_size x` before --dataset existed.
    with pytest.raises(SystemExit):
        TrainingConfig.from_args(["--epoch", "3"])
    assert "unrecognized arguments: --epoch 3" in last_error_line(capsys)
    assert TrainingConfig.from_args(["--dataset", "pkg.data:train"]).dataset == "pkg.data:train"


def test_a_subclass_gets_flags_for_its_own_fields():
    from dataclasses import dataclass, field

    @dataclass
    class MyConfig(TrainingConfig):
        dropout: float = field(default=0.1, metadata={"help": "Dropout of my model."})
        tokenizer: str = "bpe"

    config = MyConfig.from_args(["--dropout", "0.3", "--epochs", "2"])
    assert isinstance(config, MyConfig) and (config.dropout, config.tokenizer, config.epochs) == (0.3, "bpe", 2)
    assert "Dropout of my model." in build_parser(MyConfig).format_help()


def test_a_config_file_supplies_values_and_the_command_line_wins(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('epochs = 7\nglobal_batch_size = 128\nlr = 1\noptimizer = "adamw"\nbetas = [0.9, 0.95]\n'
                    'use_amp = true\nmodel = "mlp"\n')
    config = TrainingConfig.from_args(["--config", str(path), "--epochs", "2"])
    assert (config.epochs, config.global_batch_size, config.lr, config.optimizer, config.betas, config.use_amp,
            config.model) == (2, 128, 1.0, "adamw", (0.9, 0.95), True, "mlp")
    assert isinstance(config.lr, float)


@pytest.mark.parametrize("content, message", [
    ("epochz = 3\n", "unknown key 'epochz'; expected flag names without the dashes"),
    ("config = 'other.toml'\n", "unknown key 'config'"),
    ('epochs = "three"\n', "key 'epochs': got 'three' (a string); expected an integer"),
    ("epochs = 3.0\n", "key 'epochs': got 3.0 (a float); expected an integer"),
    ("use_amp = 1\n", "key 'use_amp': got 1 (an integer); expected true or false"),
    ("lr = true\n", "key 'lr': got True (a boolean); expected a number"),
    ("betas = [0.9]\n", "key 'betas': got [0.9] (an array); expected an array of two numbers"),
    ("[training]\nepochs = 3\n", "unknown key 'training'"),
    ("epochs = \n", "not valid TOML"),
    ("lr = nan\n", "--lr: got nan; expected a finite number"),
    ("global_batch_size = -4\n", "--global_batch_size: got -4; expected a positive integer"),
])
def test_a_bad_config_file_is_one_line_naming_the_file_and_key(tmp_path, capsys, content, message):
    path = tmp_path / "run.toml"
    path.write_text(content)
    with pytest.raises(SystemExit) as excinfo:
        TrainingConfig.from_args(["--config", str(path)])
    assert excinfo.value.code == 2
    line = last_error_line(capsys)
    assert message in line
    if "--" not in message:  # the file's own errors name it; value checks name the flag
        assert str(path) in line


@pytest.mark.parametrize("write", [
    lambda path: None,  # missing
    lambda path: path.write_bytes(b"\xff\xfe epochs = 3"),  # not UTF-8
    lambda path: path.write_bytes(b"a" * (2 << 20)),  # too large
])
def test_an_unreadable_config_file_is_one_line(tmp_path, capsys, write):
    path = tmp_path / "run.toml"
    write(path)
    with pytest.raises(SystemExit):
        TrainingConfig.from_args(["--config", str(path)])
    line = last_error_line(capsys)
    assert line.startswith("python -m elastic_ddp.train: error: --config ") and str(path) in line
