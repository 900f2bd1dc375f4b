"""docs/configuration.md, generated from `TrainingConfig` so that it cannot drift from the code.

    python -m elastic_ddp.tools.config_reference > docs/configuration.md

tests/unit/test_docs.py fails when the file differs from what this prints: after adding or changing a
field, run the command above and commit the result.
"""

from __future__ import annotations

import dataclasses
import sys

from elastic_ddp.agent.rendezvous.defaults import AGENT_ENV, MONITOR_INTERVAL_S, RDZV_CONF
from elastic_ddp.config import TrainingConfig, _field_type

HEADER = """# Configuration reference

<!-- Generated from elastic_ddp/config.py by `python -m elastic_ddp.tools.config_reference > docs/configuration.md`.
     Do not edit by hand: tests/unit/test_docs.py fails when this file is stale. -->

Every field of `elastic_ddp.TrainingConfig` is a flag of `python -m elastic_ddp.train` (what
torchrun runs) with the same name: `--global_batch_size 256`. Booleans come in pairs, `--augment` /
`--no-augment`. In the library API, pass the same names to `TrainingConfig(...)`. A bad value stops
the run before any process group exists, with one line that names the flag, the value and what is
accepted (exit status 2). `python -m elastic_ddp.train --help` prints the same list.

`--config` FILE.toml reads values for any of these flags from a TOML file, keys without the dashes
(`epochs = 3`, `betas = [0.9, 0.95]`, `use_amp = true`); flags given on the command line win, and a
key that is not a flag is an error naming the key and the file. Flags are never abbreviated.
`--model`, `--dataset`, `--eval_dataset` and `--loss` take a built-in name or an import path
`package.module:callable` ([custom-model.md](custom-model.md)); a path that cannot be imported, or
returns the wrong thing, stops the worker before any process group with one line (exit status 2).
"""

TORCHRUN_SECTION = """
## torchrun settings

These are not `TrainingConfig` fields but torchrun's own. With `--rdzv_backend=elastic-c10d` or
`etcd-v3` the backend applies the `--rdzv_conf` timing below to every key you leave out (your value
wins) and gives each worker group a store of its own; with torch's `c10d`, pass them yourself, as
`launch/node.sh`, `LocalJob` and the recipes in `launch/` do (why these values:
[operations.md](operations.md#rendezvous-timing)):

| setting | value |
| --- | --- |
| `--rdzv_conf` | `{rdzv_conf}` |
| `--rdzv_conf` keys of our backends | `probe_dead_nodes=1`, `prompt_completion=1` (0 turns each off); `in_process=1` (a lost node's survivors re-form their group in their own processes, DDP or FSDP2 over gloo; 0: torchrun restarts them; docs/failure-semantics.md \"A node dies\"); `extend_last_call=1` (the only value: our rendezvous refuses 0, and `close_timeout` and `heartbeat_timeout`, which it does not read, and any key neither it nor the board reads); `algorithm=keyed` (the only algorithm: a key per node and one closing write per round, etcd-v3 and elastic-c10d; docs/architecture.md "Rendezvous"); `warm_workers=1` (workers of `-m elastic_ddp.train`, or of any module run as `-m elastic_ddp.handoff.warm_start MODULE`, forked from a warm-worker server in the agent; 0: each starts cold, under `elastic_ddp.agent.launcher` too; docs/operations.md "Warm workers") |
| `--monitor_interval` | `{monitor_interval}` (torchrun's default) |
{environment}
"""


def _default_text(config_field: dataclasses.Field) -> str:
    default = config_field.default
    if default is None:
        return "none"
    if isinstance(default, bool):
        return f"`--{config_field.name}`" if default else f"`--no-{config_field.name}`"
    return f"`{default}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
    """The whole text of docs/configuration.md."""
    rows = ["| flag | type | default | what it does |", "| --- | --- | --- | --- |"]
    for config_field in dataclasses.fields(TrainingConfig):
        kind = _field_type(config_field)
        flag = (f"`--{config_field.name}` / `--no-{config_field.name}`" if kind is bool
                else f"`--{config_field.name}`")
        optional = " (optional)" if "None" in str(config_field.type) else ""
        rows.append(f"| {flag} | {kind.__name__}{optional} | {_default_text(config_field)} | "
                    f"{_cell(config_field.metadata['help'])} |")
    environment = "\n".join(f"| `{name}` (environment of every agent) | `{value}` |"
                            for name, value in AGENT_ENV.items())
    torchrun = TORCHRUN_SECTION.format(rdzv_conf=RDZV_CONF, monitor_interval=MONITOR_INTERVAL_S,
                                       environment=environment)
    return HEADER + "\n## Training flags\n\n" + "\n".join(rows) + "\n" + torchrun


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
