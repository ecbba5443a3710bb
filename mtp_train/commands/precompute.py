"""`mtp-train precompute`: cache the target's hidden states over the prepared data (features/precompute.py)."""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    from mtp_train.recipe import add_recipe_args

    p = subparsers.add_parser(
        "precompute",
        help="cache the target's hidden states over the prepared data (torchrun-able, resumable)",
        description="Run the target through the runtime over the prepared train/eval splits and write the feature "
        "cache (manifest.json + safetensors shards). Under torchrun each rank takes a disjoint slice. Rerunning "
        "after an interruption finishes only the missing shards.",
    )
    add_recipe_args(p)
    p.add_argument("--force", action="store_true", help="delete an existing cache at the output dir and start over")
    p.add_argument("--tp", type=int, default=None, metavar="N",
                   help="tensor parallelism (sets target.tensor_parallel): under torchrun with W processes, W/N "
                        "data-parallel groups of N ranks each run one target split over them; a group's leader "
                        "writes its shards")
    p.set_defaults(func=run_precompute_command)


def run_precompute_command(args: argparse.Namespace) -> int:
    from mtp_train.errors import UserError
    from mtp_train.features.format import STORAGE_DTYPES
    from mtp_train.features.precompute import run_precompute
    from mtp_train.recipe import recipe_from_args

    if args.tp is not None:
        args.overrides = [*args.overrides, f"target.tensor_parallel={args.tp}"]
    recipe = recipe_from_args(args)
    if recipe.precompute.storage_dtype not in STORAGE_DTYPES:
        raise UserError(f"precompute.storage_dtype: {recipe.precompute.storage_dtype!r} not supported")
    run_precompute(recipe, force=args.force)
    return 0
