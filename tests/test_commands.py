"""The command layer: one module per subcommand under mtp_train/commands/, each registered by `mtp_train.cli`, each
with a working --help and a README section."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

import mtp_train.commands
from mtp_train import cli

REPO = Path(__file__).resolve().parents[1]
COMMANDS_DIR = Path(mtp_train.commands.__file__).parent


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_command_module_is_registered():
    modules = {f"mtp_train.commands.{p.stem}" for p in COMMANDS_DIR.glob("*.py") if p.stem != "__init__"}
    assert set(cli.STAGE_MODULES) == modules


@pytest.mark.parametrize("name", sorted(_subcommands()))
def test_help_and_reference_section(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([name, "--help"])
    assert exit_info.value.code == 0
    assert f"usage: mtp-train {name}" in capsys.readouterr().out
    reference = (REPO / "docs" / "commands.md").read_text(encoding="utf-8")
    assert re.search(rf"^## .*`mtp-train {re.escape(name)}\b", reference, re.MULTILINE), (
        f"docs/commands.md: no section for {name}")


def test_export_and_inspect_parse():
    parser = cli.build_parser()
    args = parser.parse_args(["inspect", "d", "--target", "t"])
    assert args.func.__name__ == "run_inspect" and args.target == "t"
    args = parser.parse_args(["export", "--head", "h", "--format", "eagle", "--out", "o"])
    assert args.func.__name__ == "run_export" and args.dtype is None and not args.overwrite


def test_building_the_parser_imports_no_heavy_library():
    """`mtp-train --help` (and every subcommand's) answers at once: command modules import torch, transformers and
    deepspeed inside the functions that run a command, never at registration."""
    import subprocess
    import sys

    code = ("import sys; from mtp_train.cli import build_parser; build_parser(); "
            "print(sorted(m for m in ('torch', 'transformers', 'deepspeed') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert result.stdout.strip() == "[]"
