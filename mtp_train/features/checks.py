"""Consistency checks of a feature cache's manifest against its shard files, shared by `verify-features` and the
training reader (so `train` refuses exactly what verify flags).

The checks read only what is cheap: the shard file names of a split's folder and each shard's safetensors header
(tensor names, dtypes, shapes), never the tensors. They find a shard record dropped from the manifest (its file is
still there, and the split's totals no longer add up), counts that differ from the shards, and a hidden size or
storage dtype the shards do not have. Shard sha256s, tensor contents and sample coverage are checked by the callers.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mtp_train.features.format import STORAGE_HEADER_DTYPES

# A shard's header: tensor name -> (safetensors dtype name such as "BF16", shape).
ShardHeader = dict[str, tuple[str, tuple[int, ...]]]


def shard_header(handle: Any) -> ShardHeader:
    """The header of an open shard (a `safetensors.safe_open` handle); reads no tensor data."""
    header: ShardHeader = {}
    for key in handle.keys():
        view = handle.get_slice(key)
        header[key] = (view.get_dtype(), tuple(view.get_shape()))
    return header


def shard_problems(record: dict[str, Any], header: ShardHeader, manifest: dict[str, Any]) -> list[str]:
    """What is wrong with one shard's header against its manifest record and the manifest's hidden size, storage
    dtype, aux layers and `target_argmax` flag; each problem starts with the shard's name."""
    name = record["name"]
    required = ("offsets", "sample_index", "input_ids", "loss_mask", "hidden")
    if missing := [key for key in required if key not in header]:
        return [f"{name}: missing tensor(s) {missing}"]
    num_samples = header["sample_index"][1][0] if header["sample_index"][1] else -1
    num_tokens = header["input_ids"][1][0] if header["input_ids"][1] else -1
    hidden_size = manifest["hidden_size"]
    storage = STORAGE_HEADER_DTYPES[manifest["storage_dtype"]]
    problems = []
    if record["num_samples"] != num_samples:
        problems.append(f"{name}: holds {num_samples} samples, the manifest says {record['num_samples']}")
    if record["num_tokens"] != num_tokens:
        problems.append(f"{name}: holds {num_tokens} tokens, the manifest says {record['num_tokens']}")
    expected = {  # tensor -> (dtype, shape) the manifest implies
        "offsets": ("I64", (num_samples + 1,)),
        "sample_index": ("I64", (num_samples,)),
        "input_ids": ("I32", (num_tokens,)),
        "loss_mask": ("U8", (num_tokens,)),
        "hidden": (storage, (num_tokens, hidden_size)),
    }
    if manifest["storage_dtype"] == "float8_e4m3":
        expected["hidden_scale"] = ("F32", (num_tokens,))
    if manifest.get("target_argmax"):
        expected["target_argmax"] = ("I32", (num_tokens,))
    if manifest["aux_layers"]:
        expected["aux_hidden"] = (storage, (num_tokens, len(manifest["aux_layers"]), hidden_size))
        if manifest["storage_dtype"] == "float8_e4m3":
            expected["aux_hidden_scale"] = ("F32", (num_tokens, len(manifest["aux_layers"])))
    for key, (dtype, shape) in expected.items():
        if key not in header:
            problems.append(f"{name}: no '{key}' tensor, which the manifest implies ({dtype} {list(shape)})")
        elif header[key] != (dtype, shape):
            have_dtype, have_shape = header[key]
            what = {"hidden": f" (manifest: hidden_size {hidden_size}, storage_dtype {manifest['storage_dtype']})"}
            problems.append(f"{name}: '{key}' is {have_dtype} {list(have_shape)}, expected {dtype} {list(shape)}"
                            f"{what.get(key, '')}")
    return problems


def is_shard_name(split: str, name: Any) -> bool:
    """Whether a record's `name` is a shard file of `split` (`{split}/shard-r{rank}-{index:05d}.safetensors`, so no
    path outside the cache)."""
    pattern = rf"{re.escape(split)}/shard-r\d+-\d{{5,}}\.safetensors"
    return isinstance(name, str) and re.fullmatch(pattern, name) is not None


def split_problems(root: Path, manifest: dict[str, Any], split: str) -> list[str]:
    """What is wrong with a split's shard records as a whole: names outside the split's folder, duplicates, shard
    files in the folder that no record lists (a dropped record), totals that differ from the records' sums."""
    info = manifest["splits"][split]
    records = info["shards"]
    problems = []
    names = [record["name"] for record in records]
    for name in names:
        if not is_shard_name(split, name):
            problems.append(f"{split}: shard record name {name!r} is not a shard of this split")
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        problems.append(f"{split}: shard record(s) listed twice: {duplicates[:5]}")
    listed = set(names)
    unlisted = sorted(
        f"{split}/{path.name}" for path in (Path(root) / split).glob("shard-*.safetensors")
        if f"{split}/{path.name}" not in listed
    )
    for name in unlisted[:5]:
        problems.append(f"{name}: shard file is not in the manifest (its record was dropped?)")
    if len(unlisted) > 5:
        problems.append(f"{split}: {len(unlisted) - 5} more shard file(s) not in the manifest")
    for key, noun in (("num_samples", "samples"), ("num_tokens", "tokens")):
        total = sum(record[key] for record in records)
        if total != info[key]:
            problems.append(f"{split}: the manifest's shard records hold {total} {noun}, its {key} says {info[key]}")
    return problems


def manifest_problems(root: Path, manifest: dict[str, Any], split: str, headers: dict[str, ShardHeader]) -> list[str]:
    """All of the above for one split: `split_problems` and `shard_problems` of every record whose header is in
    `headers` (name -> header; a shard the caller could not open is its own problem)."""
    problems = split_problems(root, manifest, split)
    for record in manifest["splits"][split]["shards"]:
        if record["name"] in headers:
            problems.extend(shard_problems(record, headers[record["name"]], manifest))
    return problems
