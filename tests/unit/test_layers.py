"""The layers of docs/architecture.md, enforced: every import-linter contract in pyproject.toml holds.

    .venv/bin/python -m pytest tests/unit/test_layers.py
    .venv/bin/lint-imports              # the same contracts and the same report, on the command line

An import that runs up a layer (runlog importing snapshot, config importing the snapshot backends)
fails here the day it is written: one test per contract, named by the contract's id, whose message
is import-linter's report of the chain that breaks it. That `elastic-ddp inspect` runs where torch
cannot be imported is shown in a process of its own: tests/cluster/test_inspect_without_torch.py.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from importlinter import api
from importlinter.cli import lint_imports

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = REPO / "pyproject.toml"
CONTRACTS = api.read_configuration(str(PYPROJECT))["contracts_options"]


@pytest.mark.parametrize("contract", CONTRACTS, ids=lambda contract: contract.get("id", contract["name"]))
def test_the_contract_holds(contract, capsys, monkeypatch):
    assert "id" in contract, f"contract {contract['name']!r}: give it an id in pyproject.toml, to run it alone"
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "path", list(sys.path))  # lint_imports puts the working directory first
    with _logging_restored():
        exit_code = lint_imports(config_filename=str(PYPROJECT), limit_to_contracts=(contract["id"],), no_cache=True)
    report = capsys.readouterr().out
    if exit_code != 0:
        broken = report[report.find("Broken contracts"):] if "Broken contracts" in report else report
        pytest.fail(f"contract {contract['id']!r} ({contract['name']}) is broken:\n{broken}", pytrace=False)


def test_there_is_a_contract_for_each_promise_of_the_layout():
    assert {contract.get("id") for contract in CONTRACTS} >= {
        "layers", "snapshot-layers", "agent-apart", "inspect-without-torch", "file-core-without-torch",
        "no-tests-in-product"}


@contextlib.contextmanager
def _logging_restored() -> Iterator[None]:
    """lint_imports configures logging with dictConfig, which disables every logger that exists (those
    of elastic_ddp too, which later tests read with caplog) and gives its own ones handlers: undo both."""
    def loggers() -> dict[str, logging.Logger]:
        return {name: logger for name, logger in logging.root.manager.loggerDict.items()
                if isinstance(logger, logging.Logger)}

    before = {name: (logger.disabled, logger.level, logger.propagate, list(logger.handlers))
              for name, logger in loggers().items()}
    try:
        yield
    finally:
        for name, logger in loggers().items():
            disabled, level, propagate, handlers = before.get(name, (False, logging.NOTSET, True, []))
            logger.disabled, logger.propagate, logger.handlers = disabled, propagate, handlers
            logger.setLevel(level)  # which also clears the loggers' cached levels
