"""`mtp-train precompute`: cache the target's hidden states over the prepared data (features/precompute.py)."""

from __future__ import annotations

import argparse

from mtp_train.cli_options import add_recipe_args, recipe_from_args

# Recipe keys `precompute` takes as options (cli_options: type, choices, limits and help from the recipe's fields).
RECIPE_OPTIONS = ("target.tensor_parallel", "precision.compute", "precision.decode", "precision.kv_cache",
                  "precision.features")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "precompute",
        help="cache the target's hidden states over the prepared data (torchrun-able, resumable)",
        description="Run the target through the runtime over the prepared train/eval splits and write the feature "
        "cache (manifest.json + safetensors shards). Under torchrun each rank takes a disjoint slice. Rerunning "
        "after an interruption finishes only the missing shards.",
    )
    add_recipe_args(p, RECIPE_OPTIONS, {"target.tensor_parallel": "--tp"})
    p.add_argument("--force", action="store_true", help="delete an existing cache at the output dir and start over")
    p.set_defaults(func=run_precompute_command)


def run_precompute_command(args: argparse.Namespace) -> int:
    from mtp_train.features.precompute import run_precompute

    run_precompute(recipe_from_args(args), force=args.force)
    return 0
