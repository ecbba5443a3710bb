"""Subcommands of the feature stage: `precompute`, `verify-features` and `draft-vocab`."""

from __future__ import annotations

DEFAULT_COVERAGE_SIZES = (4096, 8192, 16384, 32768)


def run_draft_vocab_cli(args) -> int:
    """`draft-vocab`: count the head's training labels, print coverage per draft-vocabulary size, write a report."""
    from pathlib import Path

    import torch

    from mtp_train.features.draft_vocab import coverage_table, load_or_count
    from mtp_train.fileio import write_json_atomic
    from mtp_train.recipe import recipe_from_args
    from mtp_train.runtime.loader import load_model, resolve_device
    from mtp_train.runtime.precision import resolve_precision

    recipe = recipe_from_args(args)
    source = args.source or recipe.head.draft_vocab_source
    features_dir = recipe.features_dir
    device = resolve_device(recipe.target.device)
    precision = resolve_precision(recipe.target.dtype, recipe.target.decode_dtype, device, phases=("prefill",))
    target = load_model(recipe.target.path, dtype=precision.dtype, device=device)
    weight = target.lm_head.weight.detach() if source == "target" else None
    with torch.inference_mode():
        counts = load_or_count(features_dir, source, target.config.vocab_size, weight)
    sizes = sorted({*(args.sizes or DEFAULT_COVERAGE_SIZES)} | (
        {recipe.head.draft_vocab_size} if isinstance(recipe.head.draft_vocab_size, int) else set()))
    rows = coverage_table(counts, sizes)
    labels, distinct = int(counts.sum()), int((counts > 0).sum())
    print(f"{features_dir}: {labels} labels ({source}), {distinct} distinct tokens of {counts.numel()}")
    print(f"{'draft_vocab_size':>16}  coverage")
    for row in rows:
        print(f"{row['draft_vocab_size']:>16}  {row['coverage']:.4f}")
    report = {"source": source, "labels": labels, "distinct": distinct, "vocab_size": counts.numel(), "coverage": rows}
    write_json_atomic(features_dir / "draft_vocab" / f"{source}-coverage.json", report)
    print(f"wrote {features_dir / 'draft_vocab' / f'{source}-coverage.json'}")
    return 0


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

    d = subparsers.add_parser(
        "draft-vocab",
        help="count the head's training labels and report coverage per reduced draft-vocabulary size",
        description="Count, over the training features, the tokens a head is trained to predict (the target's argmax "
        "or the data's tokens), cache the counts next to the features and print the share of labels covered by the "
        "top-N tokens for each N. `train` uses the same counts to pick head.draft_vocab_size tokens.",
    )
    add_recipe_args(d)
    d.add_argument("--source", choices=("target", "data"), default=None,
                   help="label source (default: the recipe's head.draft_vocab_source)")
    d.add_argument("--sizes", type=int, nargs="+", metavar="N", help="draft vocabulary sizes to report")
    d.set_defaults(func=run_draft_vocab_cli)
