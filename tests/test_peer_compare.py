"""scripts/peer_compare.py's glue, without speculators installed: our prepared rows become speculators' rows
unchanged; the hidden-state file written for a sample holds what a transformers forward of the real SmolLM2 gives
(layer ids in vLLM's convention, the last entry before the final norm); the draft-vocabulary mapping; the CPU patch
function on fake files."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SMOLLM2 = REPO / "data" / "models" / "smollm2-135m-instruct"


def _load_script():
    spec = importlib.util.spec_from_file_location("peer_compare", REPO / "scripts" / "peer_compare.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["peer_compare"] = module
    spec.loader.exec_module(module)
    return module


pc = _load_script()


def test_rows_keep_ids_and_mask_from_a_prepared_dataset(tmp_path):
    import datasets

    from mtp_train.data.prepared import prepared_features

    rows = {"input_ids": [[1, 2, 3, 4], [5, 6, 7]], "loss_mask": [[0, 0, 1, 1], [0, 1, 1]], "source_id": ["a", "b"]}
    datasets.Dataset.from_dict(rows, features=prepared_features()).save_to_disk(str(tmp_path / "train"))
    split = datasets.load_from_disk(str(tmp_path / "train"))
    converted = pc.speculator_rows(split)
    assert converted == [{"input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1]},
                         {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}]
    assert all(type(t) is int for row in converted for t in row["input_ids"] + row["loss_mask"])
    with pytest.raises(ValueError, match="3 ids but 2 mask"):
        pc.speculator_rows([{"input_ids": [1, 2, 3], "loss_mask": [0, 1], "source_id": "c"}])


def test_order_like_undoes_a_shuffle_and_refuses_a_lost_row():
    wanted = [[1, 2], [3], [1, 2], [4, 5, 6]]
    shuffled = [[4, 5, 6], [1, 2], [3], [1, 2]]
    order = pc.order_like(shuffled, wanted)
    assert [shuffled[i] for i in order] == wanted
    assert sorted(order) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="row 2"):
        pc.order_like(shuffled[:3], wanted)


def test_layer_ids_follow_vllm_convention():
    assert pc.peer_layer_ids([1, 14, 26]) == [2, 15, 27]  # speculators' default for 30 layers: [2, L // 2, L - 3]


@pytest.fixture(scope="module")
def target_model():
    """The real SmolLM2 in fp32 where `make assets` fetched it, else a tiny random Llama: (model, which)."""
    return _model()


def _model():
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if (SMOLLM2 / "config.json").is_file():
        return AutoModelForCausalLM.from_pretrained(SMOLLM2, dtype=torch.float32).eval(), "smollm2"
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=5,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config).eval(), "tiny"


def test_hidden_state_file_matches_a_transformers_forward(tmp_path, target_model):
    from safetensors.torch import load_file

    torch.set_num_threads(2)
    model, which = target_model
    layers = model.config.num_hidden_layers
    aux = [1, layers // 2 - 1, layers - 4] if which == "smollm2" else [0, 2, 3]
    layer_ids = pc.peer_layer_ids(aux)
    ids = [1, 9, 14, 3, 27, 5, 11, 2]
    pc.write_hidden_states(model, [ids, ids[:5]], tmp_path / "hidden_states", layer_ids, show=lambda m: None)
    assert sorted(p.name for p in (tmp_path / "hidden_states").iterdir()) == ["hs_0.safetensors", "hs_1.safetensors"]
    record = load_file(str(tmp_path / "hidden_states" / "hs_0.safetensors"))
    assert set(record) == {"token_ids", "hidden_states"}
    assert record["token_ids"].dtype == torch.int64 and record["token_ids"].tolist() == ids
    hs = record["hidden_states"]
    assert hs.dtype == torch.bfloat16 and hs.shape == (len(ids), len(aux) + 1, model.config.hidden_size)

    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
        # our aux layer a = the output of decoder layer a: run the layers by hand to pin that down
        x = model.model.embed_tokens(torch.tensor([ids]))
        position_ids = torch.arange(len(ids))[None]
        rope = model.model.rotary_emb(x, position_ids)
        mask = torch.full((len(ids), len(ids)), float("-inf")).triu(1)[None, None]
        outputs = []
        for layer in model.model.layers:
            x = layer(x, attention_mask=mask, position_ids=position_ids, position_embeddings=rope)
            x = x[0] if isinstance(x, tuple) else x
            outputs.append(x[0])
    for i, a in enumerate(aux):
        assert torch.allclose(out.hidden_states[layer_ids[i]][0], outputs[a], atol=1e-4)
        assert torch.allclose(hs[:, i].float(), outputs[a], rtol=2e-2, atol=2e-2)
    # the last entry: the final decoder layer's output before the final norm (not transformers' hidden_states[-1])
    assert torch.allclose(hs[:, -1].float(), outputs[-1], rtol=2e-2, atol=2e-2)
    assert torch.allclose(model.model.norm(outputs[-1]), out.hidden_states[-1][0], atol=1e-4)
    assert not torch.allclose(hs[:, -1].float(), out.hidden_states[-1][0], rtol=2e-2, atol=2e-2)
    # a rerun keeps the files (resume)
    before = (tmp_path / "hidden_states" / "hs_1.safetensors").stat().st_mtime_ns
    pc.write_hidden_states(model, [ids, ids[:5]], tmp_path / "hidden_states", layer_ids, show=lambda m: None)
    assert (tmp_path / "hidden_states" / "hs_1.safetensors").stat().st_mtime_ns == before


def test_hidden_state_files_from_our_feature_cache_give_the_peer_our_targets(tmp_path, target_model):
    """The default source: our cache's aux_hidden (our aux layer a = transformers' hidden_states[a + 1]) and H / w,
    whose RMS norm with the target's final-norm weight w is our stored H (what the peer's targets are made from)."""
    from safetensors.torch import load_file, save_file

    torch.set_num_threads(2)
    model, which = target_model
    layers = model.config.num_hidden_layers
    aux = [1, layers // 2 - 1, layers - 4] if which == "smollm2" else [0, 2, 3]
    samples = [[1, 9, 14, 3, 27, 5], [4, 8, 15, 16]]
    shard = {"offsets": [0], "sample_index": [1, 0], "input_ids": [], "loss_mask": [], "hidden": [], "aux_hidden": []}
    reference = {}
    with torch.inference_mode():
        for index in shard["sample_index"]:  # the samples in the shard in another order than the split's
            out = model(input_ids=torch.tensor([samples[index]]), output_hidden_states=True)
            reference[index] = out.hidden_states
            shard["input_ids"].append(torch.tensor(samples[index], dtype=torch.int32))
            shard["loss_mask"].append(torch.ones(len(samples[index]), dtype=torch.uint8))
            shard["hidden"].append(out.hidden_states[-1][0].to(torch.bfloat16))
            shard["aux_hidden"].append(torch.stack([out.hidden_states[a + 1][0] for a in aux], 1).to(torch.bfloat16))
            shard["offsets"].append(shard["offsets"][-1] + len(samples[index]))
    tensors = {k: torch.cat(v) if k not in ("offsets", "sample_index") else torch.tensor(v, dtype=torch.int64)
               for k, v in shard.items()}
    features, target = tmp_path / "features", tmp_path / "target"
    (features / "train").mkdir(parents=True)
    target.mkdir()
    save_file(tensors, str(features / "train" / "shard-r0-00000.safetensors"))
    (features / "manifest.json").write_text(
        '{"splits": {"train": {"shards": [{"name": "train/shard-r0-00000.safetensors"}]}}}')
    save_file({"model.norm.weight": model.model.norm.weight.detach().clone()}, str(target / "model.safetensors"))

    pc.write_hidden_states_from_cache(features, target, {"train": samples}, tmp_path / "hs", len(aux))
    layer_ids = pc.peer_layer_ids(aux)
    for index, ids in enumerate(samples):
        record = load_file(str(tmp_path / "hs" / f"hs_{index}.safetensors"))
        assert record["token_ids"].dtype == torch.int64 and record["token_ids"].tolist() == ids
        hs = record["hidden_states"]
        assert hs.dtype == torch.bfloat16 and hs.shape == (len(ids), len(aux) + 1, model.config.hidden_size)
        for i, layer_id in enumerate(layer_ids):
            assert torch.allclose(hs[:, i].float(), reference[index][layer_id][0], rtol=2e-2, atol=2e-2)
        normed = model.model.norm(hs[:, -1].float())  # the peer's verifier_norm
        assert torch.allclose(normed, reference[index][-1][0], rtol=3e-2, atol=3e-2)
    with pytest.raises(ValueError, match="differ from the prepared row"):
        pc.write_hidden_states_from_cache(features, target, {"train": [samples[1], samples[0]]}, tmp_path / "x",
                                          len(aux))
    with pytest.raises(ValueError, match="holds 2 of the 3"):
        pc.write_hidden_states_from_cache(features, target, {"train": samples + [[7]]}, tmp_path / "y", len(aux))


def test_draft_vocab_mapping_counts_assistant_tokens():
    rows = [{"input_ids": [7, 7, 3, 9, 9, 9], "loss_mask": [1, 1, 1, 0, 0, 0]},
            {"input_ids": [3, 5, 5], "loss_mask": [1, 1, 0]}]
    d2t, t2d = pc.draft_vocab_mapping(rows, draft_vocab_size=3, target_vocab_size=12)
    chosen = sorted(int(i + d) for i, d in enumerate(d2t))
    assert chosen == [3, 5, 7]  # 9 never counts (no loss); 7 and 3 twice, 5 once
    assert d2t.dtype == np.int64 and t2d.dtype == bool and t2d.shape == (12,)
    assert np.flatnonzero(t2d).tolist() == chosen
    d2t, _ = pc.draft_vocab_mapping(rows, draft_vocab_size=5, target_vocab_size=12)
    assert sorted(int(i + d) for i, d in enumerate(d2t)) == [0, 1, 3, 5, 7]  # padded with the lowest unused ids


def _fake_package(root: Path) -> Path:
    (root / "train").mkdir(parents=True)
    (root / "utils").mkdir()
    (root / "train" / "trainer.py").write_text(
        "def setup(self):\n    self.model.to(self.local_rank)  # type: ignore\n"
        "    batch = {k: v.to(self.local_rank, non_blocking=True) for k, v in b.items()}\n"
        "    torch.accelerator.synchronize()\n    self.model.to(self.local_rank)\n")
    (root / "utils" / "util.py").write_text(
        'def get_current_device():\n    acc = None\n    if acc is None:\n        return "cuda:0"\n')
    return root


def test_cpu_patches_apply_once_and_are_idempotent(tmp_path):
    package = _fake_package(tmp_path / "speculators")
    done = pc.apply_cpu_patches(package, "0.9.0")
    assert len(done) == 4
    trainer = (package / "train" / "trainer.py").read_text()
    assert "self.local_rank" not in trainer and trainer.count('self.model.to("cpu")') == 2
    assert 'v.to("cpu", non_blocking=True)' in trainer
    assert "(torch.accelerator.is_available() and torch.accelerator.synchronize())" in trainer
    assert 'return "cpu"' in (package / "utils" / "util.py").read_text()
    snapshot = {p: p.read_text() for p in package.rglob("*.py")}
    assert pc.apply_cpu_patches(package, "0.9.0") == []
    assert {p: p.read_text() for p in package.rglob("*.py")} == snapshot


def test_cpu_patches_refuse_an_unknown_release_and_write_nothing(tmp_path):
    package = _fake_package(tmp_path / "speculators")
    util = package / "utils" / "util.py"
    util.write_text("def get_current_device():\n    return torch.accelerator.current_accelerator()\n")
    trainer_before = (package / "train" / "trainer.py").read_text()
    with pytest.raises(pc.PatchError, match=r"speculators 9\.9\.9: .*utils/util\.py holds neither"):
        pc.apply_cpu_patches(package, "9.9.9")
    assert (package / "train" / "trainer.py").read_text() == trainer_before  # nothing half-applied
    (package / "utils" / "util.py").unlink()
    with pytest.raises(pc.PatchError, match=r"speculators 9\.9\.9: .*util\.py is missing"):
        pc.apply_cpu_patches(package, "9.9.9")
