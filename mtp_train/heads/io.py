"""Native head files: `<dir>/model.safetensors` (the head's own tensors only, never the target's embed_tokens or
lm_head) + `<dir>/head_config.json` (the `HeadConfig`, plus `weights_sha256`: the sha256 of model.safetensors as
saved). Both are written to a temporary name and renamed into place, the weights first.

Loading checks the head's integrity after its structure: model.safetensors must still have the recorded sha256
(a head_config.json without one is refused: written by an older mtp-train), and no floating-point weight may be NaN or
Inf (`check_finite`, named by tensor and count; also used on everything `export` reads).

Also the one check of a head against its target (`target_mismatches`): export, inspect and every loader use it."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from mtp_train.errors import UserError
from mtp_train.fileio import atomic_write_bytes, file_sha256, json_bytes, safetensors_bytes
from mtp_train.heads.config import HeadConfig
from mtp_train.heads.draft_head import DraftHead
from mtp_train.heads.kinds import head_class
from mtp_train.heads.vocab import check_d2t_t2d
from mtp_train.runtime.config import ModelConfig
from mtp_train.runtime.model import CausalLM

WEIGHTS_FILENAME = "model.safetensors"
CONFIG_FILENAME = "head_config.json"
TARGET_KEYS = ("hidden_size", "vocab_size", "model_type")  # what a head records of its target, besides the fingerprint
DRAFT_VOCAB_DTYPES = {"d2t": torch.int64, "t2d": torch.bool}  # a reduced draft vocabulary's tensors
WEIGHTS_SHA256_KEY = "weights_sha256"  # head_config.json: hex sha256 of model.safetensors, written by save_head


def _is_frozen_key(key: str) -> bool:
    return any(part in ("embed_tokens", "lm_head") for part in key.split("."))


def target_mismatches(
    recorded: dict[str, Any], config: ModelConfig, fingerprint: str | None, source: str, prefix: str = ""
) -> list[str]:
    """One line per fact in `recorded` (a head config or an exported config.json part: hidden_size, vocab_size,
    model_type, target_fingerprint; `prefix` is its path in the file) that differs from the target's. A key absent
    from `recorded`, and a fingerprint unknown on either side, is not compared."""
    problems = [
        f"{source}: {prefix}{key}={recorded[key]!r} but the target has {key}={getattr(config, key)!r}"
        for key in TARGET_KEYS
        if key in recorded and recorded[key] != getattr(config, key)
    ]
    recorded_fingerprint = recorded.get("target_fingerprint")
    if recorded_fingerprint and fingerprint and recorded_fingerprint != fingerprint:
        problems.append(
            f"{source}: {prefix}target_fingerprint {recorded_fingerprint!r} does not match the target's "
            f"{fingerprint!r} (the head was trained for a different target)"
        )
    return problems


def check_target(head_config: HeadConfig, config: ModelConfig, fingerprint: str | None, source: str) -> None:
    """`target_mismatches` of a head config, raised as a UserError (the first mismatch)."""
    problems = target_mismatches(head_config.to_dict(), config, fingerprint, source)
    if problems:
        raise UserError(problems[0])


def check_head_state(
    state: dict[str, torch.Tensor], head_config: HeadConfig, config: ModelConfig, source: str
) -> None:
    """A native state dict against a head config over a target: no frozen tensors, the names and shapes the head
    has (a DraftHead built on the meta device: nothing is allocated), and (reduced draft vocabulary) d2t int64 / t2d
    bool describing the same draft ids."""
    frozen = sorted(key for key in state if _is_frozen_key(key))
    if frozen:
        raise UserError(
            f"{source}: holds the target's frozen tensor(s) {', '.join(frozen)}; a head file must contain only "
            "the head's own weights (embed_tokens and lm_head are read from the target)"
        )
    with torch.device("meta"):
        embed = torch.nn.Embedding(config.vocab_size, config.hidden_size)
        lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        expected = head_class(head_config.kind)(config, head_config, embed, lm_head).state_dict()
    missing = sorted(expected.keys() - state.keys())
    unexpected = sorted(state.keys() - expected.keys())
    if missing or unexpected:
        parts = [f"missing {', '.join(missing)}"] if missing else []
        parts += [f"unexpected {', '.join(unexpected)}"] if unexpected else []
        if head_config.kind == "eagle3":
            parts.append("an EAGLE-3 midlayer is the engines' draft block (Llama-style; Qwen3-style for a Qwen3 "
                         "target), not a copy of the target's: a head trained with the target's biases or q/k norms "
                         "must be trained again")
        raise UserError(
            f"{source}: tensor names do not match a {head_config.kind} head with {head_config.num_layers} "
            f"layer(s): {'; '.join(parts)}"
        )
    for key, value in expected.items():
        if state[key].shape != value.shape:
            raise UserError(
                f"{source}: tensor {key} has shape {tuple(state[key].shape)}, the target's config implies "
                f"{tuple(value.shape)}"
            )
    if head_config.draft_vocab_size is not None:
        for name, want in DRAFT_VOCAB_DTYPES.items():
            if state[name].dtype != want:
                raise UserError(f"{source}: tensor {name} is {state[name].dtype}, expected {str(want)[6:]}")
        check_d2t_t2d(state["d2t"], state["t2d"], source)


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, as stored; UserError when it is missing or unreadable."""
    if not path.is_file():
        raise UserError(f"{path}: not found")
    try:
        with safe_open(str(path), framework="pt") as f:
            return {key: f.get_tensor(key) for key in f.keys()}
    except Exception as err:
        raise UserError(f"{path}: could not read safetensors ({err})") from None


def save_head(head: DraftHead, directory: str | os.PathLike[str], dtype: torch.dtype | None = None) -> Path:
    """Write the head's weights and config to `directory`; returns the directory. `dtype`: the floating-point tensors'
    storage dtype (default: as they are; d2t/t2d keep int64/bool)."""
    directory = Path(directory)
    state = {key: value.detach().to("cpu") for key, value in head.state_dict().items()}
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    frozen = [key for key in state if _is_frozen_key(key)]
    assert not frozen, f"head state dict holds the target's frozen tensors {frozen}"
    weights = safetensors_bytes(state, {"kind": head.head_config.kind})
    atomic_write_bytes(directory / WEIGHTS_FILENAME, weights)
    atomic_write_bytes(directory / CONFIG_FILENAME, head_config_bytes(head.head_config, sha256_hex(weights)))
    return directory


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def head_config_bytes(head_config: HeadConfig, weights_sha256: str | None) -> bytes:
    """head_config.json's content: the HeadConfig's fields, plus `weights_sha256` (the sha256 of the
    model.safetensors written next to it) when given."""
    data = head_config.to_dict()
    if weights_sha256 is not None:
        data[WEIGHTS_SHA256_KEY] = weights_sha256
    return json_bytes(data)


def read_head_record(directory: str | os.PathLike[str]) -> tuple[HeadConfig, str | None]:
    """(the HeadConfig, the weights_sha256 recorded next to it; None when absent, which `check_integrity` refuses)
    from `<directory>/head_config.json`; UserError naming the file when it is missing or invalid."""
    path = Path(directory) / CONFIG_FILENAME
    if not path.is_file():
        raise UserError(f"{path}: not found (expected a head directory with {CONFIG_FILENAME} and {WEIGHTS_FILENAME})")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"{path}: invalid JSON ({err})") from None
    if not isinstance(data, dict):
        return HeadConfig.from_dict(data, source=str(path)), None  # raises, naming the file
    data = dict(data)
    recorded = data.pop(WEIGHTS_SHA256_KEY, None)
    if recorded is not None and not (
        isinstance(recorded, str) and len(recorded) == 64 and all(c in "0123456789abcdef" for c in recorded)
    ):
        raise UserError(f"{path}: {WEIGHTS_SHA256_KEY}={recorded!r} is not a sha256 (64 lowercase hex digits)")
    return HeadConfig.from_dict(data, source=str(path)), recorded


def read_head_config(directory: str | os.PathLike[str]) -> HeadConfig:
    """The HeadConfig of a head directory (see `read_head_record`)."""
    return read_head_record(directory)[0]


def nonfinite_summary(tensors: dict[str, torch.Tensor]) -> str | None:
    """None when every floating-point tensor is finite; otherwise one phrase naming each tensor that holds NaN or
    Inf values and how many, e.g. "2048 NaN/Inf value(s) in 1 tensor(s): layers.0.mlp.up_proj.weight (2048 NaN)"."""
    found = []
    for name, tensor in tensors.items():
        if not tensor.is_floating_point():
            continue
        nan = int(torch.isnan(tensor).sum())
        inf = int(torch.isinf(tensor).sum())
        if nan or inf:
            counts = ", ".join(f"{n} {what}" for n, what in ((nan, "NaN"), (inf, "Inf")) if n)
            found.append((name, nan + inf, counts))
    if not found:
        return None
    total = sum(n for _, n, _ in found)
    listed = ", ".join(f"{name} ({counts})" for name, _, counts in found)
    return f"{total} NaN/Inf value(s) in {len(found)} tensor(s): {listed}"


def check_finite(tensors: dict[str, torch.Tensor], source: str, hint: str) -> None:
    """UserError naming every NaN/Inf-holding tensor of `tensors` (read from `source`) and the count, then `hint`."""
    summary = nonfinite_summary(tensors)
    if summary:
        raise UserError(f"{source}: {summary}; {hint}")


def check_integrity(
    weights_path: Path, state: dict[str, torch.Tensor], recorded_sha256: str | None, record_source: str
) -> None:
    """A structurally valid head file against the sha256 recorded when it was saved (`recorded_sha256`, from
    `record_source`; None: not recorded, refused), then its weights for NaN/Inf. UserErrors name the file."""
    summary = nonfinite_summary(state)
    if recorded_sha256 is None:
        raise UserError(
            f"{record_source}: no {WEIGHTS_SHA256_KEY}: a head saved by an older mtp-train (before heads carried a "
            f"checksum of {weights_path.name}); train it again with this version"
        )
    else:
        actual = file_sha256(weights_path)
        if actual != recorded_sha256:
            found = f"; it now holds {summary}" if summary else ""
            raise UserError(
                f"{weights_path}: checksum mismatch: sha256 {actual[:16]}... but {record_source} recorded "
                f"{recorded_sha256[:16]}... when the head was saved: the file was changed or corrupted since (or "
                f"the save was interrupted){found}. Restore the head from a good copy or save/train it again"
            )
    if summary:
        raise UserError(
            f"{weights_path}: {summary}; a head with non-finite weights cannot draft (training diverged or the "
            "file is corrupted): retrain it or restore a good copy"
        )


def read_head(
    directory: str | os.PathLike[str], config: ModelConfig, fingerprint: str | None
) -> tuple[dict[str, torch.Tensor], HeadConfig]:
    """The state dict (as stored) and config of a head saved by `save_head`, checked against a target's `config` and
    `fingerprint` (`check_target`, `check_head_state`), then for integrity (`check_integrity`: the recorded sha256,
    no NaN/Inf), without building the head. The structural checks come first: they name the more specific fault."""
    directory = Path(directory)
    head_config, recorded_sha256 = read_head_record(directory)
    check_target(head_config, config, fingerprint, str(directory / CONFIG_FILENAME))
    weights_path = directory / WEIGHTS_FILENAME
    state = read_safetensors(weights_path)
    check_head_state(state, head_config, config, str(weights_path))
    check_integrity(weights_path, state, recorded_sha256, str(directory / CONFIG_FILENAME))
    return state, head_config


def build_head(
    target: CausalLM, head_config: HeadConfig, state: dict[str, torch.Tensor], dtype: torch.dtype | None
) -> DraftHead:
    """A head of its kind's class (`head_class`) over `target` (on its device) holding `state` (checked by `check_head_state`), its floating-point
    tensors in `dtype` (None: as stored; d2t/t2d keep int64/bool)."""
    with torch.device("meta"):
        head = head_class(head_config.kind)(target.config, head_config, target.model.embed_tokens, target.lm_head,
                                            target.backend)
    head.load_state_dict({k: v.to(device=target.device, dtype=(dtype or v.dtype) if v.is_floating_point() else v.dtype)
                          for k, v in state.items()}, assign=True)
    return head


def load_head(directory: str | os.PathLike[str], target: CausalLM, dtype: torch.dtype | None = None,
              target_fingerprint: str | None = None) -> DraftHead:
    """Load a head saved by `save_head` over `target` (on its device; `dtype` default: the target's). The head's
    hidden_size/vocab_size/model_type must match the target's, and its target fingerprint must equal
    `target_fingerprint` (default: `target.fingerprint`) when both are known. Errors are UserErrors naming the file and
    the mismatch or key."""
    state, head_config = read_head(directory, target.config, target_fingerprint or target.fingerprint)
    return build_head(target, head_config, state, dtype or target.dtype)
