"""The oldest torch the package runs on: one floor (runtime/environment.py's TORCH_FLOOR) that pyproject.toml's
range and the Makefile's note for GPU users state, and `mtp-train env` refusing an older torch by name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mtp_train.errors import UserError

REPO = Path(__file__).resolve().parent.parent


def test_pyproject_and_makefile_state_the_floor_the_code_needs():
    from mtp_train.runtime.environment import TORCH_FLOOR

    floor = ".".join(map(str, TORCH_FLOOR))
    assert TORCH_FLOOR >= (2, 6)  # weights-only loading with safe_globals (train/checkpoints.py); enable_gqa (2.5)
    (spec,) = re.findall(r'"torch(>=[^"]*)"', (REPO / "pyproject.toml").read_text())
    assert spec.startswith(f">={floor},"), spec
    assert f"TORCH_SPEC='torch>={floor}'" in (REPO / "Makefile").read_text()


@pytest.mark.parametrize("version", ["2.4.1", "2.5.1+cu124", "1.13.0", "nightly"])
def test_an_older_torch_is_refused_naming_the_floor(version):
    from mtp_train.runtime.environment import check_torch_version

    with pytest.raises(UserError, match=rf"torch {re.escape(version)} is older than 2\.6.*TORCH_SPEC='torch>=2\.6'"):
        check_torch_version(version)


@pytest.mark.parametrize("version", ["2.6.0", "2.13.0+cpu", "2.14.0a0+git1234", "3.0.0"])
def test_a_recent_torch_passes(version):
    from mtp_train.runtime.environment import check_torch_version

    check_torch_version(version)


def test_env_command_refuses_an_older_torch(monkeypatch, capsys):
    import torch

    from mtp_train.cli import main

    monkeypatch.setattr(torch, "__version__", "2.5.1+cu124")
    assert main(["env", "--no-measure"]) == 2
    assert "mtp-train env: error: torch 2.5.1+cu124 is older than 2.6" in capsys.readouterr().err
