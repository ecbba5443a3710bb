"""Tiny random Hugging Face models saved to disk, the targets of most runtime, head and export tests."""

from __future__ import annotations

from pathlib import Path

import torch


# What a tiny model of a family needs beyond the common fields (a few experts; Phi-3's pad id inside the vocabulary).
FAMILY_DEFAULTS = {
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64},
    "phi3": {"pad_token_id": 0},
}


def save_tiny_model(path: Path, model_type: str = "llama", seed: int = 0, **overrides) -> Path:
    """Save a randomly initialized tiny HF model of `model_type` (fp32) to `path`; return the path."""
    import transformers

    common = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=1,
        bos_token_id=0,
    )
    common.update(overrides)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        # Families vLLM runs for us (runtime.config.ENGINE_ONLY_MODEL_TYPES): our runtime never builds them.
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "apertus": (transformers.ApertusConfig, transformers.ApertusForCausalLM),
    }[model_type]
    common = {**FAMILY_DEFAULTS.get(model_type, {}), **common}
    torch.manual_seed(seed)
    model = model_cls(config_cls(**common)).eval()
    # Random init leaves norms at 1 and biases at 0: perturb them so they are actually tested.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(path)
    return path
