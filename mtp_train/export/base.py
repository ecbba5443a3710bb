"""`ExportFormat`: one serving format described once, and everything derived from that description.

A format module declares (class attributes): the head kinds it represents, the tensor-name map between DraftHead's
native names and its own (`renames`, plus `frozen`: the target tensors it stores), how a reduced draft vocabulary
travels (`draft_vocab`), what it refuses, its required config.json fields; and writes its config.json
(`config_json`) and reads back what the head's layout is (`layout`). Writing (`build`), the expected names and
shapes (`expected_tensors`), reading back to native names (`to_native`) and the checks against a target
(`target_problems`, built on the one check `heads.io.target_mismatches`) derive from those. Hooks for what is truly
format-specific default to nothing."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mtp_train.errors import UserError
from mtp_train.export.common import (
    BLOCK_KEY, CONFIG_FILENAME, DRAFT_VOCAB_TENSORS, WEIGHTS_FILENAME, LayerShape, Target, declared_draft_vocab,
    draft_vocab_size_of, native_tensors,
)
from mtp_train.heads.config import HeadConfig
from mtp_train.heads.io import target_mismatches

def missing_fields(config: dict[str, Any], fields: tuple[str, ...]) -> list[str]:
    """The dotted paths in `fields` ("a.b": `config["a"]["b"]`) that `config` lacks."""
    missing = []
    for name in fields:
        node: Any = config
        for part in name.split("."):
            if not isinstance(node, dict) or part not in node:
                missing.append(name)
                break
            node = node[part]
    return missing


@dataclass
class Report:
    """What `inspect` found in a directory."""

    directory: Path
    format: str | None
    config: dict[str, Any]
    tensors: dict[str, tuple[tuple[int, ...], str]]  # name -> (shape, dtype)
    expected: dict[str, tuple[int, ...]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # names, shapes, fields, the target
    # The files' integrity: a file whose sha256 differs from config.json's mtp_train.checksums, NaN/Inf weights.
    integrity: list[str] = field(default_factory=list)
    checksum: str = ""  # one line: "checksum ok (...)", or why it was not verified

    @property
    def ok(self) -> bool:
        return not self.problems and not self.integrity

    @property
    def all_problems(self) -> list[str]:
        return self.problems + self.integrity


class ExportFormat:
    """One serving format. A subclass sets the description below and implements `config_json`, `detect` and
    `layout`; the other hooks are optional."""

    name: str = ""
    description: str = ""
    kinds: tuple[str, ...] = ()  # head kinds this format represents faithfully
    # (native name prefix, format name prefix), first match wins in both directions ("{L}": the exported config's
    # num_hidden_layers). ("", "") keeps every name.
    renames: tuple[tuple[str, str], ...] = (("", ""),)
    # Target tensors the layout stores (written from --target, compared with the target's on load): "embed_tokens" /
    # "lm_head" -> format name.
    frozen: dict[str, str] = {}
    max_layers: int | None = None  # the most decoder layers the layout holds (None: any)
    # How a reduced draft vocabulary travels: "tensors" (d2t/t2d in model.safetensors), "file" (the format's own
    # file, see `extra_files`/`complete_native`) or None (the layout has none, `no_draft_vocab` says why: a reduced
    # head is written drafting over the full vocabulary, see export_head).
    draft_vocab: str | None = None
    no_draft_vocab: str = ""
    block_types: dict[str, str] | None = None  # model_type -> the engine class for that block (None: any block)
    kind_refusal: str = ""  # why another kind is refused; "{alternatives}": the formats that carry the head
    layers_refusal: str = ""  # why more than `max_layers` layers are refused; "{n}": the head's layers
    required_fields: tuple[str, ...] = ()  # config.json fields (dotted paths) a file of this format must have

    # ---- what each format declares in code --------------------------------------------------------------------------

    def config_json(
        self, head_config: HeadConfig, target: Target, dtype: torch.dtype, options: dict[str, Any]
    ) -> dict[str, Any]:
        """The config.json written for the head."""
        raise NotImplementedError

    def detect(self, config: dict[str, Any], names: set[str], directory: Path) -> bool:
        raise NotImplementedError

    def layout(self, config: dict[str, Any], directory: Path) -> tuple[str, int, LayerShape]:
        """(head kind, decoder layers, layer shape) that an exported config.json describes (fields present)."""
        raise NotImplementedError

    # ---- optional hooks ----------------------------------------------------------------------------------------------

    def extra_files(self, state: dict[str, torch.Tensor], head_config: HeadConfig) -> dict[str, Any]:
        """Files besides model.safetensors and config.json: {name: JSON content, or bytes written as they are}."""
        return {}

    def state_refusal(self, state: dict[str, torch.Tensor], head_config: HeadConfig) -> str | None:
        """Why the head's weights (not its config) cannot be written faithfully, e.g. a trained bias the engine's
        loader drops; None when they can."""
        return None

    def serving_files(self, config: dict[str, Any]) -> dict[str, Any]:
        """Files that tell how to serve the export (from the config.json being written): {name: JSON or bytes}."""
        return {}

    def format_state(
        self, state: dict[str, torch.Tensor], head_config: HeadConfig, target: Target
    ) -> dict[str, torch.Tensor]:
        """The native state as the layout stores it, still under native names (e.g. a permuted projection, zero
        biases the engine's block requires); `complete_native` undoes it on reading back."""
        return state

    def adjust_expected(self, config: dict[str, Any], expected: dict[str, tuple[int, ...]]) -> None:
        """Config options that add or remove tensors beyond the mapped native layout."""

    def format_problems(self, config: dict[str, Any], directory: Path) -> list[str]:
        """Format-specific consistency checks of the files themselves."""
        return []

    def format_target_problems(self, config: dict[str, Any], target: Target) -> list[str]:
        """Format-specific mismatches with a target (the shared ones are in `target_problems`)."""
        return []

    def target_fields(self, config: dict[str, Any]) -> tuple[dict[str, Any], str]:
        """(the part of config.json that records target facts, its path prefix) for `target_mismatches`."""
        return config, ""

    def read_head_config(self, config: dict[str, Any], directory: Path) -> HeadConfig:
        block = config.get(BLOCK_KEY)
        source = str(directory / CONFIG_FILENAME)
        if not isinstance(block, dict) or "head_config" not in block:
            raise UserError(f"{source}: no {BLOCK_KEY}.head_config (not exported by mtp-train export)")
        return HeadConfig.from_dict(block["head_config"], source=f"{source} {BLOCK_KEY}.head_config")

    def complete_native(
        self, native: dict[str, torch.Tensor], head_config: HeadConfig, config: dict[str, Any], directory: Path
    ) -> None:
        """Add to a read-back native state dict what the layout keeps elsewhere or implies."""

    # ---- derived: names ----------------------------------------------------------------------------------------------

    def _renames(self, config: dict[str, Any]) -> list[tuple[str, str]]:
        L = config.get("num_hidden_layers")
        return [(native, fmt.format(L=L)) for native, fmt in self.renames]

    def _frozen_names(self, config: dict[str, Any]) -> dict[str, str]:
        return {key: name.format(L=config.get("num_hidden_layers")) for key, name in self.frozen.items()}

    def format_name(self, native_name: str, config: dict[str, Any]) -> str:
        for native, fmt in self._renames(config):
            if native_name.startswith(native):
                return fmt + native_name[len(native) :]
        raise AssertionError(f"format {self.name} has no name for {native_name}")  # refuse_reason rules it out

    def native_name(self, format_name: str, config: dict[str, Any]) -> str | None:
        for native, fmt in sorted(self._renames(config), key=lambda rule: -len(rule[1])):
            if format_name.startswith(fmt):
                return native + format_name[len(fmt) :]
        return None

    # ---- derived: export ---------------------------------------------------------------------------------------------

    def refuse_reason(self, head_config: HeadConfig, target: Target) -> str | None:
        """Why this head cannot be written faithfully (naming what would be lost), or None."""
        if head_config.kind not in self.kinds:
            return self.kind_refusal.format(alternatives=self._alternatives(head_config))
        if self.max_layers is not None and head_config.num_layers > self.max_layers:
            return self.layers_refusal.format(n=head_config.num_layers)
        return self._block_refusal(target.config)

    def _alternatives(self, head_config: HeadConfig) -> str:
        """The engine formats that carry this head's kind, then native."""
        from mtp_train.export.registry import FORMATS  # local: registry imports this module (ExportFormat)

        others = [fmt.name for fmt in FORMATS.values() if fmt.name != "native" and head_config.kind in fmt.kinds]
        return f"{', '.join(others)} or native" if others else "native"

    def _block_refusal(self, config) -> str | None:
        """Why the target's decoder block has no counterpart in the engines' classes for this format, or None."""
        if self.block_types is None:
            return None
        if config.model_type not in self.block_types:
            return (
                f"format {self.name} has no EAGLE-1 loader for model_type {config.model_type!r} "
                f"(supported: {', '.join(sorted(self.block_types))}); the head's block (e.g. Qwen3's q_norm/k_norm) "
                "would be lost; use --format native"
            )
        if config.sliding_window is not None:
            return (
                f"the target attends within a sliding window of {config.sliding_window} tokens; the engines' Llama "
                f"block in format {self.name} has no window, so the head's attention pattern would be lost; use "
                "--format native"
            )
        return None

    def build(
        self,
        state: dict[str, torch.Tensor],
        head_config: HeadConfig,
        target: Target,
        dtype: torch.dtype,
        options: dict[str, Any],
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(tensors for model.safetensors, {file name: JSON content, or bytes written as they are}). Floating-point
        tensors are cast to `dtype`; d2t (int64) / t2d (bool) keep theirs."""
        config = self.config_json(head_config, target, dtype, options)
        tensors = {
            self.format_name(name, config): tensor
            for name, tensor in self.format_state(state, head_config, target).items()
            if self.draft_vocab == "tensors" or name not in DRAFT_VOCAB_TENSORS
        }
        if self.frozen:
            stored = target.frozen_tensors()
            tensors.update({name: stored[key] for key, name in self._frozen_names(config).items()})
        tensors = {name: t.to(dtype) if t.is_floating_point() else t for name, t in tensors.items()}
        files = {**self.extra_files(state, head_config), **self.serving_files(config)}
        return tensors, {CONFIG_FILENAME: config, **files}

    # ---- derived: reading back ---------------------------------------------------------------------------------------

    def expected_tensors(self, config: dict[str, Any], directory: Path) -> dict[str, tuple[int, ...]]:
        """Name -> shape from the exported config alone (required fields already checked present)."""
        kind, num_layers, shape = self.layout(config, directory)
        draft_vocab_size = draft_vocab_size_of(config) if self.draft_vocab == "tensors" else None
        expected = {
            self.format_name(name, config): dims
            for name, dims in native_tensors(kind, num_layers, shape, draft_vocab_size).items()
        }
        for name in self._frozen_names(config).values():
            expected[name] = (shape.vocab_size, shape.hidden_size)
        self.adjust_expected(config, expected)
        return expected

    def problems(self, config: dict[str, Any], directory: Path) -> list[str]:
        """Consistency checks of the files beyond names and shapes."""
        problems = self.format_problems(config, directory)
        if self.draft_vocab is None:
            declared = declared_draft_vocab(config)
            if declared:
                listed = ", ".join(f"{key}={value!r}" for key, value in declared.items())
                problems.append(
                    f"{directory / CONFIG_FILENAME}: {listed}, but format {self.name} cannot carry a reduced draft "
                    f"vocabulary ({self.no_draft_vocab})"
                )
        return problems

    def target_problems(self, config: dict[str, Any], target: Target) -> list[str]:
        """Mismatches between the exported config and a target: the recorded head config, the format's own target
        fields, the layer shape, and the format's specifics."""
        source = CONFIG_FILENAME
        block = config.get(BLOCK_KEY) or {}
        head = dict(block.get("head_config") or {})
        head["target_fingerprint"] = block.get("target_fingerprint") or head.get("target_fingerprint")
        problems = target_mismatches(head, target.config, target.fingerprint, source, f"{BLOCK_KEY}.head_config.")
        fields, prefix = self.target_fields(config)
        problems += target_mismatches(fields, target.config, target.fingerprint, source, prefix)
        try:
            ours = self.layout(config, Path("."))[2].to_dict()
        except UserError as err:
            return problems + [str(err)]
        theirs = self.block_shape(target).to_dict()
        diff = sorted(key for key in ours if key != "model_type" and ours[key] != theirs[key])  # model_type: above
        if diff:
            problems.append(f"{source}: layer shape differs from the target's in {', '.join(diff)}")
        return problems + self.format_target_problems(config, target)

    def block_shape(self, target: Target) -> LayerShape:
        """The layer shape a head of this format has over `target`: the target's own decoder layer (eagle3: the
        engines' draft block)."""
        return target.shape

    def to_native(
        self, tensors: dict[str, torch.Tensor], config: dict[str, Any], directory: Path
    ) -> tuple[dict[str, torch.Tensor], HeadConfig, dict[str, torch.Tensor]]:
        """(native state dict, head config, frozen tensors found in the file: {"embed_tokens", "lm_head"})."""
        source = directory / CONFIG_FILENAME
        head_config = self.read_head_config(config, directory)
        kind, num_layers, _ = self.layout(config, directory)
        if (head_config.kind, head_config.num_layers) != (kind, num_layers):
            raise UserError(
                f"{source}: {BLOCK_KEY}.head_config says kind={head_config.kind!r}, num_layers="
                f"{head_config.num_layers}; this {self.name} export holds a {kind} head with {num_layers} layer(s)"
            )
        if head_config.draft_vocab_size is not None and self.draft_vocab is None:
            raise UserError(
                f"{source}: {BLOCK_KEY}.head_config.draft_vocab_size={head_config.draft_vocab_size}; a {self.name} "
                f"export cannot carry a reduced draft vocabulary ({self.no_draft_vocab})"
            )
        frozen_keys = {name: key for key, name in self._frozen_names(config).items()}
        native: dict[str, torch.Tensor] = {}
        frozen: dict[str, torch.Tensor] = {}
        for name, tensor in tensors.items():
            native_name = self.native_name(name, config)
            if name in frozen_keys:
                frozen[frozen_keys[name]] = tensor
            elif native_name is None:
                raise UserError(f"{directory / WEIGHTS_FILENAME}: unexpected tensor {name}")
            else:
                native[native_name] = tensor
        self.complete_native(native, head_config, config, directory)
        return native, head_config, frozen
