"""Targets our runtime does not implement, run by vLLM (runtime.config.ENGINE_ONLY_MODEL_TYPES): a tiny random
checkpoint of each family, made with transformers, goes prepare -> precompute (vLLM) -> train (EAGLE-3) -> export
(eagle3) -> served by vLLM, whose greedy speculative output must equal its plain output. The features vLLM captured
are the family's own hidden states (transformers' forward: H after the final norm, aux layers before it). What cannot
work is refused before anything runs.

Needs vLLM's interpreter (`make .venv-vllm/.installed`; `make test` sets MTP_TRAIN_REQUIRE_VLLM=1 so that a missing
vLLM fails there instead of skipping)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mtp_train.errors import UserError
from mtp_train.features.format import load_manifest
from mtp_train.features.precompute import run_precompute
from mtp_train.features.reader import FeatureReader
from mtp_train.features.verify import verify_features
from mtp_train.recipe import load_recipe
from mtp_train.runtime.config import SUPPORTED_MODEL_TYPES
from tests.pipeline_fixtures import RECIPE_PATH, tiny_pipeline, vllm_python

# vLLM's CPU attention takes head sizes that are multiples of 32; four layers, so that the aux layers differ from H's.
TINY = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32}
# Three families our runtime does not implement, and Qwen3, whose EAGLE-3 draft is vLLM's Qwen3-style block.
FAMILIES = ("qwen3_moe", "phi3", "apertus", "qwen3")
AUX_LAYERS = [0, 1, 2]
VLLM = ["precompute.backend=vllm", "precompute.vllm.enforce_eager=true", "precision.kv_cache=auto",
        "head.kind=eagle3", f"precompute.aux_layers={AUX_LAYERS}", "precision.features=float16"]

pytestmark = pytest.mark.slow




@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(model_type, overrides, feature cache) of a tiny target of the family, precomputed by vLLM in fp32."""
    vllm_python()
    model_type = request.param
    root = tmp_path_factory.mktemp(model_type)
    _, overrides = tiny_pipeline(root, num_conversations=20, target_overrides=TINY, model_type=model_type)
    overrides = overrides + VLLM
    cache = run_precompute(load_recipe(RECIPE_PATH, overrides))
    return model_type, overrides, cache


def test_vllm_captures_the_familys_own_hidden_states(family):
    """The cache holds what transformers' implementation of the family computes: H = the last layer's output after
    the final norm, aux layer j = decoder layer j's output (computed in fp32 here, stored in fp16)."""
    import transformers

    model_type, overrides, cache = family
    manifest = load_manifest(cache)
    assert manifest["backend"] == "vllm" and manifest["aux_layers"] == AUX_LAYERS
    assert verify_features(cache, progress=False).ok
    recipe = load_recipe(RECIPE_PATH, overrides)
    model = transformers.AutoModelForCausalLM.from_pretrained(recipe.target.path, dtype=torch.float32).eval()
    reader = FeatureReader(cache, "train", micro_batch_tokens=100_000, verify_hashes=False,
                           aux_layers=tuple(AUX_LAYERS))
    worst_hidden = worst_aux = 0.0
    checked = 0
    for positions in reader.epoch_batches(0):  # one pass (iterating a reader goes on epoch after epoch)
        batch = reader.load(positions)
        start = 0
        for length in batch.lengths:
            ids = batch.input_ids[start:start + length]
            with torch.no_grad():
                states = model(ids[None], output_hidden_states=True).hidden_states  # L + 1 of [1, T, d]
            want_hidden = states[-1][0]  # transformers: the last entry is after the final norm
            want_aux = torch.stack([states[j + 1][0] for j in AUX_LAYERS], dim=1)  # [T, 3, d]
            got_hidden, got_aux = batch.hidden[start:start + length], batch.aux_hidden[start:start + length]
            worst_hidden = max(worst_hidden, float(((got_hidden - want_hidden).norm(dim=-1)
                                                    / want_hidden.norm(dim=-1)).max()))
            worst_aux = max(worst_aux, float(((got_aux - want_aux).norm(dim=-1) / want_aux.norm(dim=-1)).max()))
            start += length
            checked += 1
    assert checked >= 10
    # fp32 both ways, different kernels (vLLM's fused MoE / attention against transformers' eager), then one fp16
    # rounding at storage (2^-11 relative per element)
    assert worst_hidden < 1e-3 and worst_aux < 1e-3, (model_type, worst_hidden, worst_aux)


def test_eagle3_head_trained_on_vllm_features_is_served_by_vllm(family, tmp_path):
    """train (EAGLE-3, a Llama-style draft block over a target our runtime cannot run) -> `eval --engine vllm`: the
    head exported as eagle3 and served by vLLM with greedy output identical to vLLM's plain output."""
    from mtp_train.cli import main
    from mtp_train.train.trainer import run_training

    model_type, overrides, _ = family
    sets = overrides + [f"train.run_dir={tmp_path / 'run'}", "train.max_steps=16", "eval.cost_curve=false"]
    run_training(load_recipe(RECIPE_PATH, sets), show_progress=False)
    head_config = json.loads((tmp_path / "run" / "head" / "head_config.json").read_text())
    assert head_config["model_type"] == model_type and head_config["kind"] == "eagle3"
    out = tmp_path / "eval"
    argv = ["eval", "--recipe", str(RECIPE_PATH), *(a for s in sets for a in ("--set", s)), "--engine", "vllm",
            "--num-speculative-tokens", "2", "--limit", "3", "--max-new-tokens", "16", "--out", str(out)]
    assert main(argv) == 0
    section = json.loads((out / "report.json").read_text())["vllm"]
    served = section["methods"]["eagle3@k=2"]
    assert section["export"]["format"] == "eagle3" and section["prompts"] >= 1
    assert served["outputs_identical_to_plain"], served
    assert served["drafts"] > 0 and 1.0 <= served["tau"] <= 3.0
    layer = json.loads((Path(section["export"]["dir"]) / "config.json").read_text())["transformer_layer_config"]
    block = "qwen3" if model_type == "qwen3" else "llama"  # vLLM's Eagle3Qwen3ForCausalLM / Eagle3LlamaForCausalLM
    assert layer["model_type"] == block and layer["hidden_act"] == "silu" and not layer["attention_bias"]


def test_what_cannot_work_is_refused_before_anything_runs(family, tmp_path):
    """Our runtime cannot build the family: the runtime backend and head kinds that copy the target's block are
    refused naming what to use instead."""
    model_type, overrides, _ = family
    if model_type in SUPPORTED_MODEL_TYPES:
        pytest.skip(f"{model_type} is implemented by our runtime")
    runtime = overrides + ["precompute.backend=runtime", f"precompute.output_dir={tmp_path / 'runtime'}"]
    with pytest.raises(UserError, match=rf"model_type '{model_type}' .* is run by vLLM, not by our runtime.*"
                                        r"precompute.backend: vllm"):
        run_precompute(load_recipe(RECIPE_PATH, runtime))
    from mtp_train.train.trainer import run_training

    mtp = overrides + ["head.kind=mtp", "precompute.aux_layers=[]", f"train.run_dir={tmp_path / 'mtp'}"]
    with pytest.raises(UserError, match=r"head kind 'mtp'.*use head.kind: eagle3"):
        run_training(load_recipe(RECIPE_PATH, mtp), show_progress=False)


@pytest.mark.parametrize("model_type, reason", [
    ("mixtral", r"captures no auxiliary hidden states"),
    ("gemma3_text", r"RMSNorm\(1 \+ w\)"),
    ("olmo2", r"through vLLM .*qwen3_moe"),
])
def test_families_not_checked_are_refused_with_the_reason(tmp_path, model_type, reason):
    from mtp_train.runtime.config import load_config

    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, "hidden_size": 64}))
    with pytest.raises(UserError, match=rf"model_type '{model_type}' is not supported.*{reason}"):
        load_config(tmp_path)
