"""`speculators`: the vLLM `speculators` library format (`speculators_model_type: "eagle"`), for the EAGLE-1 head.

Matched against (read through the code index; commits as stored there):
- vllm-project/speculators src/speculators/models/eagle.py @ 0370128df4b39771b445947586c8d9152000fdc3
  (`EagleSpeculatorConfig` / `EagleSpeculator`): `fusion_fc = Linear(2d, d, bias=fusion_bias)` over
  `cat([embeds, hidden_states])` (embed first, as ours), one `transformer` = `LlamaDecoderLayer`, whose
  input_layernorm is replaced by Identity unless `layernorms`; with `layernorms=True` it adds `embedding_layernorm`
  (on the embeddings only) and `pre_lm_head_layernorm` (before the lm_head) and keeps `transformer.input_layernorm`.
  embed_tokens / lm_head / rotary come from the attached verifier and are not stored.
- src/speculators/config.py @ 03a7c1497cdbb0cf6a3cdffc86aead090034c285: `speculators_model_type`,
  `speculators_version`, `speculators_config {algorithm, proposal_methods[{proposal_type, speculative_tokens}],
  default_proposal_method, verifier {name_or_path, architectures}}`.
- src/speculators/convert/eagle/eagle_converter.py @ 035f9e0ced69db9a242b1c6df7e5968e2df29761: EAGLE names map
  `fc.` -> `fusion_fc.`, `layers.0.` -> `transformer.`; transformer_layer_config is a LlamaConfig with
  num_hidden_layers=1 and tie_word_embeddings=false.
- vLLM vllm/transformers_utils/configs/speculators/base.py @ 94699746757f9d68e2f4bd89ad2c4b10ed962457 checks
  `speculators_config.proposal_methods[0].speculative_tokens`, `speculators_config.verifier.name_or_path`,
  `speculators_model_type` and a dict `transformer_layer_config`; algos.py @ cfb173ab8e1b8e44dd35f8b5188255b6a03e13ec
  registers only "eagle3", so that vLLM rejects `speculators_model_type: "eagle"`. The older mapping
  (configs/speculators/eagle.py @ 2748f013768b14037daa5f0bbb0c33fc68dfcebd: fusion_bias -> eagle_fc_bias,
  layernorms -> add_para_norm, architectures ["EAGLEModel"]) targeted the V0 `EAGLE` class
  (vllm/model_executor/models/eagle.py @ 8065a519ccc1cfdc47d90b3b8bd74232dfee6f67), gone with the V0 engine.

Layout written (EAGLE-1 head, one layer, Llama-block target):

    fusion_fc.weight  [d, 2d]   columns :d read embed(t), d: read the hidden state
    fusion_fc.bias    [d]       (fusion_bias: true)
    transformer.self_attn.*, transformer.mlp.*, transformer.post_attention_layernorm.weight
    (no transformer.input_layernorm: layernorms: false)

Why the MTP head is refused: `layernorms=True` would map enorm -> embedding_layernorm, layers.0.input_layernorm ->
transformer.input_layernorm and the final norm -> pre_lm_head_layernorm with the same math and order, but the
speculator has no norm on the verifier's hidden state, so hnorm would be lost (fusion_fc would read H instead of
hnorm(H), and RMSNorm is not linear, so no weight folding recovers it). Heads with more than one layer are refused
(one `transformer`), and non-Llama blocks too (`EagleSpeculator` always builds a `LlamaDecoderLayer`).

Why a head with a reduced draft vocabulary (d2t/t2d) is refused: `EagleSpeculator` takes its `lm_head` from the
attached verifier (`attach_verifier`: `self.lm_head = verifier.lm_head`; `lm_head.weight` is in
`_keys_to_ignore_on_save`) and returns `self.lm_head(hidden_states)`, logits over the verifier's whole vocabulary;
`EagleSpeculatorConfig` has no `draft_vocab_size` (src/speculators/models/eagle.py
@ 0370128df4b39771b445947586c8d9152000fdc3 and @ 27bee96b079bb7a611ce7407c246fd98839e51e6). The draft vocabulary
exists only in the EAGLE-3 speculator (src/speculators/models/eagle3.py @ 03a7c1497cdbb0cf6a3cdffc86aead090034c285:
`Eagle3SpeculatorConfig.draft_vocab_size`, buffers `d2t` int64 [draft_vocab_size] and `t2d` bool [target vocab],
`lm_head` [draft_vocab_size, d]), whose architecture (fc over three verifier layers, a 2d-input attention) is not
our head's.
"""

from __future__ import annotations

import torch

from mtp_train.errors import UserError
from mtp_train.export.base import ExportFormat
from mtp_train.export.common import BLOCK_KEY, CONFIG_FILENAME, DTYPE_NAMES, layer_shape_from_config, mtp_train_block

SPECULATORS_VERSION = "0.1.0"
LLAMA_BLOCK_TYPES = {"llama": "LlamaDecoderLayer", "mistral": "LlamaDecoderLayer"}
_TRANSFORMER_DROP = ("architectures", "num_nextn_predict_layers", "torch_dtype", "dtype", BLOCK_KEY)
_LAYER = "transformer_layer_config"


class SpeculatorsFormat(ExportFormat):
    name = "speculators"
    kinds = ("eagle1",)
    description = "vLLM speculators format (speculators_model_type eagle, EagleSpeculator)"
    renames = (("fc.", "fusion_fc."), ("layers.0.", "transformer."))
    max_layers = 1
    no_draft_vocab = (
        "EagleSpeculator computes its logits with the verifier's full lm_head and its config has no draft_vocab_size "
        "(d2t/t2d exist only in the EAGLE-3 speculator)"
    )
    draft_vocab_alternatives = "--format eagle or native"
    block_types = LLAMA_BLOCK_TYPES
    kind_refusal = (
        "an mtp head cannot be written as a speculators EagleSpeculator: its layernorms option adds "
        "embedding_layernorm (= enorm), keeps transformer.input_layernorm and adds pre_lm_head_layernorm "
        "(= the final norm), but has no norm on the verifier hidden state, so hnorm would be lost. "
        "Use --format {alternatives}"
    )
    layers_refusal = (
        "the head has {n} decoder layers; EagleSpeculator has one `transformer` layer, so layers 1.. would be lost; "
        "use --format eagle or native"
    )
    required_fields = (
        "architectures", "speculators_model_type", "speculators_version", "speculators_config.algorithm",
        "speculators_config.proposal_methods", "speculators_config.default_proposal_method",
        "speculators_config.verifier.name_or_path", "speculators_config.verifier.architectures",
        "transformer_layer_architecture",
        *(f"{_LAYER}.{key}" for key in ("model_type", "hidden_size", "intermediate_size", "num_attention_heads",
                                        "num_key_value_heads", "vocab_size", "rms_norm_eps")),
        "layernorms", "fusion_bias", f"{BLOCK_KEY}.head_config", f"{BLOCK_KEY}.hidden_state_input",
    )

    def config_json(self, head_config, target, dtype, options):
        layer_config = {k: v for k, v in target.engine_config(dtype).items() if k not in _TRANSFORMER_DROP}
        layer_config.update(model_type="llama", num_hidden_layers=1, tie_word_embeddings=False)
        verifier = options.get("verifier_name") or str(target.directory.resolve())
        return {
            "architectures": ["EagleSpeculator", "LlamaDecoderLayer"],
            "speculators_model_type": "eagle",
            "speculators_version": SPECULATORS_VERSION,
            "speculators_config": {
                "algorithm": "eagle",
                "proposal_methods": [
                    {"proposal_type": "greedy", "speculative_tokens": int(options.get("num_speculative_tokens", 3))}
                ],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": verifier, "architectures": target.architectures},
            },
            "transformer_layer_architecture": "LlamaDecoderLayer",
            _LAYER: layer_config,
            "layernorms": False,
            "fusion_bias": True,
            "torch_dtype": DTYPE_NAMES[dtype],
            BLOCK_KEY: mtp_train_block(
                self.name, head_config, target_num_hidden_layers=target.config.num_hidden_layers,
                engine_support="speculators EagleSpeculator; vLLM accepts speculators_model_type eagle only in "
                "versions that registered it (V0 EAGLEModel); see docs/export.md",
            ),
        }

    # ---- reading back ---------------------------------------------------------------------------------------------

    def detect(self, config, names, directory):
        return "speculators_model_type" in config

    def layout(self, config, directory):
        return "eagle1", 1, layer_shape_from_config(config[_LAYER], f"{directory / CONFIG_FILENAME} {_LAYER}")

    def adjust_expected(self, config, expected):
        d = expected["fusion_fc.weight"][0]
        if not config["fusion_bias"]:
            del expected["fusion_fc.bias"]
        if config["layernorms"]:
            for name in ("embedding_layernorm.weight", "transformer.input_layernorm.weight", "pre_lm_head_layernorm.weight"):
                expected[name] = (d,)

    def target_fields(self, config):
        layer = config.get(_LAYER) or {}
        return {key: layer.get(key) for key in ("hidden_size", "vocab_size")}, f"{_LAYER}."

    def format_problems(self, config, directory):
        problems = []
        source = directory / CONFIG_FILENAME
        if config.get("speculators_model_type") != "eagle":
            problems.append(f"{source}: speculators_model_type={config.get('speculators_model_type')!r}; expected 'eagle'")
        methods = config["speculators_config"].get("proposal_methods")
        if not isinstance(methods, list) or not methods or "speculative_tokens" not in methods[0]:
            problems.append(f"{source}: speculators_config.proposal_methods[0].speculative_tokens is missing")
        if config.get("transformer_layer_architecture") != "LlamaDecoderLayer":
            problems.append(
                f"{source}: transformer_layer_architecture={config.get('transformer_layer_architecture')!r}; "
                "EagleSpeculator builds LlamaDecoderLayer"
            )
        return problems

    def format_target_problems(self, config, target):
        problems = []
        verifier_archs = ((config.get("speculators_config") or {}).get("verifier") or {}).get("architectures")
        if target.architectures and verifier_archs != target.architectures:
            problems.append(
                f"{CONFIG_FILENAME}: speculators_config.verifier.architectures={verifier_archs!r} but the target has "
                f"{target.architectures!r}"
            )
        if target.config.model_type not in LLAMA_BLOCK_TYPES:
            problems.append(
                f"{CONFIG_FILENAME}: the target's model_type {target.config.model_type!r} has no LlamaDecoderLayer block"
            )
        return problems

    def complete_native(self, native, head_config, config, directory):
        if config["layernorms"]:
            raise UserError(
                f"{directory / CONFIG_FILENAME}: layernorms=true (embedding_layernorm, transformer.input_layernorm, "
                "pre_lm_head_layernorm) has no DraftHead counterpart: an mtp head also normalizes the hidden state "
                "(hnorm), an eagle1 head has none of these norms"
            )
        if "fc.bias" not in native:  # fusion_bias: false is the same head with a zero bias
            weight = native["fc.weight"]
            native["fc.bias"] = torch.zeros(weight.shape[0], dtype=weight.dtype)
