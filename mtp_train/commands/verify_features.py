"""`mtp-train verify-features`: check a feature cache (features/verify.py)."""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    v = subparsers.add_parser(
        "verify-features",
        help="check a feature cache: hashes, shapes, NaN/Inf, sample coverage, target fingerprint",
    )
    v.add_argument("features_dir", help="the precompute output directory (holds manifest.json)")
    v.add_argument("--target", default=None, help="model directory whose fingerprint the cache must match")
    v.set_defaults(func=run_verify_features)


def run_verify_features(args: argparse.Namespace) -> int:
    from mtp_train.features.verify import verify_features

    report = verify_features(args.features_dir, args.target)
    if report.ok:
        print(
            f"verify-features: OK — {report.shards_checked} shards, {report.samples} samples, {report.tokens} tokens, "
            f"{report.nbytes / 2**20:.1f} MiB ({report.nbytes / max(report.tokens, 1):.1f} bytes/token)"
        )
        return 0
    for problem in report.problems:
        print(f"verify-features: {problem}")
    print(f"verify-features: FAILED with {len(report.problems)} problem(s)")
    return 1
