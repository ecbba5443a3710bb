"""Native head files: `<dir>/model.safetensors` (the head's own tensors only, never the target's embed_tokens or
lm_head) + `<dir>/head_config.json`. Both are written to a temporary name and renamed into place."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from mtp_train.errors import UserError
from mtp_train.fileio import atomic_write_bytes
from mtp_train.heads.config import HeadConfig
from mtp_train.heads.draft_head import DraftHead
from mtp_train.heads.vocab import check_d2t_t2d
from mtp_train.runtime.model import CausalLM

WEIGHTS_FILENAME = "model.safetensors"
CONFIG_FILENAME = "head_config.json"


def _is_frozen_key(key: str) -> bool:
    return any(part in ("embed_tokens", "lm_head") for part in key.split("."))


def check_state_shapes(
    state: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], head_config: HeadConfig, source: str
) -> None:
    """Tensor names and shapes of a head file (name -> shape) against what the head config implies; a UserError
    names the missing/unexpected keys or the first wrong shape."""
    missing = sorted(expected.keys() - state.keys())
    unexpected = sorted(state.keys() - expected.keys())
    if missing or unexpected:
        parts = [f"missing {', '.join(missing)}"] if missing else []
        parts += [f"unexpected {', '.join(unexpected)}"] if unexpected else []
        raise UserError(
            f"{source}: tensor names do not match a {head_config.kind} head with {head_config.num_layers} "
            f"layer(s): {'; '.join(parts)}"
        )
    for key, dims in expected.items():
        if tuple(state[key]) != tuple(dims):
            raise UserError(f"{source}: tensor {key} has shape {tuple(state[key])}, the target's config implies {dims}")


def save_head(head: DraftHead, directory: str | os.PathLike[str], dtype: torch.dtype | None = None) -> Path:
    """Write the head's weights and config to `directory`; returns the directory. `dtype`: the floating-point tensors'
    storage dtype (default: as they are; d2t/t2d keep int64/bool)."""
    from safetensors.torch import save

    directory = Path(directory)
    state = {key: value.detach().to("cpu").contiguous() for key, value in head.state_dict().items()}
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    frozen = [key for key in state if _is_frozen_key(key)]
    assert not frozen, f"head state dict holds the target's frozen tensors {frozen}"
    metadata = {"format": "pt", "kind": head.head_config.kind}
    atomic_write_bytes(directory / WEIGHTS_FILENAME, save(state, metadata=metadata))
    atomic_write_bytes(directory / CONFIG_FILENAME, head.head_config.to_json().encode("utf-8"))
    return directory


def read_head_config(directory: str | os.PathLike[str]) -> HeadConfig:
    path = Path(directory) / CONFIG_FILENAME
    if not path.is_file():
        raise UserError(f"{path}: not found (expected a head directory with {CONFIG_FILENAME} and {WEIGHTS_FILENAME})")
    return HeadConfig.from_json(path.read_text(encoding="utf-8"), source=str(path))


def load_head(
    directory: str | os.PathLike[str],
    target: CausalLM,
    dtype: torch.dtype | None = None,
    target_fingerprint: str | None = None,
) -> DraftHead:
    """Load a head saved by `save_head` over `target` (on its device; `dtype` default: the target's). The head's
    hidden_size/vocab_size/model_type must match the target's, and its target fingerprint must equal
    `target_fingerprint` (default: `target.fingerprint`) when both are known. Errors are UserErrors naming the file and the mismatch or key."""
    from safetensors import safe_open

    directory = Path(directory)
    head_config = read_head_config(directory)
    config_path = directory / CONFIG_FILENAME
    target_config = target.config
    for key in ("hidden_size", "vocab_size", "model_type"):
        head_value, target_value = getattr(head_config, key), getattr(target_config, key)
        if head_value != target_value:
            raise UserError(f"{config_path}: {key}={head_value!r} but the target has {key}={target_value!r}")
    target_fingerprint = target_fingerprint or target.fingerprint
    if head_config.target_fingerprint and target_fingerprint and head_config.target_fingerprint != target_fingerprint:
        raise UserError(
            f"{config_path}: target_fingerprint {head_config.target_fingerprint!r} does not match the target's "
            f"{target_fingerprint!r} (the head was trained for a different target)"
        )

    weights_path = directory / WEIGHTS_FILENAME
    if not weights_path.is_file():
        raise UserError(f"{weights_path}: not found")
    try:
        with safe_open(str(weights_path), framework="pt") as f:
            state = {key: f.get_tensor(key) for key in f.keys()}
    except Exception as err:
        raise UserError(f"{weights_path}: could not read safetensors ({err})") from None
    frozen = sorted(key for key in state if _is_frozen_key(key))
    if frozen:
        raise UserError(
            f"{weights_path}: holds the target's frozen tensor(s) {', '.join(frozen)}; a head file must contain only "
            "the head's own weights (embed_tokens and lm_head are read from the target)"
        )

    with torch.device("meta"):
        head = DraftHead(target_config, head_config, target.model.embed_tokens, target.lm_head, target.backend)
    check_state_shapes(
        {k: tuple(v.shape) for k, v in state.items()},
        {k: tuple(v.shape) for k, v in head.state_dict().items()},
        head_config, str(weights_path),
    )
    dtype = dtype or target.dtype
    head.load_state_dict(
        {k: v.to(device=target.device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in state.items()},
        assign=True,
    )
    if head_config.draft_vocab_size is not None:
        check_d2t_t2d(head.d2t, head.t2d, str(weights_path))
    return head
