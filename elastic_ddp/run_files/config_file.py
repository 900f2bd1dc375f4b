"""`--config FILE.toml`: flag values from a TOML file.

    # run.toml
    epochs = 10
    global_batch_size = 256
    model = "my_pkg.models:build"
    optimizer = "adamw"
    betas = [0.9, 0.95]
    use_amp = true

Keys are flag names without the dashes, at the top level of the file. Each value must have the
flag's type (TOML's integer for an int, integer or float for a float, a boolean for an on/off flag,
a string for a text, an array of two numbers for a pair); anything else, an unknown key, or a file
that cannot be read or parsed is a `ConfigFileError` whose one line names the file and the key. The
values then go through the same checks as the command line's (`TrainingConfig.__post_init__`).
Files larger than MAX_CONFIG_BYTES are refused: a config is a few hundred bytes.

`tomllib` is in the standard library from Python 3.11; `tomli` (the same parser) below it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

MAX_CONFIG_BYTES = 1 << 20
EXPECTED = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
            tuple: "an array of two numbers"}


class ConfigFileError(ValueError):
    """A config file that cannot be used; the message is one line naming the file and the key."""


def load_config_file(path: str | Path, kinds: dict[str, type]) -> dict[str, Any]:
    """The values of the TOML file at `path`, checked against `kinds` (flag name -> bool, int, float,
    str or tuple), converted to what the flag would hold (a float for a float flag, a tuple for a pair)."""
    document = _parse(Path(path))
    values = {}
    for key, value in document.items():
        if key not in kinds:
            raise ConfigFileError(f"--config {path}: unknown key {key!r}; expected flag names without the dashes, "
                                  "such as epochs or global_batch_size (python -m elastic_ddp.train --help lists them)")
        converted = _converted(value, kinds[key])
        if converted is None:
            raise ConfigFileError(f"--config {path}: key {key!r}: got {value!r} ({_toml_type(value)}); "
                                  f"expected {EXPECTED[kinds[key]]}")
        values[key] = converted
    return values


def _parse(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as file:
            data = file.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigFileError(f"--config {path}: cannot be read ({exc.strerror or exc}); expected a TOML file") from exc
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigFileError(f"--config {path}: larger than {MAX_CONFIG_BYTES} bytes; expected a small TOML file")
    try:
        return tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigFileError(f"--config {path}: not UTF-8 text ({exc.reason} at byte {exc.start}); "
                              "expected a TOML file") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigFileError(f"--config {path}: not valid TOML ({exc}); expected key = value lines") from exc


def _converted(value: Any, kind: type) -> Any:
    """`value` as a flag of `kind` holds it, or None when it has another type."""
    if kind is bool:
        return value if isinstance(value, bool) else None
    if kind is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else None
    if kind is float:
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    if kind is str:
        return value if isinstance(value, str) else None
    if kind is tuple:
        numbers = [_converted(item, float) for item in value] if isinstance(value, list) else []
        return tuple(numbers) if len(numbers) == 2 and None not in numbers else None
    raise TypeError(f"unsupported flag type {kind}")


def _toml_type(value: Any) -> str:
    for kind, name in ((bool, "a boolean"), (int, "an integer"), (float, "a float"), (str, "a string"),
                       (list, "an array"), (dict, "a table")):
        if isinstance(value, kind):
            return name
    return type(value).__name__
