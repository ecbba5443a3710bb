"""The target's frozen parts read straight from safetensors (runtime/frozen_parts.py): bit-equal to the full model's
tensors (tied and untied, Llama / Qwen2 with biases / Qwen3 with q/k norms, single file and sharded index), only the
shards holding them opened, heads built from them identical to heads built against the full target, and clear
UserErrors naming the file and key."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from mtp_train.errors import UserError
from mtp_train.heads import HeadConfig, head_class
from mtp_train.runtime.attention import BatchInfo
from mtp_train.runtime.frozen_parts import FrozenParts, load_frozen_parts
from mtp_train.runtime.loader import load_model
from mtp_train.fingerprint import target_fingerprint
from tests.tiny_models import save_tiny_model

INDEX = "model.safetensors.index.json"


def _assert_parts_equal_model(parts: FrozenParts, model) -> None:
    assert parts.config == model.config
    assert parts.dtype == model.dtype and parts.device == model.device
    assert torch.equal(parts.embed_tokens.weight, model.model.embed_tokens.weight)
    assert torch.equal(parts.lm_head.weight, model.lm_head.weight)
    assert not parts.embed_tokens.weight.requires_grad and not parts.lm_head.weight.requires_grad
    last = model.model.layers[-1].state_dict()
    assert parts.last_layer is not None and parts.last_layer.keys() == last.keys()
    for key, value in last.items():
        assert parts.last_layer[key].dtype == value.dtype and torch.equal(parts.last_layer[key], value), key
    assert torch.equal(parts.final_norm, model.model.norm.weight)


@pytest.mark.parametrize(("model_type", "tied"), [("llama", False), ("llama", True), ("qwen2", False),
                                                  ("qwen3", True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parts_equal_the_full_models_tensors(tmp_path, model_type, tied, dtype):
    model_dir = save_tiny_model(tmp_path / "m", model_type, seed=5, tie_word_embeddings=tied)
    model = load_model(model_dir, dtype=dtype, device="cpu")
    parts = load_frozen_parts(model_dir, dtype, last_layer=True)
    _assert_parts_equal_model(parts, model)
    assert (parts.lm_head.weight is parts.embed_tokens.weight) == tied
    assert parts.fingerprint == target_fingerprint(model_dir) == model.fingerprint
    assert parts.source_dir == str(model_dir)


def test_without_last_layer_reads_only_the_matrices(tmp_path):
    model_dir = save_tiny_model(tmp_path / "m", "llama", seed=5)
    parts = load_frozen_parts(model_dir, torch.float32)
    assert parts.last_layer is None and parts.final_norm is None
    head_config = HeadConfig.for_target(parts.config, kind="mtp", init="last_layer")
    with pytest.raises(ValueError, match="last_layer=True"):
        head_class("mtp").from_target(parts, head_config)


@pytest.mark.parametrize("tied", [False, True])
def test_sharded_index_opens_only_the_shards_it_needs(tmp_path, tied):
    model_dir = save_tiny_model(tmp_path / "m", "llama", seed=7, tie_word_embeddings=tied, num_hidden_layers=4)
    # Re-save the single file as shards of one tensor group each, with HF's index (weight_map: key -> shard).
    state = load_file(model_dir / "model.safetensors")
    (model_dir / "model.safetensors").unlink()
    groups = {"embed": [k for k in state if "embed_tokens" in k],
              "head": [k for k in state if k.startswith("lm_head")] + ["model.norm.weight"]}
    for j in range(4):
        groups[f"layer{j}"] = [k for k in state if k.startswith(f"model.layers.{j}.")]
    names = {group: f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i, group in enumerate(groups)}
    weight_map = {}
    for group, keys in groups.items():
        save_file({k: state[k] for k in keys}, str(model_dir / names[group]), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, names[group]))
    (model_dir / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    full = load_model(model_dir, dtype="float32", device="cpu")
    _assert_parts_equal_model(load_frozen_parts(model_dir, torch.float32, last_layer=True), full)
    # The middle layers' shards are never opened: the frozen parts load without them (the full load cannot).
    for j in (0, 1, 2):
        (model_dir / names[f"layer{j}"]).unlink()
    _assert_parts_equal_model(load_frozen_parts(model_dir, torch.float32, last_layer=True), full)
    with pytest.raises(UserError, match="missing"):
        load_model(model_dir, dtype="float32", device="cpu")
    # A shard that is needed and missing is named, with the key it holds.
    (model_dir / names["embed"]).unlink()
    with pytest.raises(UserError, match=rf"{INDEX}: shard {names['embed']} \(holding model.embed_tokens.weight\)"):
        load_frozen_parts(model_dir, torch.float32)


HEAD_CASES = [  # (kind, init, draft vocabulary size or None, tie_word_embeddings)
    ("mtp", "last_layer", None, False),
    ("mtp", "random", 40, True),
    ("eagle1", "last_layer", None, True),
    ("eagle3", "random", 40, False),
]


@pytest.mark.parametrize(("kind", "init", "draft_vocab", "tied"), HEAD_CASES)
def test_head_from_parts_is_identical_to_one_built_against_the_full_target(tmp_path, kind, init, draft_vocab, tied):
    model_dir = save_tiny_model(tmp_path / "m", "qwen2", seed=11, tie_word_embeddings=tied, num_hidden_layers=3)
    full = load_model(model_dir, dtype="float32", device="cpu")
    parts = load_frozen_parts(model_dir, torch.float32, last_layer=init == "last_layer")
    options = dict(kind=kind, init=init, draft_vocab_size=draft_vocab)
    if kind == "eagle3":
        options["aux_layers"] = (0, 1, 2)
    heads = []
    for target in (full, parts):
        torch.manual_seed(0)
        head = head_class(kind).from_target(target, HeadConfig.for_target(target.config, **options))
        if draft_vocab:
            head.set_draft_vocab(torch.arange(0, 2 * draft_vocab, 2))
        heads.append(head)
    from_full, from_parts = heads
    assert from_full.state_dict().keys() == from_parts.state_dict().keys()
    for key, value in from_full.state_dict().items():
        assert torch.equal(value, from_parts.state_dict()[key]), key
    assert torch.equal(from_full.draft_weight, from_parts.draft_weight)
    # One training step on the same batch moves both heads identically (the frozen matrices get no gradient).
    torch.manual_seed(1)
    d = full.config.hidden_size
    tokens = torch.randint(0, full.config.vocab_size, (9,))
    hidden = torch.randn(9, d * (3 if kind == "eagle3" else 1))
    target_hidden = torch.randn(9, d)
    for head in heads:
        optimizer = torch.optim.AdamW(head.parameters(), lr=1e-2)
        logits = head.logits(head(tokens, hidden, BatchInfo.without_cache([9])))  # [9, N]
        target_probs = torch.softmax(torch.nn.functional.linear(target_hidden, head.draft_weight), -1)
        loss = torch.nn.functional.cross_entropy(logits, target_probs)
        loss.backward()
        optimizer.step()
    for key, value in from_full.state_dict().items():
        assert torch.equal(value, from_parts.state_dict()[key]), key
    for embed, lm_head in ((full.model.embed_tokens, full.lm_head), (parts.embed_tokens, parts.lm_head)):
        assert embed.weight.grad is None and lm_head.weight.grad is None


def test_missing_and_misshapen_tensors_are_user_errors_naming_file_and_key(tmp_path):
    model_dir = save_tiny_model(tmp_path / "m", "llama", seed=5)
    weights = model_dir / "model.safetensors"
    state = load_file(weights)
    save_file({k: v for k, v in state.items() if k != "lm_head.weight"}, str(weights), metadata={"format": "pt"})
    with pytest.raises(UserError, match=rf"{weights}: no tensor lm_head.weight"):
        load_frozen_parts(model_dir, torch.float32)

    last = "model.layers.1.mlp.down_proj.weight"
    save_file({k: v for k, v in state.items() if k != last}, str(weights), metadata={"format": "pt"})
    load_frozen_parts(model_dir, torch.float32)  # init random never reads the last layer
    with pytest.raises(UserError, match=rf"{weights}: no tensor {last}"):
        load_frozen_parts(model_dir, torch.float32, last_layer=True)

    save_file({**state, "model.embed_tokens.weight": state["model.embed_tokens.weight"][:-1]}, str(weights),
              metadata={"format": "pt"})
    with pytest.raises(UserError, match=rf"{weights}: tensor model.embed_tokens.weight has shape \(95, 64\), "
                                        r"the target's config implies \(96, 64\)"):
        load_frozen_parts(model_dir, torch.float32)

    # An index that does not list a key, and an index that says a shard holds a key it does not.
    save_file(state, str(weights), metadata={"format": "pt"})
    index = model_dir / INDEX
    weight_map = {k: "model.safetensors" for k in state if k != "model.embed_tokens.weight"}
    index.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(UserError, match=rf"{index}: no tensor model.embed_tokens.weight"):
        load_frozen_parts(model_dir, torch.float32)
    save_file({k: v for k, v in state.items() if k != "lm_head.weight"}, str(weights), metadata={"format": "pt"})
    index.write_text(json.dumps({"weight_map": dict.fromkeys(state, "model.safetensors")}))
    with pytest.raises(UserError, match=rf"{weights}: no tensor lm_head.weight \(but {index} says"):
        load_frozen_parts(model_dir, torch.float32)
    index.write_text("{not json")
    with pytest.raises(UserError, match=rf"{index}: not a safetensors index"):
        load_frozen_parts(model_dir, torch.float32)
    with pytest.raises(UserError, match="model directory not found"):
        load_frozen_parts(tmp_path / "nowhere", torch.float32)
