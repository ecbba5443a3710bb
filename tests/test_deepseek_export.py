"""`export --format deepseek-mtp` of a DeepSeek target's MTP head (dense or MoE MLA block): the layout vLLM's
DeepSeekMTP and SGLang's DeepseekV3ForCausalLMNextN load (names under model.layers.{L}, the target's embed_tokens and
lm_head copied in, the routing fields spelled out, first_k_dense_replace saying the block's kind), `inspect` clean
against the target, and the export loaded back by our runtime with identical logits."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from mtp_train.export.exporter import export_head
from mtp_train.export.inspection import inspect_dir
from mtp_train.export.load import load_any_head
from mtp_train.heads.config import HeadConfig
from mtp_train.heads.draft_head import DraftHead
from mtp_train.heads.io import save_head
from mtp_train.runtime.attention import BatchInfo
from mtp_train.runtime.loader import load_model
from tests.deepseek_models import save_tiny_deepseek


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("v3-target")
    save_tiny_deepseek(path, "deepseek_v3", seed=11, n_group=4, topk_group=2)
    return path


def logits_of(head) -> torch.Tensor:
    gen = torch.Generator().manual_seed(2)
    tokens, hidden = torch.randint(0, 96, (12,), generator=gen), torch.randn(12, 64, generator=gen)
    with torch.no_grad():
        return head.logits(head(tokens, hidden, BatchInfo.without_cache([7, 5])))


@pytest.mark.parametrize("block_mlp", ["dense", "moe"])
def test_export_inspect_and_load_back(target_dir, tmp_path, block_mlp):
    target = load_model(target_dir, dtype="float32", device="cpu")
    head = DraftHead.from_target(target, HeadConfig.for_target(target.config, target.fingerprint, block_mlp=block_mlp))
    with torch.no_grad():  # the random init leaves norms at 1: make every tensor distinct
        for param in head.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    save_head(head, tmp_path / "head")
    out = export_head(tmp_path / "head", "deepseek-mtp", tmp_path / "export", target_dir)

    L = target.config.num_hidden_layers
    config = json.loads((out / "config.json").read_text())
    tensors = load_file(out / "model.safetensors")
    assert config["model_type"] == "deepseek_v3" and config["num_nextn_predict_layers"] == 1
    assert (config["topk_method"], config["scoring_func"], config["n_group"], config["topk_group"]) == \
        ("noaux_tc", "sigmoid", 4, 2)
    # vLLM builds a MoE at layer L iff L >= first_k_dense_replace (moe_layer_freq 1)
    assert (L >= config["first_k_dense_replace"]) == (block_mlp == "moe")
    prefix = f"model.layers.{L}."
    assert all(name.startswith(prefix) for name in tensors)
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "embed_tokens.weight",
                 "shared_head.head.weight", "self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight",
                 "self_attn.kv_a_layernorm.weight", "self_attn.kv_b_proj.weight", "input_layernorm.weight"):
        assert prefix + name in tensors, name
    if block_mlp == "moe":
        assert prefix + "mlp.gate.e_score_correction_bias" in tensors
        assert prefix + "mlp.experts.7.down_proj.weight" in tensors
        assert prefix + "mlp.shared_experts.up_proj.weight" in tensors
    else:
        assert prefix + "mlp.gate_proj.weight" in tensors and not any(".experts." in n for n in tensors)
    assert torch.equal(tensors[prefix + "shared_head.head.weight"], target.lm_head.weight)
    assert torch.equal(tensors[prefix + "eh_proj.weight"], head.eh_proj.weight)

    report = inspect_dir(out, target)
    assert report.ok, report.all_problems
    loaded = load_any_head(out, target)
    assert torch.equal(logits_of(loaded), logits_of(head))
    support = config["mtp_train"]["engine_support"]
    assert "vLLM DeepSeekMTP" in support and (("SGLang DeepseekV3ForCausalLMNextN" in support) == (block_mlp == "moe"))


def test_a_deepseek_v2_export_says_no_engine_serves_it(tmp_path):
    """Both engines pick their MTP class from DeepSeek-V3 configs only: a V2 target's export is ours to load."""
    save_tiny_deepseek(tmp_path / "t", "deepseek_v2", topk_method="group_limited_greedy", n_group=4, topk_group=2)
    target = load_model(tmp_path / "t", dtype="float32", device="cpu")
    head = DraftHead.from_target(target, HeadConfig.for_target(target.config, target.fingerprint, block_mlp="moe"))
    save_head(head, tmp_path / "head")
    out = export_head(tmp_path / "head", "deepseek-mtp", tmp_path / "export", tmp_path / "t")
    config = json.loads((out / "config.json").read_text())
    assert config["mtp_train"]["engine_support"].startswith("DeepSeek-V3 MTP module with a MoE MLA block: no engine")
    assert (config["topk_method"], config["scoring_func"]) == ("group_limited_greedy", "softmax")
    assert inspect_dir(out, target).ok
    assert torch.equal(logits_of(load_any_head(out, target)), logits_of(head))
    from tests.export_helpers import run_cli

    assert run_cli(["inspect", str(out), "--target", str(tmp_path / "t")]) == 0


def test_inspect_names_a_changed_mla_shape(target_dir, tmp_path):
    target = load_model(target_dir, dtype="float32", device="cpu")
    head = DraftHead.from_target(target, HeadConfig.for_target(target.config, target.fingerprint))
    save_head(head, tmp_path / "head")
    out = export_head(tmp_path / "head", "deepseek-mtp", tmp_path / "export", target_dir)
    config = json.loads((out / "config.json").read_text())
    config["kv_lora_rank"] = 32
    (out / "config.json").write_text(json.dumps(config))
    problems = " ".join(inspect_dir(out, target).all_problems)
    assert "kv_lora_rank" in problems and "kv_b_proj" in problems


def test_formats_without_an_mla_block_refuse_a_deepseek_head(target_dir, tmp_path):
    from mtp_train.errors import UserError

    target = load_model(target_dir, dtype="float32", device="cpu")
    save_head(DraftHead.from_target(target, HeadConfig.for_target(target.config, target.fingerprint)), tmp_path / "h")
    for fmt, message in (("native", "deepseek-mtp"), ("vllm-mtp", "deepseek_v3"), ("eagle", "EAGLE-1")):
        with pytest.raises(UserError, match=message):
            export_head(tmp_path / "h", fmt, tmp_path / fmt, target_dir)
