"""`mtp-train draft-vocab`: count the head's training labels and report coverage per draft-vocabulary size
(features/draft_vocab.py)."""

from __future__ import annotations

import argparse

from mtp_train.cli_options import add_recipe_args, recipe_from_args

DEFAULT_COVERAGE_SIZES = (4096, 8192, 16384, 32768)


def register(subparsers) -> None:
    d = subparsers.add_parser(
        "draft-vocab",
        help="count the head's training labels and report coverage per reduced draft-vocabulary size",
        description="Count, over the training features, the tokens a head is trained to predict (the target's argmax "
        "or the data's tokens), cache the counts next to the features and print the share of labels covered by the "
        "top-N tokens for each N. `train` uses the same counts to pick head.draft_vocab_size tokens.",
    )
    add_recipe_args(d, ["head.draft_vocab_source"], {"head.draft_vocab_source": "--source"})
    d.add_argument("--sizes", type=int, nargs="+", metavar="N", help="draft vocabulary sizes to report")
    d.set_defaults(func=run_draft_vocab)


def run_draft_vocab(args: argparse.Namespace) -> int:
    """`draft-vocab`: count the head's training labels, print coverage per draft-vocabulary size, write a report."""
    import torch

    from mtp_train.features.draft_vocab import coverage_table, load_or_count
    from mtp_train.fileio import write_json_atomic
    from mtp_train.runtime.config import load_config
    from mtp_train.runtime.frozen_parts import read_lm_head
    from mtp_train.runtime.loader import resolve_device
    from mtp_train.runtime.precision import resolve_section

    recipe = recipe_from_args(args)
    source = recipe.head.draft_vocab_source
    features_dir = recipe.features_dir
    vocab_size = load_config(recipe.target.path).vocab_size
    weight = None  # [V, d] the target's lm_head: its argmax over the stored hidden states labels each position
    if source == "target":  # only the lm_head is read, never the whole target
        device = resolve_device(recipe.target.device)
        precision = resolve_section(recipe.precision, device, phases=("prefill",))
        weight = read_lm_head(recipe.target.path, precision.torch_dtype, device)
    with torch.inference_mode():
        counts = load_or_count(features_dir, source, vocab_size, weight)
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
