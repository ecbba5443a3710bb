"""`mtp-train env`: versions, CPU/GPU facts, what `precision.compute: auto` picks and why, measured ceilings
(runtime/environment.py collects them)."""

from __future__ import annotations

import argparse
import json


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "env",
        help="versions, CPU/GPU facts, what dtype `auto` picks and why, measured matmul and memory ceilings",
        description="Print the machine and software facts that decide this project's speed (paste it into bug "
        "reports). Measures fp32/bf16 matmul GFLOP/s and memory read bandwidth in about two seconds.",
    )
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    p.add_argument("--no-measure", action="store_true", help="skip the timed matmul and bandwidth measurements")
    p.add_argument("--reprobe", action="store_true",
                   help="time the decode matmuls again instead of reading the cached choice of `auto`")
    p.set_defaults(func=run_env)


def run_env(args: argparse.Namespace) -> int:
    from mtp_train.runtime.environment import collect_env, format_env

    env = collect_env(measure=not args.no_measure, reprobe=args.reprobe)
    print(json.dumps(env, indent=2) if args.json else format_env(env))
    return 0
