"""The interface every export format implements, and the checks shared by `inspect` and `load_any_head`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mtp_train.errors import UserError
from mtp_train.export.common import (
    BLOCK_KEY,
    TENSOR_DTYPE_NAMES,
    LayerShape,
    TargetInfo,
)
from mtp_train.heads.config import HeadConfig

_MISSING = object()


def get_path(data: dict[str, Any], dotted: str) -> Any:
    """`data["a"]["b"]` for "a.b"; `_MISSING` when any step is absent."""
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def missing_fields(config: dict[str, Any], fields: list[str]) -> list[str]:
    return [name for name in fields if get_path(config, name) is _MISSING]


@dataclass
class TargetView:
    """The facts about a target that format checks compare against."""

    model_type: str
    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    architectures: list[str]
    fingerprint: str | None
    config: Any  # runtime ModelConfig
    shape: LayerShape

    @staticmethod
    def of(target: Any) -> "TargetView":
        """From a `TargetInfo` or a loaded `CausalLM`."""
        if isinstance(target, TargetInfo):
            raw, config, fingerprint = target.raw, target.config, target.fingerprint
        else:  # CausalLM
            config = target.config
            hf = config.hf_config
            raw = hf.to_dict() if hf is not None else {}
            raw.setdefault("model_type", config.model_type)
            fingerprint = target.fingerprint
        return TargetView(
            model_type=config.model_type,
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
            num_hidden_layers=config.num_hidden_layers,
            architectures=list(raw.get("architectures") or []),
            fingerprint=fingerprint,
            config=config,
            shape=LayerShape.from_hf_dict({**raw, "model_type": config.model_type}, "target config"),
        )


@dataclass
class Report:
    """What `inspect` found in a directory."""

    directory: Path
    format: str | None
    config: dict[str, Any]
    tensors: dict[str, tuple[tuple[int, ...], str]]  # name -> (shape, dtype)
    expected: dict[str, tuple[int, ...]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


class ExportFormat:
    """One serving format. Subclasses set `name`, `kinds` and implement the hooks below."""

    name: str = ""
    kinds: tuple[str, ...] = ()  # head kinds this format can represent faithfully
    frozen_in_file: bool = False  # whether the target's embed_tokens / lm_head are written (and thus need --target)
    description: str = ""

    # ---- export ---------------------------------------------------------------------------------------------------

    def refuse_reason(self, head_config: HeadConfig, target: TargetInfo) -> str | None:
        """Why this head cannot be written faithfully (naming what would be lost), or None."""
        raise NotImplementedError

    def build(
        self,
        state: dict[str, torch.Tensor],
        head_config: HeadConfig,
        target: TargetInfo,
        dtype: torch.dtype,
        options: dict[str, Any],
    ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
        """(tensors for model.safetensors, {file name: JSON content, or bytes written as they are})."""
        raise NotImplementedError

    # ---- reading back ---------------------------------------------------------------------------------------------

    def detect(self, config: dict[str, Any], names: set[str], directory: Path) -> bool:
        raise NotImplementedError

    def required_fields(self, config: dict[str, Any]) -> list[str]:
        raise NotImplementedError

    def expected_tensors(self, config: dict[str, Any], directory: Path) -> dict[str, tuple[int, ...]]:
        """Name -> shape from the exported config alone (fields already checked present)."""
        raise NotImplementedError

    def extra_problems(self, config: dict[str, Any], directory: Path) -> list[str]:
        """Format-specific consistency checks of the files themselves."""
        return []

    def target_problems(self, config: dict[str, Any], target: TargetView) -> list[str]:
        """Mismatches between the exported config and a target."""
        return []

    def to_native(
        self, tensors: dict[str, torch.Tensor], config: dict[str, Any], directory: Path
    ) -> tuple[dict[str, torch.Tensor], HeadConfig, dict[str, torch.Tensor]]:
        """(native state dict, head config, frozen tensors found in the file: {"embed_tokens", "lm_head"})."""
        raise NotImplementedError

    # ---- shared helpers -------------------------------------------------------------------------------------------

    @staticmethod
    def head_config_of(config: dict[str, Any], source: str) -> HeadConfig:
        block = config.get(BLOCK_KEY)
        if not isinstance(block, dict) or "head_config" not in block:
            raise UserError(f"{source}: no {BLOCK_KEY}.head_config (not exported by mtp-train export)")
        return HeadConfig.from_dict(block["head_config"], source=f"{source} {BLOCK_KEY}.head_config")

    @staticmethod
    def common_target_problems(config: dict[str, Any], target: TargetView, source: str) -> list[str]:
        """hidden/vocab/model_type/fingerprint of the recorded head config against the target."""
        problems = []
        block = config.get(BLOCK_KEY) or {}
        head = block.get("head_config") or {}
        for key in ("hidden_size", "vocab_size", "model_type"):
            if key in head and head[key] != getattr(target, key):
                problems.append(
                    f"{source}: {BLOCK_KEY}.head_config.{key}={head[key]!r} but the target has {key}={getattr(target, key)!r}"
                )
        recorded = block.get("target_fingerprint") or head.get("target_fingerprint")
        if recorded and target.fingerprint and recorded != target.fingerprint:
            problems.append(
                f"{source}: {BLOCK_KEY}.target_fingerprint {recorded!r} does not match the target's {target.fingerprint!r} "
                "(exported for a different target)"
            )
        return problems

    @staticmethod
    def dtype_problems(config: dict[str, Any], tensors: dict[str, tuple[tuple[int, ...], str]], key: str, source: str) -> list[str]:
        """`config[key]` (torch_dtype) against the floating-point tensors (d2t/t2d keep int64/bool; checked apart)."""
        declared = config.get(key)
        found = sorted({dtype for name, (_, dtype) in tensors.items() if name not in ("d2t", "t2d")})
        if declared is None or not found:
            return []
        if found != [declared]:
            return [f"{source}: {key}={declared!r} but the tensors are {', '.join(found)}"]
        return []


def layer_shape_problems(config: dict, target, source: str) -> list[str]:
    try:
        shape = LayerShape.from_hf_dict(config, source)
    except UserError as err:
        return [str(err)]
    ours, theirs = shape.to_dict(), target.shape.to_dict()
    ours["model_type"] = theirs["model_type"]  # compared separately (an engine config may rename it)
    diff = sorted(k for k in ours if ours[k] != theirs[k])
    return [f"{source}: layer shape differs from the target's in {', '.join(diff)}"] if diff else []


def dtype_name(tensor: torch.Tensor) -> str:
    return TENSOR_DTYPE_NAMES.get(tensor.dtype, str(tensor.dtype))


def declared_draft_vocab(config: dict[str, Any]) -> dict[str, Any]:
    """The draft vocabulary sizes an exported config.json declares: its top-level `draft_vocab_size` and its
    `mtp_train.head_config.draft_vocab_size`, each only when present and not null."""
    block = config.get(BLOCK_KEY) if isinstance(config.get(BLOCK_KEY), dict) else {}
    head = block.get("head_config") if isinstance(block.get("head_config"), dict) else {}
    found = {
        "draft_vocab_size": config.get("draft_vocab_size"),
        f"{BLOCK_KEY}.head_config.draft_vocab_size": head.get("draft_vocab_size"),
    }
    return {key: value for key, value in found.items() if value is not None}


def draft_vocab_size_of(config: dict[str, Any]) -> int | None:
    """N for a format that carries a draft vocabulary (None = the full vocabulary): the top-level `draft_vocab_size`,
    which must equal `mtp_train.head_config.draft_vocab_size` and lie in [1, vocab_size]; a UserError otherwise."""
    declared = declared_draft_vocab(config)
    top = declared.get("draft_vocab_size")
    recorded = declared.get(f"{BLOCK_KEY}.head_config.draft_vocab_size")
    if top != recorded:
        raise UserError(
            f"draft_vocab_size={top!r} but {BLOCK_KEY}.head_config.draft_vocab_size={recorded!r} (both must name the "
            "same draft vocabulary, or both be absent/null for the full vocabulary)"
        )
    if top is None:
        return None
    vocab = config.get("vocab_size")
    if not isinstance(top, int) or isinstance(top, bool) or not (isinstance(vocab, int) and 1 <= top <= vocab):
        raise UserError(f"draft_vocab_size={top!r}; expected an integer between 1 and vocab_size={vocab!r}")
    return top


def no_draft_vocab_problems(config: dict[str, Any], format_name: str, why: str, source: str) -> list[str]:
    """For a format whose loaders have no draft vocabulary: a problem naming any declared one."""
    declared = declared_draft_vocab(config)
    if not declared:
        return []
    listed = ", ".join(f"{key}={value!r}" for key, value in declared.items())
    return [f"{source}: {listed}, but format {format_name} cannot carry a reduced draft vocabulary ({why})"]
