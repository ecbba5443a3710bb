"""Subcommands of the feature stage: `precompute` and `verify-features`."""

from __future__ import annotations


def register(subparsers) -> None:
    from mtp_train.features.precompute import run_precompute_cli
    from mtp_train.features.verify import run_verify_cli
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
    p.set_defaults(func=run_precompute_cli)

    v = subparsers.add_parser(
        "verify-features",
        help="check a feature cache: hashes, shapes, NaN/Inf, sample coverage, target fingerprint",
    )
    v.add_argument("features_dir", help="the precompute output directory (holds manifest.json)")
    v.add_argument("--target", default=None, help="model directory whose fingerprint the cache must match")
    v.set_defaults(func=run_verify_cli)
