"""`inspect`: detect an exported directory's format, list its tensors, and check them and its config.json against the
format's required names/shapes/fields (derived from the config alone) and, optionally, against a target."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from mtp_train.errors import UserError
from mtp_train.export.base import Report, missing_fields
from mtp_train.export.common import (
    BLOCK_KEY, CHECKSUMS_KEY, CONFIG_FILENAME, DRAFT_VOCAB_TENSORS, WEIGHTS_FILENAME, Target, read_safetensors_header,
)
from mtp_train.export.registry import FORMATS
from mtp_train.fileio import file_sha256, read_json_object, recover_replaced_directory
from mtp_train.heads.io import nonfinite_summary, read_safetensors

# Heuristic detection order when the config does not name its format (native first: it may hold any names).
_DETECT_ORDER = ("native", "eagle3", "vllm-mtp", "deepseek-mtp", "eagle")  # vllm-mtp: also num_nextn_predict_layers


def detect_format(directory: Path, config: dict[str, Any], names: set[str]) -> str | None:
    block = config.get(BLOCK_KEY)
    if isinstance(block, dict) and block.get("format") in FORMATS:
        return block["format"]
    for name in _DETECT_ORDER:
        if FORMATS[name].detect(config, names, directory):
            return name
    return None


def inspect_dir(directory: str | os.PathLike[str], target: Any = None) -> Report:
    """Check `directory` (an export). `target`: a `Target`, a loaded `CausalLM`, or None. Unreadable input (no
    directory, no config.json, invalid JSON or safetensors) raises UserError; everything else lands in
    `Report.problems`, and the files' integrity (`check_integrity`) in `Report.integrity` / `Report.checksum`."""
    directory = Path(directory)
    recover_replaced_directory(directory)  # an export replaced by a run killed between its renames: the old one back
    if not directory.is_dir():
        raise UserError(f"{directory}: directory not found")
    config_path, weights_path = directory / CONFIG_FILENAME, directory / WEIGHTS_FILENAME
    if not config_path.is_file():
        raise UserError(f"{config_path}: not found (an export holds config.json and {WEIGHTS_FILENAME})")
    config = read_json_object(config_path)
    tensors = read_safetensors_header(weights_path)
    report = Report(directory=directory, format=None, config=config, tensors=tensors)
    check_integrity(report)

    fmt_name = detect_format(directory, config, set(tensors))
    if fmt_name is None:
        report.problems.append(
            f"{directory}: format not recognized (expected one of {', '.join(FORMATS)}: a config.json with "
            f"{BLOCK_KEY}.format, or the names of one of them)"
        )
        return report
    report.format = fmt_name
    fmt = FORMATS[fmt_name]

    missing = missing_fields(config, fmt.required_fields)
    for name in missing:
        report.problems.append(f"{config_path}: missing config field {name} (required by format {fmt_name})")
    if missing:
        return report
    try:
        report.expected = fmt.expected_tensors(config, directory)
    except (UserError, TypeError, ValueError) as err:
        report.problems.append(f"{config_path}: {err}")
        return report

    for name in sorted(report.expected.keys() - tensors.keys()):
        report.problems.append(f"{weights_path}: missing tensor {name} (expected shape {list(report.expected[name])})")
    for name in sorted(tensors.keys() - report.expected.keys()):
        report.problems.append(f"{weights_path}: unexpected tensor {name} (not part of format {fmt_name})")
    for name in sorted(tensors.keys() & report.expected.keys()):
        shape = tensors[name][0]
        if shape != report.expected[name]:
            report.problems.append(
                f"{weights_path}: tensor {name} has shape {list(shape)}, config.json implies {list(report.expected[name])}"
            )
    report.problems += _dtype_problems(config, tensors, str(config_path))
    report.problems += fmt.problems(config, directory)
    if target is not None:
        report.problems += [f"{directory}: {p}" for p in fmt.target_problems(config, Target.of(target))]
    return report


def check_integrity(report: Report) -> None:
    """Fill `report.checksum` and `report.integrity`: each file listed in config.json's mtp_train.checksums must
    still have its recorded sha256 (a config.json without the mtp_train block is noted: not written by mtp-train;
    one with the block but no checksums is refused: written by an older mtp-train), and no floating-point tensor of
    model.safetensors may hold NaN/Inf."""
    directory = report.directory
    block = report.config.get(BLOCK_KEY)
    recorded = block.get(CHECKSUMS_KEY) if isinstance(block, dict) else None
    source = f"{directory / CONFIG_FILENAME} {BLOCK_KEY}.{CHECKSUMS_KEY}"
    if not isinstance(block, dict):
        report.checksum = (f"no checksum recorded (no {BLOCK_KEY} block: not written by mtp-train export); "
                           "integrity not verified")
    elif recorded is None:
        report.integrity.append(f"{source}: absent: an export written by an older mtp-train (before exports carried "
                                "checksums); export the head again")
    elif not isinstance(recorded, dict) or not all(isinstance(v, str) for v in recorded.values()):
        report.integrity.append(f"{source}: expected an object of file name -> sha256 hex")
    else:
        if WEIGHTS_FILENAME not in recorded:
            report.integrity.append(f"{source}: does not list {WEIGHTS_FILENAME}")
        for name, digest in sorted(recorded.items()):
            path = directory / name
            if Path(name).name != name or name == CONFIG_FILENAME:
                report.integrity.append(f"{source}: lists {name!r}, which is not a file of the export")
            elif not path.is_file():
                report.integrity.append(f"{path}: missing (listed in {source})")
            elif (actual := file_sha256(path)) != digest:
                report.integrity.append(
                    f"{path}: checksum mismatch: sha256 {actual[:16]}... but {source} recorded {digest[:16]}... at "
                    "export: the file was changed or corrupted since; export the head again"
                )
        if not report.integrity:
            report.checksum = f"checksum ok (sha256 of {', '.join(sorted(recorded))})"
    summary = nonfinite_summary(read_safetensors(directory / WEIGHTS_FILENAME))
    if summary:
        report.integrity.append(f"{directory / WEIGHTS_FILENAME}: {summary}")
    if report.integrity and not report.checksum:
        report.checksum = "checksum NOT ok"


def _dtype_problems(config: dict[str, Any], tensors: dict[str, tuple[tuple[int, ...], str]], source: str) -> list[str]:
    """config.json's torch_dtype against the floating-point tensors (d2t/t2d keep int64/bool; checked apart)."""
    declared = config.get("torch_dtype")
    found = sorted({dtype for name, (_, dtype) in tensors.items() if name not in DRAFT_VOCAB_TENSORS})
    if declared is None or not found or found == [declared]:
        return []
    return [f"{source}: torch_dtype={declared!r} but the tensors are {', '.join(found)}"]


def format_report(report: Report) -> str:
    """A human-readable table of the report."""
    lines = [f"{report.directory}: format {report.format or 'unknown'}"]
    if report.format:
        lines[0] += f" ({FORMATS[report.format].description})"
    rows = []
    for name in sorted(set(report.tensors) | set(report.expected)):
        if name in report.tensors:
            shape, dtype = report.tensors[name]
            if name not in report.expected:
                status = "UNEXPECTED" if report.expected else "-"
            elif report.expected[name] != shape:
                status = f"SHAPE != {list(report.expected[name])}"
            else:
                status = "ok"
            rows.append((name, str(list(shape)), dtype, status))
        else:
            rows.append((name, str(list(report.expected[name])), "-", "MISSING"))
    headers = ("tensor", "shape", "dtype", "status")
    widths = [max(len(headers[i]), *(len(r[i]) for r in rows)) if rows else len(headers[i]) for i in range(4)]
    fmt_row = "  ".join("{:<%d}" % w for w in widths)
    lines.append("  " + fmt_row.format(*headers))
    lines.append("  " + "  ".join("-" * w for w in widths))
    lines += ["  " + fmt_row.format(*row) for row in rows]
    total = sum(math.prod(shape) for shape, _ in report.tensors.values())
    lines.append(f"  {len(report.tensors)} tensors, {total:,} parameters")
    draft_vocab_size = report.config.get("draft_vocab_size")
    if draft_vocab_size is not None:
        block = report.config.get(BLOCK_KEY) if isinstance(report.config.get(BLOCK_KEY), dict) else {}
        where = f"token map {block['speculative_token_map']}" if block.get("speculative_token_map") else "d2t/t2d"
        lines.append(f"  draft vocabulary: {draft_vocab_size} of {report.config.get('vocab_size')} target tokens "
                     f"({where})")
    lines.append(f"  {report.checksum}")
    if report.all_problems:
        lines.append(f"{len(report.all_problems)} problem(s):")
        lines += [f"  - {p}" for p in report.all_problems]
    else:
        lines.append("ok: names, shapes, dtypes and config fields match the format; no NaN/Inf weights")
    return "\n".join(lines)
