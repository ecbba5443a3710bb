"""`mtp-train train`: fit the recipe's draft head on the feature cache (train/trainer.py)."""

from __future__ import annotations

from mtp_train.cli_options import add_recipe_args, recipe_from_args


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "train",
        help="train a draft head on the feature cache (DeepSpeed; torchrun-able)",
        description="Train the recipe's head with DeepSpeed on the precomputed features. Run alone or as "
        "`torchrun --nproc_per_node=N -m mtp_train train ...` (multi-node: --nnodes/--rdzv-endpoint). Resumes "
        "automatically from the run dir's latest checkpoint.",
    )
    add_recipe_args(p, ["precision.compute"])
    p.add_argument("--resume", default="auto",
                   help="auto (latest checkpoint in the run dir, if any; default), never, or a checkpoint dir")
    p.add_argument("--force", action="store_true", help="resume even though the recipe changed")
    p.set_defaults(func=_run)


def _run(args) -> int:
    from mtp_train.train.trainer import run_training

    run_training(recipe_from_args(args), resume=args.resume, force=args.force)
    return 0
