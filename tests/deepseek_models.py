"""Tiny random DeepSeek-V2/V3 checkpoints saved with transformers' own models (the parity reference of
`runtime/deepseek.py`), and a DeepSeek-V3 checkpoint that also carries an MTP module at `model.layers.{N}`."""

from __future__ import annotations

from pathlib import Path

import torch

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}

COMMON = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=3,
    first_k_dense_replace=1, kv_lora_rank=24, q_lora_rank=40, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=12, max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=1, bos_token_id=0,
)

# name -> (model_type, overrides): every routing method, YaRN and plain rope, q_lora_rank set and unset.
ARCHS = {
    "v2-greedy-yarn-direct-q": ("deepseek_v2", dict(q_lora_rank=None, topk_method="greedy", rope_parameters=YARN,
                                                      routed_scaling_factor=1.5)),
    "v2-group-limited": ("deepseek_v2", dict(topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                             n_shared_experts=2)),
    "v3-noaux-yarn": ("deepseek_v3", dict(n_group=4, topk_group=2, rope_parameters=YARN, routed_scaling_factor=2.5)),
    "v3-direct-q-no-interleave": ("deepseek_v3", dict(q_lora_rank=None, n_group=2, topk_group=1,
                                                      rope_interleave=False, norm_topk_prob=False)),
}


def hf_classes(model_type: str):
    import transformers

    return {
        "deepseek_v2": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM),
        "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
    }[model_type]


def save_tiny_deepseek(path: Path, model_type: str = "deepseek_v3", seed: int = 0, **overrides):
    """Save a tiny random transformers DeepSeek model (fp32) to `path`; returns the transformers model. Norm weights,
    router weights and V3's e_score_correction_bias are perturbed away from their init so they are tested."""
    config_cls, model_cls = hf_classes(model_type)
    options = dict(COMMON)
    options.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**options)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith("mlp.gate.weight") or "experts" in name:
                param.normal_(0.0, 0.2)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.3)
    model.save_pretrained(path)
    return model


def make_tiny_deepseek_target(directory: Path, seed: int = 0, **overrides) -> Path:
    """A tiny random DeepSeek-V3 target with the tiny ChatML tokenizer of the pipeline tests (tests/pipeline_fixtures
    builds the Llama one the same way): routing on 4 groups of 2 experts, YaRN rope."""
    from tests.conftest_data import SMOLLM2_CHATML_TEMPLATE, build_tokenizer

    tokenizer = build_tokenizer(
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], bos="<|im_start|>", eos="<|im_end|>",
        chat_template=SMOLLM2_CHATML_TEMPLATE,
    )
    options = dict(n_group=4, topk_group=2, rope_parameters=YARN, vocab_size=len(tokenizer),
                   eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    options.update(overrides)
    save_tiny_deepseek(directory, "deepseek_v3", seed=seed, **options)
    tokenizer.save_pretrained(str(directory))
    return directory
