"""`mtp-train verify-features DIR [--target DIR]`: prove a feature cache is whole and belongs to a target.

Checks the manifest against the shard files (features/checks.py, the checks the training reader runs too: no
dropped record, counts, hidden size, storage dtype), every shard's sha256, its tensors' names/shapes/dtypes, NaN/Inf
in the hidden states, that every sample of every split appears exactly once across all ranks' shards, (with
`--target`) the target fingerprint, and that the target's tokenizer (`--target`, else the cache's own target when
its directory exists) is the one that tokenized the data. Prints a summary; exit code 1 on any problem, each problem naming the shard and sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from mtp_train.features.checks import is_shard_name, shard_header, shard_problems, split_problems
from mtp_train.features.format import MANIFEST_FILENAME, decode_hidden, load_manifest
from mtp_train.errors import UserError
from mtp_train.fileio import file_sha256
from mtp_train.data.prepared import tokenizer_fingerprint, tokenizer_mismatch
from mtp_train.fingerprint import target_fingerprint


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
    """Checks one shard (sha256, its header against the manifest (features/checks.py), offsets, NaN/Inf); returns
    the sample indices it holds (empty if unreadable)."""
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
            header = shard_header(f)
            if header_problems := shard_problems(record, header, manifest):
                report.problems.extend(header_problems)
                return f.get_tensor("sample_index").tolist() if "sample_index" in header else []
            tensors = {key: f.get_tensor(key) for key in f.keys()}
    except Exception as err:
        report.problems.append(f"{name}: unreadable safetensors ({err})")
        return []
    offsets, sample_index = tensors["offsets"], tensors["sample_index"]
    num_tokens = int(offsets[-1]) if len(offsets) else -1
    hidden = tensors["hidden"]
    if int(offsets[0]) != 0 or num_tokens != record["num_tokens"] or bool((offsets.diff() <= 0).any()):
        report.problems.append(f"{name}: offsets are not increasing from 0 to the shard's {record['num_tokens']} tokens")
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
    if problem := _tokenizer_problem(root, manifest, target_dir):
        report.problems.append(problem)
    for split in manifest["splits"]:
        report.problems.extend(split_problems(root, manifest, split))

    records = [(split, r) for split, info in manifest["splits"].items() for r in info["shards"]]
    seen: dict[str, dict[int, list[str]]] = {split: {} for split in manifest["splits"]}
    for split, record in tqdm(records, desc="verify", unit="shard", disable=not progress):
        if not is_shard_name(split, record["name"]):
            continue  # named by split_problems; never opened
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


def _tokenizer_problem(root: Path, manifest: dict[str, Any], target_dir: str | Path | None) -> str | None:
    """The tokenizer check: the tokenizer of `target_dir` (or, without one, of the target the cache was computed
    with, when that directory is here) must be the one that tokenized the data; None when it is or cannot be told."""
    data_tokenizer = manifest["fingerprints"]["tokenizer"]
    model_dir = target_dir if target_dir is not None else manifest.get("target_path")
    if data_tokenizer is None or model_dir is None or not Path(model_dir).is_dir():
        return None
    try:
        target_tokenizer = tokenizer_fingerprint(model_dir, manifest.get("chat_template"))
    except UserError as err:
        return f"tokenizer of {model_dir}: {err}"
    if target_tokenizer == data_tokenizer:
        return None
    return tokenizer_mismatch(root / MANIFEST_FILENAME, data_tokenizer, manifest.get("tokenizer_source"), model_dir,
                              target_tokenizer)
