"""`mtp-train verify-features DIR [--target DIR]`: prove a feature cache is whole and belongs to a target.

Checks every shard's sha256 against the manifest, its tensors' names/shapes/dtypes, NaN/Inf in the hidden states,
that every sample of every split appears exactly once across all ranks' shards, and (with `--target`) the target
fingerprint. Prints a summary; exit code 1 on any problem, each problem naming the shard and sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mtp_train.features.format import STORAGE_DTYPES, decode_hidden, load_manifest
from mtp_train.fileio import file_sha256


@dataclass
class VerifyReport:
    problems: list[str] = field(default_factory=list)
    shards_checked: int = 0
    samples: int = 0
    tokens: int = 0
    nbytes: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


def _check_shard(root: Path, record: dict[str, Any], manifest: dict[str, Any], report: VerifyReport) -> list[int]:
    """Checks one shard; returns the sample indices it holds (empty if unreadable)."""
    from safetensors import safe_open

    name = record["name"]
    path = root / name
    if not path.is_file():
        report.problems.append(f"{name}: missing")
        return []
    if path.stat().st_size != record["nbytes"]:
        report.problems.append(f"{name}: size {path.stat().st_size} bytes, manifest says {record['nbytes']} (truncated?)")
        return []
    if file_sha256(path) != record["sha256"]:
        report.problems.append(f"{name}: sha256 mismatch (file changed or corrupted)")
        return []
    try:
        with safe_open(str(path), framework="pt") as f:
            tensors = {key: f.get_tensor(key) for key in f.keys()}
    except Exception as err:
        report.problems.append(f"{name}: unreadable safetensors ({err})")
        return []
    required = {"offsets", "sample_index", "input_ids", "loss_mask", "hidden"}
    if missing := required - tensors.keys():
        report.problems.append(f"{name}: missing tensor(s) {sorted(missing)}")
        return []
    offsets, sample_index = tensors["offsets"], tensors["sample_index"]
    num_tokens = int(offsets[-1])
    hidden = tensors["hidden"]
    expected_dtype = STORAGE_DTYPES[manifest["storage_dtype"]]
    shape_problems = []
    if len(offsets) != len(sample_index) + 1 or int(offsets[0]) != 0 or bool((offsets.diff() <= 0).any()):
        shape_problems.append("offsets are not increasing from 0 with one entry per sample + 1")
    if tensors["input_ids"].shape != (num_tokens,) or tensors["loss_mask"].shape != (num_tokens,):
        shape_problems.append(f"input_ids/loss_mask shape != ({num_tokens},)")
    if hidden.shape != (num_tokens, manifest["hidden_size"]) or hidden.dtype != expected_dtype:
        shape_problems.append(
            f"hidden is {tuple(hidden.shape)} {hidden.dtype}, expected ({num_tokens}, {manifest['hidden_size']}) "
            f"{expected_dtype}"
        )
    if manifest.get("target_argmax") and (
        "target_argmax" not in tensors or tensors["target_argmax"].shape != (num_tokens,)
        or tensors["target_argmax"].dtype != torch.int32
    ):
        shape_problems.append(f"target_argmax missing or not int32 ({num_tokens},) (the manifest says it is stored)")
    if len(sample_index) != record["num_samples"] or num_tokens != record["num_tokens"]:
        shape_problems.append("sample/token counts differ from the manifest")
    if shape_problems:
        report.problems.extend(f"{name}: {p}" for p in shape_problems)
        return sample_index.tolist()
    values = decode_hidden(hidden, tensors.get("hidden_scale"))
    bad_rows = (~torch.isfinite(values)).any(-1)
    if "aux_hidden" in tensors:
        aux = decode_hidden(tensors["aux_hidden"], tensors.get("aux_hidden_scale"))
        bad_rows |= (~torch.isfinite(aux)).flatten(1).any(-1)
    if bad_rows.any():
        rows = bad_rows.nonzero().flatten()
        owners = torch.searchsorted(offsets, rows, right=True) - 1
        samples = sorted(set(sample_index[owners].tolist()))
        report.problems.append(f"{name}: NaN/Inf hidden states in sample(s) {samples[:10]}")
    report.shards_checked += 1
    report.samples += len(sample_index)
    report.tokens += num_tokens
    report.nbytes += record["nbytes"]
    return sample_index.tolist()


def verify_features(root: str | Path, target_dir: str | Path | None = None, progress: bool = True) -> VerifyReport:
    from mtp_train.errors import UserError
    from mtp_train.fingerprint import target_fingerprint

    root = Path(root)
    report = VerifyReport()
    try:
        manifest = load_manifest(root)
    except UserError as err:
        report.problems.append(str(err))
        return report
    if target_dir is not None:
        actual = target_fingerprint(target_dir)
        expected = manifest["fingerprints"]["target"]
        if actual != expected:
            report.problems.append(f"target fingerprint {actual} of {target_dir} != cache's {expected}")
    from tqdm import tqdm

    records = [(split, r) for split, info in manifest["splits"].items() for r in info["shards"]]
    seen: dict[str, dict[int, list[str]]] = {split: {} for split in manifest["splits"]}
    for split, record in tqdm(records, desc="verify", unit="shard", disable=not progress):
        for sample in _check_shard(root, record, manifest, report):
            seen[split].setdefault(sample, []).append(record["name"])
    for split, info in manifest["splits"].items():
        counts = seen[split]
        duplicates = {s: names for s, names in counts.items() if len(names) > 1}
        for sample, names in list(duplicates.items())[:10]:
            report.problems.append(f"{split}: sample {sample} appears {len(names)} times ({', '.join(names)})")
        missing = sorted(set(range(info["num_samples"])) - counts.keys())
        if missing:
            report.problems.append(f"{split}: {len(missing)} sample(s) missing from every shard, e.g. {missing[:10]}")
        extra = sorted(s for s in counts if not 0 <= s < info["num_samples"])
        if extra:
            report.problems.append(f"{split}: sample index(es) out of range: {extra[:10]}")
    return report
