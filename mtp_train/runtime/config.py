"""The model configuration our runtime understands, read from a HF `config.json`.

transformers parses the file (so every rope-scaling spelling across versions is normalized for us); this module
checks that the architecture and options are ones the runtime implements, and says which when they are not.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtp_train.errors import UserError
from mtp_train.fileio import read_json_object

# model_type -> what distinguishes it inside the Llama family.
SUPPORTED_MODEL_TYPES = {
    "llama": "Llama 2/3/3.1+ (rope scaling default/linear/llama3), SmolLM2",
    "mistral": "Mistral (optional sliding window)",
    "qwen2": "Qwen2/2.5 (q/k/v bias)",
    "qwen3": "Qwen3 (per-head q/k RMSNorm)",
    "deepseek_v2": "DeepSeek-V2/V2-Lite (MLA + MoE, runtime/deepseek.py)",
    "deepseek_v3": "DeepSeek-V3/R1 (MLA + MoE with noaux_tc routing, runtime/deepseek.py)",
}
# model_type -> families vLLM runs for us (`precompute.backend: vllm`, `eval --engine vllm`) and our runtime does not:
# an EAGLE-3 head (a Llama-style draft block, heads/config.eagle3_block_config) is trained over vLLM's features with
# the target's frozen embeddings and lm_head. Each was checked (tests/test_vllm_families.py): vLLM captures its aux
# layers (its model class supports EAGLE-3), its final norm is an RMSNorm over `model.norm.weight` whose output the
# lm_head reads unscaled, its embeddings are unscaled, and vLLM serves an EAGLE-3 head for it.
ENGINE_ONLY_MODEL_TYPES = {
    "qwen3_moe": "Qwen3-MoE (30B-A3B, 235B-A22B)",
    "phi3": "Phi-3/Phi-4 (fused qkv and gate/up)",
    "apertus": "Apertus (xIELU MLP, q/k norms)",
}
# Families a user may try that are not in either list, with the reason (the generic refusal covers the rest).
ENGINE_REFUSED_MODEL_TYPES = {
    "mixtral": "vLLM's Mixtral class captures no auxiliary hidden states (no EAGLE-3 support), so neither "
               "precompute.backend vllm nor an EAGLE-3 head in vLLM can run",
    "gemma3": "Gemma's norms are RMSNorm(1 + w) and its embeddings are scaled by sqrt(d): neither is checked here",
    "gemma3_text": "Gemma's norms are RMSNorm(1 + w) and its embeddings are scaled by sqrt(d): neither is checked here",
    "granite": "Granite scales embeddings, residuals and logits (embedding_multiplier, logits_scaling): not checked "
               "here",
}
DEEPSEEK_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn", "longrope")
SUPPORTED_ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "relu")


@dataclass(frozen=True)
class DeepseekOptions:
    """What a DeepSeek-V2/V3 config adds to the common fields (runtime/deepseek.py reads them): Multi-head Latent
    Attention shapes and the Mixture-of-Experts routing, as transformers' DeepseekV2/V3 models compute them."""

    q_lora_rank: int | None  # None: a direct q_proj
    kv_lora_rank: int  # the compressed KV latent (cached per token, with the rope key)
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale: float  # qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) ** 2 when configured
    rope_interleave: bool  # rope dims stored as interleaved pairs (V2 always; V3's rope_interleave)
    n_routed_experts: int
    n_shared_experts: int  # 0: none
    num_experts_per_tok: int
    moe_intermediate_size: int
    first_k_dense_replace: int  # layers 0 .. k-1 have a dense MLP (intermediate_size)
    scoring_func: str  # "softmax" (V2) | "sigmoid" (V3)
    topk_method: str  # "greedy" | "group_limited_greedy" (V2) | "noaux_tc" (V3: + e_score_correction_bias)
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    num_nextn_predict_layers: int  # MTP modules a V3 checkpoint may carry at model.layers.{num_hidden_layers + k}

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token per layer: the normalized KV latent and the rotated rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    hidden_act: str = "silu"
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2, some Llamas)
    o_proj_bias: bool = False  # bias on the output projection (Llama attention_bias=True)
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k before rotary
    sliding_window: int | None = None  # Mistral: attend to at most this many previous tokens
    rope_type: str = "default"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    deepseek: DeepseekOptions | None = None  # set for model_type deepseek_v2 / deepseek_v3
    # The parsed transformers config: rotary init functions read their parameters from it.
    hf_config: Any = field(default=None, compare=False, repr=False)

    @property
    def runtime_implemented(self) -> bool:
        """Whether our runtime builds this target (else vLLM runs it: ENGINE_ONLY_MODEL_TYPES)."""
        return self.model_type in SUPPORTED_MODEL_TYPES


def require_runtime(config: ModelConfig, source: Any) -> None:
    """A UserError naming `source` when our runtime cannot build the target `config` (a family vLLM runs for us),
    with what to use instead."""
    if config.runtime_implemented:
        return
    raise UserError(
        f"{source}: model_type {config.model_type!r} ({ENGINE_ONLY_MODEL_TYPES[config.model_type]}) is run by vLLM, "
        f"not by our runtime (which implements {', '.join(SUPPORTED_MODEL_TYPES)}): set precompute.backend: vllm, "
        "train an EAGLE-3 head (head.kind: eagle3) and measure it with `mtp-train eval --engine vllm`"
    )


def _as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read and validate `model_dir/config.json`. Raises UserError naming the file and key on anything unsupported."""
    from transformers import AutoConfig  # local: slow to import; `mtp-train --help` imports config

    config_path = Path(model_dir) / "config.json"
    if not config_path.is_file():
        raise UserError(f"{config_path}: not found (expected a HF model directory with config.json and *.safetensors)")
    raw = read_json_object(config_path)  # a UserError naming the file for bytes that are not UTF-8 or not JSON
    return _parse(raw, config_path, lambda: AutoConfig.from_pretrained(str(model_dir)))


def config_from_dict(raw: dict[str, Any], source: str) -> ModelConfig:
    """`load_config`'s parsing and checks for a config already in memory (e.g. the target config an export carries);
    UserErrors name `source`."""
    from transformers import AutoConfig  # local: slow to import; `mtp-train --help` imports config

    rest = {k: v for k, v in raw.items() if k != "model_type"}
    return _parse(raw, source, lambda: AutoConfig.for_model(raw.get("model_type"), **rest))


def _parse(raw: dict[str, Any], config_path: Any, parse_hf: Callable[[], Any]) -> ModelConfig:
    """The checks and the ModelConfig of a raw config dict; `parse_hf()` gives transformers' parsed config."""
    model_type = raw.get("model_type")
    engine_only = model_type in ENGINE_ONLY_MODEL_TYPES
    if model_type not in SUPPORTED_MODEL_TYPES and not engine_only:
        supported = ", ".join(f"{k} ({v})" for k, v in SUPPORTED_MODEL_TYPES.items())
        through_vllm = ", ".join(f"{k} ({v})" for k, v in ENGINE_ONLY_MODEL_TYPES.items())
        why = f" ({ENGINE_REFUSED_MODEL_TYPES[model_type]})" if model_type in ENGINE_REFUSED_MODEL_TYPES else ""
        raise UserError(f"{config_path}: model_type {model_type!r} is not supported{why}; supported by our runtime: "
                        f"{supported}; through vLLM (precompute.backend vllm, EAGLE-3 heads): {through_vllm}")
    if "quantization_config" in raw:
        raise UserError(
            f"{config_path}: quantization_config is set ({raw['quantization_config'].get('quant_method', '?')}); "
            "the runtime loads unquantized bf16/fp16/fp32 safetensors only"
        )
    try:
        hf = parse_hf()
    except Exception as err:  # transformers raises many types for a malformed config
        raise UserError(f"{config_path}: transformers could not parse it ({err})") from None

    rope_params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    rope_type = rope_params.get("rope_type", rope_params.get("type", "default")) if rope_params else "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UserError(
            f"{config_path}: rope_scaling type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "dynamic":
        raise UserError(
            f"{config_path}: rope_scaling type 'dynamic' changes frequencies with sequence length, which a paged "
            "cache cannot follow; supported: default, linear, llama3, yarn, longrope"
        )
    hidden_act = getattr(hf, "hidden_act", "silu")
    if hidden_act not in SUPPORTED_ACTIVATIONS and not engine_only:  # vLLM runs an engine-only target's MLP
        raise UserError(
            f"{config_path}: hidden_act {hidden_act!r} is not supported; supported: {', '.join(SUPPORTED_ACTIVATIONS)}"
        )
    if getattr(hf, "pretraining_tp", 1) not in (None, 1):
        raise UserError(f"{config_path}: pretraining_tp={hf.pretraining_tp} is not supported; expected 1")

    num_heads = hf.num_attention_heads
    shapes = dict(  # what every target's config gives; an engine-only target's config gives only these
        model_type=model_type,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_hidden_layers=hf.num_hidden_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // num_heads,
        rms_norm_eps=hf.rms_norm_eps,
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        hidden_act=hidden_act,
        rope_type=rope_type,
        bos_token_id=getattr(hf, "bos_token_id", None),
        eos_token_ids=_as_tuple(getattr(hf, "eos_token_id", None)),
        hf_config=hf,
    )
    if engine_only:  # vLLM runs the target's block: no runtime block of it is built, its flags stay False
        return ModelConfig(**shapes)
    sliding_window = None
    if model_type == "mistral":
        sliding_window = getattr(hf, "sliding_window", None)
    elif model_type in ("qwen2", "qwen3") and getattr(hf, "use_sliding_window", False):
        raise UserError(
            f"{config_path}: use_sliding_window=true is not supported for {model_type} "
            "(per-layer windows); expected false"
        )

    deepseek = _deepseek_options(model_type, raw, hf, rope_params, rope_type, config_path) \
        if model_type in DEEPSEEK_MODEL_TYPES else None
    attention_bias = bool(getattr(hf, "attention_bias", False))
    return ModelConfig(
        **shapes,
        attention_bias=model_type == "qwen2" or (model_type in ("llama", "qwen3") and attention_bias),
        o_proj_bias=model_type in ("llama", "qwen3") and attention_bias,
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        sliding_window=sliding_window,
        deepseek=deepseek,
    )


def _deepseek_options(model_type: str, raw: dict[str, Any], hf: Any, rope_params: dict, rope_type: str,
                      config_path: Any) -> DeepseekOptions:
    """The MLA/MoE fields of a DeepSeek config, with the combinations transformers' models compute (the parity
    reference) checked; anything else is a UserError naming the key."""
    def fail(key: str, value: Any, expected: str) -> UserError:
        return UserError(f"{config_path}: {key}={value!r} is not supported for {model_type}; expected {expected}")

    qk_head_dim = hf.qk_nope_head_dim + hf.qk_rope_head_dim
    scale = qk_head_dim**-0.5
    mscale_all_dim = rope_params.get("mscale_all_dim", 0) if rope_type != "default" else 0
    if mscale_all_dim:
        factor = float(rope_params["factor"])
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    if raw.get("moe_layer_freq", 1) != 1:
        raise fail("moe_layer_freq", raw["moe_layer_freq"], "1 (every layer from first_k_dense_replace on is MoE)")
    if hf.num_key_value_heads != hf.num_attention_heads:
        raise fail("num_key_value_heads", hf.num_key_value_heads, f"num_attention_heads ({hf.num_attention_heads}): "
                   "MLA has one latent per token, not key/value head groups")
    for key in ("attention_bias", "mlp_bias"):
        if getattr(hf, key, False):
            raise fail(key, True, "false (no released DeepSeek model has biases)")
    n_experts = hf.n_routed_experts
    if model_type == "deepseek_v2":
        scoring, topk_method = raw.get("scoring_func", "softmax"), hf.topk_method or "greedy"
        if scoring != "softmax":
            raise fail("scoring_func", scoring, "softmax")
        if topk_method not in ("greedy", "group_limited_greedy"):
            raise fail("topk_method", topk_method, "greedy or group_limited_greedy")
        if hf.norm_topk_prob:
            raise fail("norm_topk_prob", True, "false (transformers' DeepSeek-V2 does not renormalize the top-k "
                       "weights and DeepSeek's own code does; no released V2 sets it)")
        rope_interleave = True
    else:
        scoring, topk_method = raw.get("scoring_func", "sigmoid"), raw.get("topk_method", "noaux_tc")
        if scoring != "sigmoid":
            raise fail("scoring_func", scoring, "sigmoid")
        if topk_method != "noaux_tc":
            raise fail("topk_method", topk_method, "noaux_tc")
        rope_interleave = bool(getattr(hf, "rope_interleave", True))
    n_group = hf.n_group or 1
    topk_group = hf.topk_group or n_group
    if n_experts % n_group or not 1 <= topk_group <= n_group:
        raise fail("n_group/topk_group", (hf.n_group, hf.topk_group),
                   f"n_group dividing n_routed_experts ({n_experts}) and 1 <= topk_group <= n_group")
    if topk_method == "noaux_tc" and n_experts // n_group < 2:
        raise fail("n_group", n_group, "at most n_routed_experts / 2 (noaux_tc scores a group by its top-2 experts)")
    return DeepseekOptions(
        q_lora_rank=hf.q_lora_rank,
        kv_lora_rank=hf.kv_lora_rank,
        qk_nope_head_dim=hf.qk_nope_head_dim,
        qk_rope_head_dim=hf.qk_rope_head_dim,
        v_head_dim=hf.v_head_dim,
        softmax_scale=scale,
        rope_interleave=rope_interleave,
        n_routed_experts=n_experts,
        n_shared_experts=int(hf.n_shared_experts or 0),
        num_experts_per_tok=hf.num_experts_per_tok,
        moe_intermediate_size=hf.moe_intermediate_size,
        first_k_dense_replace=int(hf.first_k_dense_replace or 0),
        scoring_func=scoring,
        topk_method=topk_method,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=bool(hf.norm_topk_prob),
        routed_scaling_factor=float(hf.routed_scaling_factor),
        num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers", 0) or 0),
    )
