"""`mtp-train prepare`: tokenize the recipe's conversations into train/eval datasets (`data.prepare`)."""

from __future__ import annotations

import argparse
from typing import Any

from mtp_train.cli_options import add_recipe_args, recipe_from_args


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _print_summary(result) -> None:
    """What `prepare` made (a `data.prepare.PrepareResult`): samples, tokens, truncation, skips."""
    from mtp_train.data.prepared import SPLITS

    stats = result.stats
    splits = stats["splits"]
    if result.up_to_date:
        train_samples, eval_samples = splits["train"]["samples"], splits["eval"]["samples"]
        print(f"{result.output_dir}: up to date ({train_samples} train / {eval_samples} eval samples)")
        return
    print(
        f"prepared {stats['kept']} samples from {stats['rows_read']} rows in {stats['elapsed_s']:.1f} s "
        f"({stats['rows_per_s']} rows/s) -> {result.output_dir}"
    )
    for split in SPLITS:
        numbers = splits[split]
        print(
            f"  {split:5s}: {numbers['samples']} samples, {numbers['tokens']} tokens, "
            f"{numbers['assistant_tokens']} assistant tokens"
        )
    print(f"  truncated: {stats['truncated']}, offset fallback: {stats['offset_fallback']}")
    if stats["skipped"]:
        print("  skipped: " + ", ".join(f"{reason}: {count}" for reason, count in stats["skipped"].items()))
    if stats["adjusted"]:
        print("  adjusted: " + ", ".join(f"{reason}: {count}" for reason, count in stats["adjusted"].items()))


def run_prepare(args: argparse.Namespace) -> int:
    """The `prepare` subcommand (under torchrun: rank 0 prepares, every rank generates `--regenerate` replies)."""
    from mtp_train.data.prepare import prepare_on_ranks
    recipe = recipe_from_args(args)
    result = prepare_on_ranks(recipe, strict=args.strict, row_limit=args.limit, force=args.force)
    if result is not None:  # rank 0 (or the only process)
        _print_summary(result)
    return 0


def register(subparsers: Any) -> None:
    """Add the `prepare` subcommand."""
    parser = subparsers.add_parser(
        "prepare",
        help="tokenize conversations into (input_ids, loss_mask) train/eval datasets",
        description="Read the recipe's conversation sources, render them with the target's chat template, mask "
        "everything but the assistant replies, and save train/eval HF datasets with stats and fingerprints.",
    )
    add_recipe_args(parser, ["data.regenerate.enabled", "target.tensor_parallel"],
                    {"data.regenerate.enabled": "--regenerate", "target.tensor_parallel": "--tp"})
    parser.add_argument("--strict", action="store_true", help="fail on the first malformed row instead of skipping it")
    parser.add_argument("--limit", type=_positive_int, metavar="N", help="read at most N rows over all sources")
    parser.add_argument("--force", action="store_true", help="rebuild even if the output is up to date")
    parser.set_defaults(func=run_prepare)
