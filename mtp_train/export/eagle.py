"""`eagle`: the EAGLE-1 layout (SafeAILab EAGLE `cnets.py`), for the EAGLE-1 ablation head.

Matched against (read through the code index; commits as stored there):
- SGLang python/sglang/srt/models/llama_eagle.py @ 034b3be819faf3f84c5aae5a4cda27bdf2e12de0 (`LlamaForCausalLMEagle`)
  and python/sglang/srt/models/qwen2_eagle.py @ 088a7eafdf9c119c5376056db011e29e187bd498 (`Qwen2ForCausalLMEagle`):
  `fc = nn.Linear(2d, d)` (bias on), `fc(cat((embed, spec_info.hidden_states)))` -- embed first, as ours --, layer 0's
  input_layernorm deleted (a `layers.0.input_layernorm.weight` in the file would have no parameter), no final norm
  (`hidden + residual` is returned), names prefixed with `model.` on load, `lm_head*` skipped.
  python/sglang/srt/speculative/eagle_worker.py @ fba8eccd7ebe41bbdbf70ab3b6a2df1835f8b532: for EAGLE (not EAGLE-3) the
  draft's embed_tokens and lm_head are replaced by the target's (`set_embed_and_head`), so neither is written.
- vLLM vllm/model_executor/models/llama_eagle.py @ e1c4a55214c63e19e83f82ad6c552d82148bae0b (`EagleLlamaForCausalLM`):
  same names and concat order, layer 0 without input_layernorm, no final norm, embed/lm_head shared from the target,
  but `fc` is built with `bias=False` and its loader looks every name up in its parameters: a file with `fc.bias`
  fails to load (KeyError), and at @ 00da92319af4b2ad2cde8525b7b609c779bdc52f unknown names were skipped, i.e. the
  bias was silently dropped. Our EAGLE-1 head has a trained fc.bias, so **vLLM cannot serve it faithfully**; SGLang
  can. (vLLM's config maps `architectures` X -> `EagleX` for method "eagle"; we write SGLang's names.)

Layout written (n = the head's layers):

    fc.weight                  [d, 2d]   columns :d read embed(t), d: read the hidden state
    fc.bias                    [d]
    layers.{j}.self_attn.*, layers.{j}.mlp.*, layers.{j}.post_attention_layernorm.weight
    layers.{j}.input_layernorm.weight   for j >= 1 only
    config.json: the target's config with architectures = ["LlamaForCausalLMEagle"] (llama, mistral without a
    sliding window) or ["Qwen2ForCausalLMEagle"] (qwen2), num_hidden_layers = n, plus the mtp_train block.

An MTP head (restored norms) is refused: enorm, hnorm, layers.0.input_layernorm and the final norm have no slot in
this layout. A Qwen3 head is refused (neither engine has an EAGLE-1 class with Qwen3's q_norm/k_norm), and a
sliding-window Mistral head too (the engines' Llama block attends without the window).
"""

from __future__ import annotations

from mtp_train.errors import UserError
from mtp_train.export.base import ExportFormat, layer_shape_problems
from mtp_train.export.common import (
    BLOCK_KEY,
    ENGINE_CONFIG_FIELDS,
    MTP_NORMS_LOST,
    LayerShape,
    engine_config_from_target,
    mtp_train_block,
    native_tensors,
)
from mtp_train.heads.config import HeadConfig

EAGLE_ARCHITECTURES = {"llama": "LlamaForCausalLMEagle", "mistral": "LlamaForCausalLMEagle", "qwen2": "Qwen2ForCausalLMEagle"}


def block_refusal(config, format_name: str, supported: dict[str, str]) -> str | None:
    """Why the target's decoder block has no counterpart in the engines' EAGLE-1 classes, or None."""
    if config.model_type not in supported:
        return (
            f"format {format_name} has no EAGLE-1 loader for model_type {config.model_type!r} "
            f"(supported: {', '.join(sorted(supported))}); the head's block (e.g. Qwen3's q_norm/k_norm) would be "
            "lost; use --format native"
        )
    if config.sliding_window is not None:
        return (
            f"the target attends within a sliding window of {config.sliding_window} tokens; the engines' Llama block "
            f"in format {format_name} has no window, so the head's attention pattern would be lost; use --format native"
        )
    return None


class EagleFormat(ExportFormat):
    name = "eagle"
    kinds = ("eagle1",)
    description = "EAGLE-1 layout (SGLang LlamaForCausalLMEagle / Qwen2ForCausalLMEagle)"

    def refuse_reason(self, head_config: HeadConfig, target) -> str | None:
        if head_config.kind != "eagle1":
            return (
                "an mtp head (restored norms) cannot be written as EAGLE-1: this layout has no slot for "
                f"{MTP_NORMS_LOST}; they would be lost. Use --format deepseek-mtp or native"
            )
        return block_refusal(target.config, self.name, EAGLE_ARCHITECTURES)

    def build(self, state, head_config, target, dtype, options):
        config = engine_config_from_target(target, dtype)
        config.pop("num_nextn_predict_layers", None)
        config["architectures"] = [EAGLE_ARCHITECTURES[target.config.model_type]]
        config["num_hidden_layers"] = head_config.num_layers
        config[BLOCK_KEY] = mtp_train_block(
            self.name,
            head_config,
            target_num_hidden_layers=target.config.num_hidden_layers,
            engine_support="SGLang --speculative-algorithm EAGLE; not vLLM (its EAGLE-1 fc has no bias)",
        )
        return {name: tensor.to(dtype) for name, tensor in state.items()}, {"config.json": config}

    # ---- reading back ---------------------------------------------------------------------------------------------

    def detect(self, config, names, directory):
        archs = config.get("architectures") or []
        return "fc.weight" in names or any(str(a).endswith("Eagle") for a in archs)

    def required_fields(self, config):
        return list(ENGINE_CONFIG_FIELDS)

    def expected_tensors(self, config, directory):
        shape = LayerShape.from_hf_dict(config, str(directory / "config.json"))
        return native_tensors("eagle1", int(config["num_hidden_layers"]), shape)

    def extra_problems(self, config, directory):
        archs = config.get("architectures") or []
        known = sorted(set(EAGLE_ARCHITECTURES.values()))
        if archs and archs[0] not in known:
            return [f"{directory / 'config.json'}: architectures={archs!r}; expected one of {known}"]
        return []

    def target_problems(self, config, target):
        source = "config.json"
        problems = self.common_target_problems(config, target, source)
        for key in ("hidden_size", "vocab_size", "model_type"):
            if config.get(key) != getattr(target, key):
                problems.append(f"{source}: {key}={config.get(key)!r} but the target has {key}={getattr(target, key)!r}")
        want = EAGLE_ARCHITECTURES.get(target.model_type)
        if want and (config.get("architectures") or [None])[0] != want:
            problems.append(f"{source}: architectures={config.get('architectures')!r}; a {target.model_type} target needs [{want!r}]")
        problems += layer_shape_problems(config, target, source)
        return problems

    def to_native(self, tensors, config, directory):
        source = directory / "config.json"
        head_config = self.head_config_of(config, str(source))
        if head_config.kind != "eagle1" or head_config.num_layers != int(config["num_hidden_layers"]):
            raise UserError(
                f"{source}: {BLOCK_KEY}.head_config (kind={head_config.kind!r}, num_layers={head_config.num_layers}) "
                f"does not match an eagle1 head with num_hidden_layers={config['num_hidden_layers']}"
            )
        return dict(tensors), head_config, {}
