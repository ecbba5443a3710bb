"""`mtp-train inspect`: detect an exported head's format and check it (export/inspection.py)."""

from __future__ import annotations

import argparse
import json


def register(subparsers) -> None:
    i = subparsers.add_parser(
        "inspect",
        help="detect an exported head's format and check its tensors and config (exit 1 on any problem)",
        description="List the tensors (name, shape, dtype) of an exported head, detect its format, and check names, "
        "shapes and required config fields against the format (and against --target: hidden size, vocabulary, "
        "architecture, fingerprint), and the files' integrity: the sha256 of each file recorded at export (config.json "
        "mtp_train.checksums; 'checksum ok' or the file that differs) and no NaN/Inf weights. Exits 1 naming every "
        "missing/unexpected tensor or field and every file that changed.",
    )
    i.add_argument("directory", help="an export directory")
    i.add_argument("--target", default=None, help="also check against this target model directory")
    i.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    i.set_defaults(func=run_inspect)


def run_inspect(args: argparse.Namespace) -> int:
    from mtp_train.export.common import Target
    from mtp_train.export.inspection import format_report, inspect_dir

    target = Target.from_directory(args.target) if args.target else None
    report = inspect_dir(args.directory, target)
    if args.json:
        tensors = {k: {"shape": list(s), "dtype": d} for k, (s, d) in sorted(report.tensors.items())}
        print(json.dumps({"directory": str(report.directory), "format": report.format, "tensors": tensors,
                          "problems": report.all_problems, "checksum": report.checksum, "ok": report.ok}, indent=2))
    else:
        print(format_report(report))
    return 0 if report.ok else 1
