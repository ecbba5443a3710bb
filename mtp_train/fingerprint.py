"""Fingerprints that tie caches to what made them: a target model's config and weights.

Every cache (features, runs, heads) records these and refuses to mix with another target.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from mtp_train.errors import UserError
from mtp_train.fileio import file_sha256, read_json_object

# Keys of config.json that describe the file, not the model.
_VOLATILE_CONFIG_KEYS = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "architectures", "use_cache"}
# Above this size a weights file is identified by its safetensors header (names, dtypes, shapes, offsets), its size
# and samples of its bytes, not a full read (a 70B target is 140 GB).
_FULL_HASH_LIMIT = 2 << 30
_SAMPLE_BYTES = 1 << 20


def _hash_weights(path: Path, hasher: Any) -> None:
    """Feed a weights file into `hasher`: all its bytes, or above `_FULL_HASH_LIMIT` its safetensors header, its
    size and samples of its bytes."""
    size = path.stat().st_size
    if size <= _FULL_HASH_LIMIT:
        file_sha256(path, hasher)
        return
    with path.open("rb") as stream:
        header_len = int.from_bytes(stream.read(8), "little")
        stream.seek(0)
        hasher.update(stream.read(8 + header_len))
        hasher.update(str(size).encode())
        for fraction in (0.25, 0.5, 0.75):
            stream.seek(int(size * fraction))
            hasher.update(stream.read(_SAMPLE_BYTES))
        stream.seek(max(0, size - _SAMPLE_BYTES))
        hasher.update(stream.read())


def target_fingerprint(model_dir: str | Path) -> str:
    """sha256 over the model's config (minus volatile keys) and its safetensors weights; first 16 hex digits."""
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise UserError(f"{config_path}: not found (expected a HF model directory)")
    config = {k: v for k, v in read_json_object(config_path).items() if k not in _VOLATILE_CONFIG_KEYS}
    hasher = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    for weights in sorted(model_dir.glob("*.safetensors")):
        hasher.update(weights.name.encode() + b"\0")
        _hash_weights(weights, hasher)
    return hasher.hexdigest()[:16]

