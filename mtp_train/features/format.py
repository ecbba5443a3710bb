"""On-disk format of the feature cache written by `precompute` and read by `train` and `verify-features`.

Layout of `<precompute.output_dir>/`:

- `manifest.json` — written last, when every rank finished: format version, fingerprints (`target`, `tokenizer`,
  `dataset`, `recipe`), storage dtype, hidden size, aux layer ids, world size, `tokenizer_source` (the target path
  the data was prepared with) and `chat_template` (the recipe's `data.chat_template`, part of the tokenizer hash),
  per split the sample and token counts and the list of shards (`name`, `rank`, `index`, `num_samples`,
  `num_tokens`, `nbytes`, `sha256`);
- `progress-r{rank}.json` — each rank's finished shards so far (what a resumed run skips);
- `{split}/shard-r{rank}-{k:05d}.safetensors` — tensors over the concatenated samples of the shard:
  `offsets` int64 [n+1] (sample s owns rows offsets[s]:offsets[s+1]), `sample_index` int64 [n] (row of the
  prepared split), `input_ids` int32 [T], `loss_mask` uint8 [T], `hidden` [T, d] (storage dtype) and, for
  `float8_e4m3`, `hidden_scale` float32 [T]; with `precompute.target_argmax` (default) `target_argmax` int32 [T],
  the argmax of lm_head(H_t) over the stored (storage-dtype) H_t; with aux layers `aux_hidden` [T, n_aux, d]
  (+ `aux_hidden_scale` [T, n_aux]).

`hidden` row t is H_t, the target's last-layer output after the final norm at position t (what lm_head reads).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from mtp_train.errors import UserError
from mtp_train.fileio import atomic_write_bytes, file_sha256, read_json_object, safetensors_bytes

FORMAT_VERSION = 1
MANIFEST_FILENAME = "manifest.json"
STORAGE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float8_e4m3": torch.float8_e4m3fn}
# The same dtypes as a safetensors header names them (what a shard's header says without reading its tensors).
STORAGE_HEADER_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float8_e4m3": "F8_E4M3"}
# Keys every manifest has (what verify-features and the reader index without a default).
MANIFEST_KEYS = ("format_version", "fingerprints", "storage_dtype", "hidden_size", "aux_layers", "splits")
FINGERPRINT_KEYS = ("target", "tokenizer", "dataset", "recipe")
SPLIT_KEYS = ("num_samples", "num_tokens", "shards")
SHARD_RECORD_KEYS = ("name", "num_samples", "num_tokens", "nbytes", "sha256")
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def shard_name(split: str, rank: int, index: int) -> str:
    return f"{split}/shard-r{rank}-{index:05d}.safetensors"


def progress_path(root: Path, rank: int) -> Path:
    return root / f"progress-r{rank}.json"


def encode_hidden(hidden: torch.Tensor, storage_dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[..., d] states -> (stored tensor, per-vector float32 scale or None). fp8 keeps one scale per token so that
    each vector's largest component maps to the fp8 maximum."""
    if storage_dtype not in STORAGE_DTYPES:
        raise UserError(f"storage dtype {storage_dtype!r} is not supported; expected one of {', '.join(STORAGE_DTYPES)}")
    if storage_dtype != "float8_e4m3":
        return hidden.to(STORAGE_DTYPES[storage_dtype]).contiguous(), None
    hidden32 = hidden.float()
    scale = hidden32.abs().amax(-1).clamp(min=1e-12) / FP8_MAX  # [...]
    stored = (hidden32 / scale[..., None]).to(torch.float8_e4m3fn)
    return stored.contiguous(), scale.contiguous()


def decode_hidden(stored: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if scale is None:
        return stored.to(dtype)
    return (stored.float() * scale[..., None]).to(dtype)


def write_shard(path: Path, samples: list[dict[str, torch.Tensor | int]], storage_dtype: str) -> dict[str, Any]:
    """Write one shard atomically. Each sample: `sample_index` int, `input_ids` [T] , `loss_mask` [T],
    `hidden` [T, d], optional `target_argmax` [T] and `aux_hidden` [T, n_aux, d]. Returns the shard's record (sha256 over the file)."""
    lengths = [int(s["input_ids"].shape[0]) for s in samples]
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    hidden, hidden_scale = encode_hidden(torch.cat([s["hidden"] for s in samples]), storage_dtype)
    tensors = {
        "offsets": offsets,
        "sample_index": torch.tensor([int(s["sample_index"]) for s in samples], dtype=torch.int64),
        "input_ids": torch.cat([s["input_ids"] for s in samples]).to(torch.int32).contiguous(),
        "loss_mask": torch.cat([s["loss_mask"] for s in samples]).to(torch.uint8).contiguous(),
        "hidden": hidden,
    }
    if hidden_scale is not None:
        tensors["hidden_scale"] = hidden_scale
    if samples[0].get("target_argmax") is not None:
        tensors["target_argmax"] = torch.cat([s["target_argmax"] for s in samples]).to(torch.int32).contiguous()
    if samples[0].get("aux_hidden") is not None:
        aux, aux_scale = encode_hidden(torch.cat([s["aux_hidden"] for s in samples]), storage_dtype)
        tensors["aux_hidden"] = aux
        if aux_scale is not None:
            tensors["aux_hidden_scale"] = aux_scale
    data = safetensors_bytes(tensors, {})  # the format version lives in the manifest
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, data)
    return {
        "num_samples": len(samples),
        "num_tokens": int(offsets[-1]),
        "nbytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }


def load_manifest(root: Path) -> dict[str, Any]:
    path = Path(root) / MANIFEST_FILENAME
    if not path.is_file():
        done = sorted(Path(root).glob("progress-r*.json"))
        hint = f" ({len(done)} rank progress file(s) present: precompute has not finished)" if done else ""
        raise UserError(f"{path}: not found{hint}; run `mtp-train precompute` (it resumes)")
    manifest = read_json_object(path)
    if manifest.get("format_version") != FORMAT_VERSION:
        raise UserError(f"{path}: format_version {manifest.get('format_version')!r}, expected {FORMAT_VERSION}")
    missing = missing_manifest_keys(manifest)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise UserError(
            f"{path}: missing or malformed key(s) {shown} (the file was edited or damaged); rebuild the cache with "
            "`mtp-train precompute --force`"
        )
    if manifest["storage_dtype"] not in STORAGE_DTYPES:
        raise UserError(f"{path}: storage_dtype {manifest['storage_dtype']!r} is not one of {', '.join(STORAGE_DTYPES)}")
    return manifest


def missing_manifest_keys(manifest: dict[str, Any]) -> list[str]:
    """Dotted names of the keys a manifest lacks (or holds with the wrong JSON type), e.g. `fingerprints`,
    `splits.train.shards[3].sha256`; empty for a whole manifest."""
    missing = [key for key in MANIFEST_KEYS if key not in manifest]
    fingerprints = manifest.get("fingerprints")
    if "fingerprints" in manifest:
        if not isinstance(fingerprints, dict):
            missing.append("fingerprints (not an object)")
        else:
            missing.extend(f"fingerprints.{key}" for key in FINGERPRINT_KEYS if key not in fingerprints)
    splits = manifest.get("splits")
    if "splits" in manifest and not isinstance(splits, dict):
        return [*missing, "splits (not an object)"]
    for split, info in (splits or {}).items():
        if not isinstance(info, dict):
            missing.append(f"splits.{split} (not an object)")
            continue
        missing.extend(f"splits.{split}.{key}" for key in SPLIT_KEYS if key not in info)
        shards = info.get("shards", [])
        if not isinstance(shards, list):
            missing.append(f"splits.{split}.shards (not a list)")
            continue
        for k, record in enumerate(shards):
            where = f"splits.{split}.shards[{k}]"
            if not isinstance(record, dict):
                missing.append(f"{where} (not an object)")
            else:
                missing.extend(f"{where}.{key}" for key in SHARD_RECORD_KEYS if key not in record)
    return missing


def cache_identity(manifest: dict[str, Any]) -> str:
    """A short hash naming what a feature cache holds: its fingerprints (target, tokenizer, dataset, precompute
    settings) and every shard's sha256. A byte-identical recomputation keeps it; new data, another target or other
    states change it (a checkpoint records it, and training refuses to resume on a cache with another)."""
    hasher = hashlib.sha256()
    for key, value in sorted(manifest.get("fingerprints", {}).items()):
        hasher.update(f"{key}={value}\0".encode())
    for split, info in sorted(manifest.get("splits", {}).items()):
        for record in sorted(info.get("shards", []), key=lambda r: r.get("name", "")):
            hasher.update(f"{split}/{record.get('name')}={record.get('sha256')}\0".encode())
    return hasher.hexdigest()[:16]


def shard_sha256_ok(root: Path, record: dict[str, Any]) -> bool:
    path = root / record["name"]
    return path.is_file() and path.stat().st_size == record["nbytes"] and file_sha256(path) == record["sha256"]


def pack_batches(indices: list[int], lengths: list[int], tokens_per_batch: int) -> list[list[int]]:
    """Consecutive samples of `indices` (precompute's are length-sorted, the training reader's shuffled) packed while the batch stays
    within the token budget; a sample longer than the budget runs alone."""
    batches: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for i in indices:
        if current and tokens + lengths[i] > tokens_per_batch:
            batches.append(current)
            current, tokens = [], 0
        current.append(i)
        tokens += lengths[i]
    if current:
        batches.append(current)
    return batches
