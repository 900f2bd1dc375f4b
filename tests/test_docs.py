"""The docs stay true: the configuration reference is generated from the code and up to date, the
custom-model example runs as the docs say (under torchrun, two processes), and the docs' relative
links point at files that exist."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from elastic_ddp import load_snapshot
from elastic_ddp.config_reference import render

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"


def test_the_configuration_reference_is_up_to_date():
    assert (DOCS / "configuration.md").read_text() == render(), (
        "docs/configuration.md is stale: run `python -m elastic_ddp.config_reference > docs/configuration.md`")


def test_the_configuration_reference_lists_every_flag():
    from elastic_ddp.config import build_parser

    text = render()
    flags = [action.option_strings[0] for action in build_parser()._actions if action.option_strings[0] != "-h"]
    missing = [flag for flag in flags if f"`{flag}`" not in text]
    assert not missing, missing


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_custom_model_example_trains_under_torchrun_and_its_snapshot_loads(tmp_path):
    checkpoint_dir = tmp_path / "ck"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(DOCS / "examples" / "custom_model.py"), "--epochs", "1", "--dataset_size", "256",
               "--global_batch_size", "64", "--micro_batch_size", "16", "--lr", "0.01", "--log_interval", "2",
               "--checkpoint_dir", str(checkpoint_dir)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=200,
                            env={**os.environ, "OMP_NUM_THREADS": "1",
                                 "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "epoch 1/1, step 4/4 of the epoch: loss" in result.stderr and "world 2" in result.stderr
    snapshot = load_snapshot(checkpoint_dir)
    assert snapshot["global_step"] == 4 and snapshot["world_size"] == 2
    sys.path.insert(0, str(DOCS / "examples"))
    try:
        from custom_model import SignalClassifier
    finally:
        sys.path.remove(str(DOCS / "examples"))
    model = SignalClassifier()
    model.load_state_dict(snapshot["model"])
    assert model(torch.zeros(3, 64)).shape == (3, 4)


LINK = re.compile(r"\]\(([^)#\s]+)(?:#([^)\s]*))?\)")


def github_anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_relative_links_in_the_docs_point_at_files_and_headings_that_exist():
    pages = [*DOCS.glob("*.md"), REPO / "launch" / "README.md"]
    broken = []
    for page in pages:
        for target, anchor in LINK.findall(page.read_text()):
            path = page.parent / target
            if "://" in target:
                continue
            if not path.exists():
                broken.append(f"{page.relative_to(REPO)} -> {target}")
            elif anchor and anchor not in {github_anchor(line.lstrip("#")) for line in path.read_text().splitlines()
                                           if line.startswith("#")}:
                broken.append(f"{page.relative_to(REPO)} -> {target}#{anchor}")
    assert not broken, broken
