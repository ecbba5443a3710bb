"""`native`: what our own runtime loads.

Files: `model.safetensors` (the head's own tensors under DraftHead's state-dict names, exactly what
`heads.save_head` writes; never the target's embed_tokens / lm_head), `head_config.json` (`HeadConfig`, so
`heads.load_head` reads the directory as is) and `config.json` describing it for other tools:

    format "mtp_train.native", format_version, head_kind, num_layers, model_type, hidden_size, vocab_size,
    norms {enorm, hnorm, input_layernorm[per layer], final_norm}, fc_bias, input_projection ("eh_proj" | "fc"),
    concat_order ["embed", "hidden"], layer {the decoder layer's shape}, layer_ids (the ids serving engines give the
    head's layers: target num_hidden_layers + j), target_fingerprint, target_num_hidden_layers,
    hidden_state_input ("final_norm_output"), draft_feedback, torch_dtype, mtp_train {...}

Both head kinds are representable. Tensor names:
    mtp:    enorm.weight, hnorm.weight, eh_proj.weight [d, 2d] (columns: embed | hidden), layers.{j}.*, norm.weight
    eagle1: fc.weight [d, 2d], fc.bias [d], layers.{j}.* (no layers.0.input_layernorm), no norm
A reduced draft vocabulary of N tokens adds `d2t` int64 [N] (target id = i + d2t[i]) and `t2d` bool [V] (the names
and dtypes `heads.save_head` writes, the EAGLE-3 pair vLLM/SGLang/speculators read) and `draft_vocab_size: N` to
config.json; `torch_dtype` describes the floating-point tensors only. A full-vocabulary head has neither.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mtp_train.errors import UserError
from mtp_train.export.base import ExportFormat, draft_vocab_size_of
from mtp_train.export.common import (
    BLOCK_KEY,
    DTYPE_NAMES,
    FEEDBACK,
    FORMAT_VERSION,
    HEAD_CONFIG_FILENAME,
    HIDDEN_STATE_INPUT,
    WEIGHTS_FILENAME,
    LayerShape,
    TargetInfo,
    cast_floating,
    draft_vocab_tensor_problems,
    mtp_train_block,
    native_tensors,
    read_safetensors_header,
)
from mtp_train.heads.config import HeadConfig

NATIVE_FORMAT_TAG = "mtp_train.native"


class NativeFormat(ExportFormat):
    name = "native"
    kinds = ("mtp", "eagle1")
    description = "our runtime (heads.load_head / export.load_any_head)"

    def refuse_reason(self, head_config: HeadConfig, target: TargetInfo) -> str | None:
        return None

    def build(self, state, head_config, target, dtype, options):
        n = head_config.num_layers
        is_mtp = head_config.kind == "mtp"
        config: dict[str, Any] = {
            "format": NATIVE_FORMAT_TAG,
            "format_version": FORMAT_VERSION,
            "architectures": ["MtpTrainDraftHead"],
            "head_kind": head_config.kind,
            "num_layers": n,
            "model_type": head_config.model_type,
            "hidden_size": head_config.hidden_size,
            "vocab_size": head_config.vocab_size,
            "norms": {
                "enorm": is_mtp,
                "hnorm": is_mtp,
                "input_layernorm": [is_mtp or j > 0 for j in range(n)],
                "final_norm": is_mtp,
            },
            "fc_bias": not is_mtp,
            "input_projection": "eh_proj" if is_mtp else "fc",
            "concat_order": ["embed", "hidden"],
            "layer": target.shape.to_dict(),
            "layer_ids": [target.config.num_hidden_layers + j for j in range(n)],
            "target_fingerprint": head_config.target_fingerprint or target.fingerprint,
            "target_num_hidden_layers": target.config.num_hidden_layers,
            "hidden_state_input": HIDDEN_STATE_INPUT,
            "draft_feedback": FEEDBACK[head_config.kind],
            "torch_dtype": DTYPE_NAMES[dtype],
            BLOCK_KEY: mtp_train_block(self.name, head_config),
        }
        if head_config.draft_vocab_size is not None:  # only then: a full-vocabulary export stays as it was
            config["draft_vocab_size"] = head_config.draft_vocab_size
        tensors = cast_floating(state, dtype)
        return tensors, {"config.json": config, HEAD_CONFIG_FILENAME: head_config.to_dict()}

    # ---- reading back ---------------------------------------------------------------------------------------------

    def detect(self, config, names, directory):
        return config.get("format") == NATIVE_FORMAT_TAG or (directory / HEAD_CONFIG_FILENAME).is_file()

    def required_fields(self, config):
        return [
            "format",
            "format_version",
            "head_kind",
            "num_layers",
            "model_type",
            "hidden_size",
            "vocab_size",
            "norms",
            "fc_bias",
            "layer",
            "layer_ids",
            "target_fingerprint",
            "hidden_state_input",
            "torch_dtype",
        ]

    def _layer_shape(self, config: dict[str, Any], directory: Path) -> LayerShape:
        layer = config.get("layer")
        if not isinstance(layer, dict):
            raise UserError(f"{directory / 'config.json'}: field layer must be an object")
        try:
            return LayerShape(**layer)
        except TypeError as err:
            raise UserError(f"{directory / 'config.json'}: field layer: {err}") from None

    def expected_tensors(self, config, directory):
        if config["head_kind"] not in self.kinds:
            raise UserError(f"{directory / 'config.json'}: head_kind {config['head_kind']!r}; expected mtp or eagle1")
        draft_vocab_size = draft_vocab_size_of(config)
        shape = self._layer_shape(config, directory)
        return native_tensors(config["head_kind"], int(config["num_layers"]), shape, draft_vocab_size)

    def _read_head_config(self, directory: Path) -> HeadConfig:
        path = directory / HEAD_CONFIG_FILENAME
        if not path.is_file():
            raise UserError(f"{path}: not found (a native export keeps head_config.json next to model.safetensors)")
        return HeadConfig.from_json(path.read_text(encoding="utf-8"), source=str(path))

    def extra_problems(self, config, directory):
        try:
            head_config = self._read_head_config(directory)
        except UserError as err:
            return [str(err)]
        problems = []
        source = directory / "config.json"
        for key, value in (
            ("head_kind", head_config.kind),
            ("num_layers", head_config.num_layers),
            ("hidden_size", head_config.hidden_size),
            ("vocab_size", head_config.vocab_size),
            ("model_type", head_config.model_type),
        ):
            if config.get(key) != value:
                problems.append(f"{source}: {key}={config.get(key)!r} but {HEAD_CONFIG_FILENAME} says {value!r}")
        layer = config.get("layer") or {}
        for key in ("hidden_size", "vocab_size"):
            if key in layer and layer[key] != config.get(key):
                problems.append(f"{source}: layer.{key}={layer[key]!r} but {key}={config.get(key)!r}")
        if config.get("draft_vocab_size") != head_config.draft_vocab_size:
            problems.append(
                f"{source}: draft_vocab_size={config.get('draft_vocab_size')!r} but {HEAD_CONFIG_FILENAME} says "
                f"{head_config.draft_vocab_size!r}"
            )
        elif head_config.draft_vocab_size is not None:
            weights = directory / WEIGHTS_FILENAME
            problems += draft_vocab_tensor_problems(
                weights, read_safetensors_header(weights), head_config.vocab_size, head_config.draft_vocab_size
            )
        return problems

    def target_problems(self, config, target):
        source = "config.json"
        problems = self.common_target_problems(config, target, source)
        for key in ("hidden_size", "vocab_size", "model_type"):
            if config.get(key) != getattr(target, key):
                problems.append(f"{source}: {key}={config.get(key)!r} but the target has {key}={getattr(target, key)!r}")
        layer = config.get("layer")
        if isinstance(layer, dict) and layer != target.shape.to_dict():
            diff = sorted(k for k in set(layer) | set(target.shape.to_dict()) if layer.get(k) != target.shape.to_dict().get(k))
            problems.append(f"{source}: layer shape differs from the target's in {', '.join(diff)}")
        recorded = config.get("target_fingerprint")
        if recorded and target.fingerprint and recorded != target.fingerprint:
            problems.append(
                f"{source}: target_fingerprint {recorded!r} does not match the target's {target.fingerprint!r}"
            )
        return problems

    def to_native(self, tensors, config, directory):
        return dict(tensors), self._read_head_config(directory), {}


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise UserError(f"{path}: invalid JSON ({err})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object")
    return data


__all__ = ["NativeFormat", "NATIVE_FORMAT_TAG", "read_json"]
