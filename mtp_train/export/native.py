"""`native`: what our own runtime loads.

Files: `model.safetensors` (the head's own tensors under DraftHead's state-dict names, exactly what
`heads.save_head` writes; never the target's embed_tokens / lm_head), `head_config.json` (`HeadConfig` and the
weights' `weights_sha256`, as `heads.save_head` writes it, so `heads.load_head` reads the directory as is) and
`config.json` describing it for other tools:

    format "mtp_train.native", format_version, head_kind, num_layers, model_type, hidden_size, vocab_size,
    norms {enorm, hnorm, input_layernorm[per layer], final_norm}, fc_bias, input_projection ("eh_proj" | "fc"),
    concat_order ["embed", "hidden"], layer {the decoder layer's shape}, layer_ids (the ids serving engines give the
    head's layers: target num_hidden_layers + j), target_fingerprint, target_num_hidden_layers,
    hidden_state_input ("final_norm_output"), draft_feedback, torch_dtype, mtp_train {...}

The mtp and eagle1 kinds are representable (an eagle3 head is refused: its run's head/ is its native form, and
`eagle3` its engine format). Tensor names:
    mtp:    enorm.weight, hnorm.weight, eh_proj.weight [d, 2d] (columns: embed | hidden), layers.{j}.*, norm.weight
    eagle1: fc.weight [d, 2d], fc.bias [d] (absent for a head trained with head.fc_bias: false; config.json fc_bias),
            layers.{j}.* (no layers.0.input_layernorm), no norm
A reduced draft vocabulary of N tokens adds `d2t` int64 [N] (target id = i + d2t[i]) and `t2d` bool [V] (the names
and dtypes `heads.save_head` writes, the EAGLE-3 pair vLLM/SGLang/speculators read) and `draft_vocab_size: N` to
config.json; `torch_dtype` describes the floating-point tensors only. A full-vocabulary head has neither.
"""

from __future__ import annotations

from typing import Any

from mtp_train.errors import UserError
from mtp_train.export.base import ExportFormat
from mtp_train.export.common import (
    BLOCK_KEY, CONFIG_FILENAME, DTYPE_NAMES, FEEDBACK, FORMAT_VERSION, HEAD_CONFIG_FILENAME, HIDDEN_STATE_INPUT,
    WEIGHTS_FILENAME, LayerShape, draft_vocab_tensor_problems, mtp_train_block, read_safetensors_header,
)
from mtp_train.heads.config import HeadConfig
from mtp_train.heads.io import read_head_config

NATIVE_FORMAT_TAG = "mtp_train.native"


class NativeFormat(ExportFormat):
    name = "native"
    kinds = ("mtp", "eagle1")
    kind_refusal = (
        "this layout describes mtp and eagle1 heads; an eagle3 head's native form is its run's head/ directory "
        "itself (what `eval --head` and `generate --head` load), and engines read it as --format eagle3"
    )
    description = "our runtime (heads.load_head / export.load_any_head)"
    draft_vocab = "tensors"
    required_fields = (
        "format", "format_version", "head_kind", "num_layers", "model_type", "hidden_size", "vocab_size", "norms",
        "fc_bias", "layer", "layer_ids", "target_fingerprint", "hidden_state_input", "torch_dtype",
    )

    def config_json(self, head_config, target, dtype, options):
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
            "fc_bias": head_config.kind == "eagle1" and head_config.fc_bias,
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
        return config

    def _block_refusal(self, config):
        if config.deepseek is not None:  # runtime/deepseek.py: an MLA/MoE block, not the `layer` shape recorded here
            return (
                f"format native's config.json describes a Llama-family decoder layer (`layer`); the {config.model_type} "
                "target's MLA/MoE block is not one. The run's head/ directory is this head's native form (eval --head, "
                "generate --head and heads.load_head read it); engines and load_any_head read --format deepseek-mtp"
            )
        return super()._block_refusal(config)

    def adjust_expected(self, config, expected):
        if config["head_kind"] == "eagle1" and not config["fc_bias"]:  # trained with head.fc_bias: false
            expected.pop("fc.bias", None)

    def extra_files(self, state, head_config):
        return {HEAD_CONFIG_FILENAME: head_config.to_dict()}

    # ---- reading back ---------------------------------------------------------------------------------------------

    def detect(self, config, names, directory):
        return config.get("format") == NATIVE_FORMAT_TAG or (directory / HEAD_CONFIG_FILENAME).is_file()

    def layout(self, config, directory):
        source = directory / CONFIG_FILENAME
        if config["head_kind"] not in self.kinds:
            raise UserError(f"{source}: head_kind {config['head_kind']!r}; expected mtp or eagle1")
        layer = config.get("layer")
        if not isinstance(layer, dict):
            raise UserError(f"{source}: field layer must be an object")
        try:
            shape = LayerShape(**layer)
        except TypeError as err:
            raise UserError(f"{source}: field layer: {err}") from None
        return config["head_kind"], int(config["num_layers"]), shape

    def read_head_config(self, config, directory) -> HeadConfig:
        return read_head_config(directory)

    def format_problems(self, config, directory):
        try:
            head_config = read_head_config(directory)
        except UserError as err:
            return [str(err)]
        problems = []
        source = directory / CONFIG_FILENAME
        for key, value in (("head_kind", head_config.kind), ("num_layers", head_config.num_layers),
                           ("hidden_size", head_config.hidden_size), ("vocab_size", head_config.vocab_size),
                           ("model_type", head_config.model_type)):
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


__all__ = ["NativeFormat", "NATIVE_FORMAT_TAG"]
