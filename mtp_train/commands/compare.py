"""`mtp-train compare`: training runs and eval reports side by side (evaluate/compare.py)."""

from __future__ import annotations

import argparse

from mtp_train.evaluate.compare import DEFAULT_OUT


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "compare",
        help="compare training runs: recipe differences, losses, held-out accuracy, acceptance",
        description="Compare run dirs (train.run_dir of `mtp-train train`, plus eval/report.json when `mtp-train "
        "eval` ran): prints the recipe keys that differ and each run's final loss, held-out top-1 per unroll step, "
        "τ/α per k and best speedup, training tokens/s; writes compare.md, compare.json and PNG plots.",
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                   help="run directories (e.g. runs/<name>), or `mtp-train eval --out` directories (report.json)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default: {DEFAULT_OUT})")
    p.set_defaults(func=run_compare_cli)


def run_compare_cli(args: argparse.Namespace) -> int:
    from mtp_train.evaluate.compare import compare_runs

    compare_runs(args.run_dirs, args.out)
    return 0
