"""The single entry point `mtp-train` (also `python -m mtp_train`): one subcommand per stage.

Each stage module exposes `register(subparsers)`, which adds its subcommand(s) and sets `func` on the parser to a
callable taking the parsed `argparse.Namespace` and returning an exit code. Heavy imports (torch, transformers)
happen inside those callables so `mtp-train --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from mtp_train.errors import UserError

# Modules that register subcommands, in the order they appear in --help (stage order).
STAGE_MODULES = [
    "mtp_train.commands.fetch_assets",
    "mtp_train.commands.generate",
    "mtp_train.commands.prepare",
    "mtp_train.commands.precompute",
    "mtp_train.commands.verify_features",
    "mtp_train.commands.draft_vocab",
    "mtp_train.commands.train",
    "mtp_train.commands.eval",
    "mtp_train.commands.compare",
    "mtp_train.commands.export",
    "mtp_train.commands.inspect",
    "mtp_train.commands.env",
]


def exit_with_launcher() -> None:
    """Under torchrun (TORCHELASTIC_RUN_ID set), have the kernel kill this worker when its launcher (the torchrun
    agent, our parent) dies — a `kill -9` of torchrun would otherwise leave the workers training to the end (Linux
    only: prctl PR_SET_PDEATHSIG; elsewhere nothing changes). If the launcher already died before the request took
    effect, exit now."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    launcher = os.getppid()
    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0) != 0:
        return
    if launcher == 1 or os.getppid() != launcher:  # reparented: the launcher is gone already
        print("mtp-train: the torchrun launcher has exited; stopping this worker", file=sys.stderr)
        os._exit(1)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mtp-train",
        description="Train speculative-decoding draft heads (MTP / EAGLE) for LLMs.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging and full tracebacks")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in STAGE_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    exit_with_launcher()
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    from mtp_train.runtime.cpu import tune_malloc

    tune_malloc()
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except UserError as err:
        if args.verbose:
            raise
        print(f"mtp-train {args.command}: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a full disk, a read-only or forbidden directory: said as what to do
        from mtp_train.fileio import file_system_error

        message = file_system_error(err)
        if message is None or args.verbose:
            raise
        print(f"mtp-train {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"mtp-train {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
