"""Exports meant for vLLM without importing vLLM: the `vllm-mtp` (MiMo-MTP) layout and its round trip, the
refusals of what that layout cannot hold, a reduced head written over the full vocabulary, the serving arguments
written next to the export; the `eagle` format's vLLM architecture name and its refusal of an fc bias vLLM drops,
`head.fc_bias: false`; the `speculators` EAGLE-1 format gone. `make serve-check` (scripts/check_serving.py) runs the
real engine."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from mtp_train.errors import UserError
from mtp_train.export import FORMAT_NAMES, export_head, inspect_dir, load_any_head
from mtp_train.heads import DraftHead, HeadConfig, load_head, save_head
from mtp_train.runtime.loader import load_model
from tests.export_helpers import (
    EXPECTED,
    draft_logits,
    edited_copy,
    read_config,
    run_cli,
)
from tests.pipeline_fixtures import RECIPE_PATH
from tests.tiny_models import save_tiny_model

D = 64  # the tiny target's hidden size
MODULE = "model.mtp_layers.0."


def perturbed_head(target, kind="mtp", num_layers=1, fc_bias=True, draft_ids=None) -> DraftHead:
    """A random-init head with its norms and biases moved away from 1/0 (so a swapped or dropped tensor shows)."""
    torch.manual_seed(0)
    options = {"fc_bias": fc_bias} if kind == "eagle1" else {}
    if draft_ids is not None:
        options["draft_vocab_size"] = draft_ids.numel()
    config = HeadConfig.for_target(target.config, target.fingerprint, kind=kind, num_layers=num_layers, **options)
    head = DraftHead.from_target(target, config)
    if draft_ids is not None:
        head.set_draft_vocab(draft_ids)
    with torch.no_grad():
        for name, param in head.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
    return head


@pytest.fixture(scope="module")
def mtp_dir(target, tmp_path_factory):
    return save_head(perturbed_head(target), tmp_path_factory.mktemp("heads") / "mtp")


@pytest.fixture(scope="module")
def vllm_export(mtp_dir, target_dir, tmp_path_factory):
    return export_head(mtp_dir, "vllm-mtp", tmp_path_factory.mktemp("exports") / "vllm-mtp", target_dir,
                       num_speculative_tokens=2)


# ---- vllm-mtp: the layout -------------------------------------------------------------------------------------------


def test_vllm_mtp_is_the_mimo_layout(vllm_export, mtp_dir, target_dir):
    stored = load_file(vllm_export / "model.safetensors")
    native = load_file(mtp_dir / "model.safetensors")
    assert {k: tuple(v.shape) for k, v in stored.items()} == EXPECTED[("vllm-mtp", "mtp")]
    # MiMo's input_proj reads cat([hidden, embed]); ours reads [embed | hidden]: the halves are swapped.
    assert torch.equal(stored[MODULE + "input_proj.weight"][:, :D], native["eh_proj.weight"][:, D:])
    assert torch.equal(stored[MODULE + "input_proj.weight"][:, D:], native["eh_proj.weight"][:, :D])
    assert torch.equal(stored[MODULE + "token_layernorm.weight"], native["enorm.weight"])
    assert torch.equal(stored[MODULE + "hidden_layernorm.weight"], native["hnorm.weight"])
    assert torch.equal(stored[MODULE + "final_layernorm.weight"], native["norm.weight"])
    assert torch.equal(stored[MODULE + "input_layernorm.weight"], native["layers.0.input_layernorm.weight"])
    for proj in ("q", "k", "v"):  # Qwen2's block always has q/k/v biases; the Llama block's are zero
        assert not stored[MODULE + f"self_attn.{proj}_proj.bias"].any()
    config = read_config(vllm_export)
    assert config["architectures"] == ["MiMoForCausalLM"] and config["num_nextn_predict_layers"] == 1
    assert config["num_hidden_layers"] == 2 and config["model_type"] == "llama"
    assert not [n for n in stored if "embed_tokens" in n or "lm_head" in n]  # vLLM shares the target's


def test_vllm_mtp_writes_its_serving_arguments(vllm_export, target_dir):
    serve = json.loads((vllm_export / "vllm_serve.json").read_text())
    assert serve["speculative_config"] == {"method": "mtp", "model": str(vllm_export.resolve()),
                                           "num_speculative_tokens": 2}
    assert serve["hf_overrides"] == {"num_nextn_predict_layers": 1}
    assert serve["target"] == str(target_dir.resolve()) and serve["vllm_version_verified"] == "0.32.0"
    text = (vllm_export / "SERVING.md").read_text()
    assert f"vllm serve {target_dir.resolve()}" in text
    assert "--speculative-config '" + json.dumps(serve["speculative_config"]) + "'" in text
    assert """--hf-overrides '{"num_nextn_predict_layers": 1}'""" in text
    assert read_config(vllm_export)["mtp_train"]["vllm"] == serve
    checksums = read_config(vllm_export)["mtp_train"]["checksums"]
    assert sorted(checksums) == ["SERVING.md", "model.safetensors", "vllm_serve.json"]


def test_vllm_mtp_round_trip_is_the_same_head(vllm_export, mtp_dir, target):
    original = load_head(mtp_dir, target)
    loaded = load_any_head(vllm_export, target)
    assert loaded.state_dict().keys() == original.state_dict().keys()  # the zero q/k/v biases are gone again
    for key, value in original.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    assert torch.equal(draft_logits(loaded), draft_logits(original))


def test_inspect_recognises_vllm_mtp(vllm_export, target_dir, tmp_path, capsys):
    assert run_cli(["inspect", str(vllm_export), "--target", str(target_dir)]) == 0
    out = capsys.readouterr().out
    assert "format vllm-mtp" in out and "model.mtp_layers.0.input_proj.weight" in out
    # Without our block's format name, the layout itself is recognised (not taken for deepseek-mtp, which also has
    # num_nextn_predict_layers).
    anonymous = edited_copy(vllm_export, tmp_path / "anon", config_edit=lambda c: c["mtp_train"].pop("format"))
    assert inspect_dir(anonymous).format == "vllm-mtp"


def test_qwen2_vllm_mtp_keeps_the_heads_qkv_biases(tmp_path):
    qwen_dir = save_tiny_model(tmp_path / "qwen2", "qwen2")
    qwen = load_model(qwen_dir, dtype="float32", device="cpu")
    head = perturbed_head(qwen)
    save_head(head, tmp_path / "head")
    out = export_head(tmp_path / "head", "vllm-mtp", tmp_path / "out", qwen_dir)
    stored = load_file(out / "model.safetensors")
    assert torch.equal(stored[MODULE + "self_attn.q_proj.bias"], head.state_dict()["layers.0.self_attn.q_proj.bias"])
    assert inspect_dir(out, qwen).ok
    assert torch.equal(draft_logits(load_any_head(out, qwen)), draft_logits(head))


def test_a_nonzero_qkv_bias_in_a_llama_export_is_refused_on_load(vllm_export, target, tmp_path):
    def edit(tensors):
        tensors = dict(tensors)
        tensors[MODULE + "self_attn.k_proj.bias"] = torch.full((32,), 0.5)
        return tensors

    # Without the recorded checksums (which would name the changed file first), the bias itself is named.
    broken = edited_copy(vllm_export, tmp_path / "b", tensors=edit, config_edit=lambda c: c["mtp_train"].pop("checksums"))
    with pytest.raises(UserError, match=r"self_attn\.k_proj\.bias is nonzero, but the head's llama block has no "):
        load_any_head(broken, target)


# ---- vllm-mtp: refusals ---------------------------------------------------------------------------------------------


def test_vllm_mtp_refuses_an_eagle1_head(target, target_dir, tmp_path):
    save_head(perturbed_head(target, "eagle1", fc_bias=False), tmp_path / "head")
    with pytest.raises(UserError, match=r"an eagle1 head cannot be written as vllm-mtp \(MiMo-MTP\).*token_layernorm"):
        export_head(tmp_path / "head", "vllm-mtp", tmp_path / "out", target_dir)
    assert not (tmp_path / "out").exists()


def test_vllm_mtp_refuses_two_layers(target, target_dir, tmp_path):
    save_head(perturbed_head(target, num_layers=2), tmp_path / "head")
    with pytest.raises(UserError, match=r"2 decoder layers; a MiMo MTP module holds exactly one Qwen2 block"):
        export_head(tmp_path / "head", "vllm-mtp", tmp_path / "out", target_dir)


@pytest.mark.parametrize("model_type,overrides,lost", [
    ("qwen3", {"head_dim": 16}, r"the q/k norms"),
    ("llama", {"attention_bias": True}, r"self_attn\.o_proj\.bias"),
    ("llama", {"mlp_bias": True}, r"the MLP biases"),
    ("llama", {"head_dim": 8}, r"head_dim 8 \(Qwen2's attention uses hidden_size / num_attention_heads = 16\)"),
    ("mistral", {"sliding_window": 8}, r"the sliding window of 8 tokens"),
])
def test_vllm_mtp_refuses_a_block_qwen2_computes_differently(tmp_path, model_type, overrides, lost):
    target_dir = save_tiny_model(tmp_path / "target", model_type, **overrides)
    target = load_model(target_dir, dtype="float32", device="cpu")
    save_head(perturbed_head(target), tmp_path / "head")
    with pytest.raises(UserError) as err:
        export_head(tmp_path / "head", "vllm-mtp", tmp_path / "out", target_dir)
    message = str(err.value)
    assert re.search(lost, message), message
    assert "differs from the Qwen2 layer vLLM's MiMoMTP builds" in message and message.endswith("--format native")
    export_head(tmp_path / "head", "native", tmp_path / "native", target_dir)  # the head itself is fine


def test_a_reduced_head_exports_drafting_over_every_token(target, target_dir, tmp_path):
    """No flag needed: vLLM's MiMoMTP has no draft vocabulary (test_export_draft_vocab has deepseek-mtp too)."""
    draft_ids = torch.tensor([0, 3, 7, 20, 41, 95])
    head = perturbed_head(target, draft_ids=draft_ids)
    save_head(head, tmp_path / "head")
    argv = ["export", "--head", str(tmp_path / "head"), "--format", "vllm-mtp", "--out", str(tmp_path / "out"),
            "--target", str(target_dir)]
    assert run_cli(argv) == 0
    # --full-vocab (meant for the formats that could keep the vocabulary) writes the same files here.
    assert run_cli([*argv[:6], str(tmp_path / "flag"), *argv[7:], "--full-vocab"]) == 0
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (tmp_path / "flag" / "model.safetensors").read_bytes()
    out = tmp_path / "out"
    block = read_config(out)["mtp_train"]
    assert block["head_config"]["draft_vocab_size"] is None and block["full_vocab_from_draft_vocab_size"] == 6
    assert "draft_vocab_size" not in read_config(out) and not {"d2t", "t2d"} & set(load_file(out / "model.safetensors"))
    loaded = load_any_head(out, target)
    assert loaded.draft_ids is None and loaded.draft_vocab_size == 96
    # The same weights: its logits over the full vocabulary, restricted to the draft ids, are the reduced head's.
    full, reduced = draft_logits(loaded), draft_logits(head)
    assert full.shape == (12, 96) and reduced.shape == (12, 6)
    torch.testing.assert_close(full[:, draft_ids], reduced, rtol=1e-5, atol=1e-5)


# ---- eagle: what vLLM loads -----------------------------------------------------------------------------------------


def test_eagle_refuses_an_fc_bias_vllm_would_drop(target, target_dir, tmp_path, capsys):
    save_head(perturbed_head(target, "eagle1", fc_bias=True), tmp_path / "head")
    argv = ["export", "--head", str(tmp_path / "head"), "--format", "eagle", "--out", str(tmp_path / "out"),
            "--target", str(target_dir)]
    assert run_cli(argv) == 2
    err = capsys.readouterr().err
    assert "fc.bias is nonzero" in err and "EagleLlamaForCausalLM: fc without a bias" in err
    assert "head.fc_bias: false" in err and "--format native" in err
    assert not (tmp_path / "out").exists()
    # The biased head keeps its bias where it can be served as is (our runtime).
    native = export_head(tmp_path / "head", "native", tmp_path / "native", target_dir)
    assert load_any_head(native, target).fc.bias.abs().sum() > 0


def test_eagle_writes_a_head_without_fc_bias_for_vllm_and_sglang(target, target_dir, tmp_path):
    head = perturbed_head(target, "eagle1", fc_bias=False)
    assert head.fc.bias is None and "fc.bias" not in head.state_dict()
    save_head(head, tmp_path / "head")
    out = export_head(tmp_path / "head", "eagle", tmp_path / "out", target_dir)
    config = read_config(out)
    # SGLang loads the first name it knows (its EAGLE class), vLLM maps LlamaForCausalLM -> EagleLlamaForCausalLM.
    assert config["architectures"] == ["LlamaForCausalLMEagle", "LlamaForCausalLM"]
    stored = load_file(out / "model.safetensors")
    assert not stored["fc.bias"].any()  # SGLang's fc has a bias parameter to fill; zero is this head
    loaded = load_any_head(out, target)
    assert loaded.fc.bias is None and torch.equal(draft_logits(loaded), draft_logits(head))

    def nonzero_bias(tensors):
        return {**tensors, "fc.bias": torch.full((D,), 0.25)}

    broken = edited_copy(out, tmp_path / "broken", tensors=nonzero_bias,
                         config_edit=lambda c: c["mtp_train"].pop("checksums"))
    with pytest.raises(UserError, match=r"fc\.bias is nonzero, but mtp_train\.head_config\.fc_bias is false"):
        load_any_head(broken, target)


def test_fc_bias_false_is_a_recipe_key_for_eagle1_only(target):
    from mtp_train.recipe import load_recipe

    recipe = load_recipe(RECIPE_PATH, ["head.kind=eagle1", "head.fc_bias=false", "head.draft_vocab_size=full"])
    config = recipe.head.head_config(target.config)
    assert config.kind == "eagle1" and config.fc_bias is False
    assert load_recipe(RECIPE_PATH, []).head.fc_bias is True  # the default is unchanged
    with pytest.raises(UserError, match=r"fc_bias=false \(recipe head\.fc_bias\) applies to eagle1 heads"):
        load_recipe(RECIPE_PATH, ["head.fc_bias=false", "head.draft_vocab_size=full"]).head.head_config(target.config)
    assert HeadConfig.from_dict({**config.to_dict()}).fc_bias is False
    older = config.to_dict()
    older.pop("fc_bias")  # a head_config.json written before the key existed: refused, not read as a biased fc
    with pytest.raises(UserError, match=r"missing key\(s\) fc_bias \(written by an older mtp-train, before those keys "
                                        r"existed\): train the head again"):
        HeadConfig.from_dict(older)


# ---- speculators EAGLE-1: gone --------------------------------------------------------------------------------------


def test_speculators_eagle1_format_is_gone(target, target_dir, tmp_path):
    assert "speculators" not in FORMAT_NAMES
    save_head(perturbed_head(target, "eagle1", fc_bias=False), tmp_path / "head")
    with pytest.raises(UserError, match=r"unknown format 'speculators'; known formats: native, deepseek-mtp, vllm-mtp"):
        export_head(tmp_path / "head", "speculators", tmp_path / "out", target_dir)
    with pytest.raises(ImportError):
        import mtp_train.export.speculators  # noqa: F401
