"""Helpers of the export tests (tests/test_export.py, tests/test_export_draft_vocab.py): the exact tensor layouts of
each format for the tiny target (the `target`/`target_dir` fixtures of tests/conftest.py: d=64, 4 heads x 16, 2 kv
heads, intermediate 112, vocab 96, 2 layers), a head's logits on fixed inputs, edited copies of an export, and the
CLI in this process."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from mtp_train.heads import DraftHead
from mtp_train.runtime.attention import BatchInfo

BLOCK = {  # one decoder layer of the tiny Llama, without input_layernorm
    "self_attn.q_proj.weight": (64, 64),
    "self_attn.k_proj.weight": (32, 64),
    "self_attn.v_proj.weight": (32, 64),
    "self_attn.o_proj.weight": (64, 64),
    "post_attention_layernorm.weight": (64,),
    "mlp.gate_proj.weight": (112, 64),
    "mlp.up_proj.weight": (112, 64),
    "mlp.down_proj.weight": (64, 112),
}


def prefixed(prefix: str, block: dict) -> dict:
    return {prefix + k: v for k, v in block.items()}


# (format, head kind) -> tensor name -> shape of a full-vocabulary export of a one-layer head of the tiny target.
EXPECTED = {
    ("native", "mtp"): {
        "enorm.weight": (64,),
        "hnorm.weight": (64,),
        "eh_proj.weight": (64, 128),
        "layers.0.input_layernorm.weight": (64,),
        **prefixed("layers.0.", BLOCK),
        "norm.weight": (64,),
    },
    # eagle1 heads of the export tests are trained without an fc bias (head.fc_bias: false, what vLLM serves); the
    # eagle layout writes a zero fc.bias for SGLang's biased fc.
    ("native", "eagle1"): {"fc.weight": (64, 128), **prefixed("layers.0.", BLOCK)},
    ("deepseek-mtp", "mtp"): {
        "model.layers.2.embed_tokens.weight": (96, 64),
        "model.layers.2.enorm.weight": (64,),
        "model.layers.2.hnorm.weight": (64,),
        "model.layers.2.eh_proj.weight": (64, 128),
        "model.layers.2.input_layernorm.weight": (64,),
        **prefixed("model.layers.2.", BLOCK),
        "model.layers.2.shared_head.norm.weight": (64,),
        "model.layers.2.shared_head.head.weight": (96, 64),
    },
    ("vllm-mtp", "mtp"): {
        "model.mtp_layers.0.token_layernorm.weight": (64,),
        "model.mtp_layers.0.hidden_layernorm.weight": (64,),
        "model.mtp_layers.0.input_proj.weight": (64, 128),
        "model.mtp_layers.0.input_layernorm.weight": (64,),
        **prefixed("model.mtp_layers.0.", BLOCK),
        # Qwen2's q/k/v projections have biases: zeros for the tiny Llama's block
        "model.mtp_layers.0.self_attn.q_proj.bias": (64,),
        "model.mtp_layers.0.self_attn.k_proj.bias": (32,),
        "model.mtp_layers.0.self_attn.v_proj.bias": (32,),
        "model.mtp_layers.0.final_layernorm.weight": (64,),
    },
    ("eagle", "eagle1"): {"fc.weight": (64, 128), "fc.bias": (64,), **prefixed("layers.0.", BLOCK)},
}


def read_config(directory: Path) -> dict:
    return json.loads((directory / "config.json").read_text())


def draft_logits(head: DraftHead, seed: int = 1) -> torch.Tensor:
    """[12, draft vocab]: the head's logits on fixed random tokens and hidden states of the tiny target (two
    sequences of 7 and 5)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [7, 5]
    tokens = torch.randint(0, 96, (sum(lengths),), generator=gen)
    hidden = torch.randn(sum(lengths), 64, generator=gen)
    with torch.no_grad():
        return head.logits(head(tokens, hidden, BatchInfo.without_cache(lengths)))


def edited_copy(src: Path, dst: Path, tensors=None, config_edit=None, files=None) -> Path:
    """Copy the export `src` to `dst`, then apply the edits: `tensors(state) -> state` to model.safetensors,
    `config_edit(config)` in place to config.json, `files(dst)` to the directory. Returns `dst`."""
    shutil.copytree(src, dst)
    if tensors is not None:
        save_file(tensors(load_file(src / "model.safetensors")), dst / "model.safetensors")
    if config_edit is not None:
        config = read_config(src)
        config_edit(config)
        (dst / "config.json").write_text(json.dumps(config))
    if files is not None:
        files(dst)
    return dst


def run_cli(argv: list[str]) -> int:
    """`mtp-train ARGV` in this process."""
    from mtp_train import cli

    return cli.main(argv)
