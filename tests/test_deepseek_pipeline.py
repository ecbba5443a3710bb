"""The whole pipeline on a tiny random DeepSeek-V3 target with an MTP head (MLA block, dense MLP): prepare ->
precompute -> train (loss falls) -> eval (greedy speculative output identical to plain greedy) -> export deepseek-mtp
-> inspect -> the export loaded back gives the trained head's logits exactly."""

from __future__ import annotations

import json

import pytest
import torch

from mtp_train.commands.eval import run_evaluation
from mtp_train.data.prepare import prepare_dataset
from mtp_train.export.exporter import export_head
from mtp_train.export.inspection import inspect_dir
from mtp_train.export.load import load_any_head
from mtp_train.features.precompute import run_precompute
from mtp_train.heads.io import load_head
from mtp_train.recipe import load_recipe
from mtp_train.runtime.attention import BatchInfo
from mtp_train.runtime.loader import load_model
from mtp_train.train.trainer import run_training
from tests.deepseek_models import make_tiny_deepseek_target
from tests.pipeline_fixtures import RECIPE_PATH, synthetic_sharegpt, tiny_recipe_overrides

pytestmark = pytest.mark.slow  # trains a tiny pipeline (~35 s on 2 cores)

TRAIN = {"train.micro_batch_tokens": 256, "train.warmup_steps": 2, "train.lr": 3e-3, "train.max_steps": 24,
         "train.eval_every": 12, "train.save_every": 12}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek-pipeline")
    target = make_tiny_deepseek_target(root / "target", seed=4)
    source = synthetic_sharegpt(root / "chats.jsonl", 40, seed=0)
    recipe = load_recipe(RECIPE_PATH, tiny_recipe_overrides(root, target, source, **TRAIN))
    prepare_dataset(recipe, show_progress=False)
    run_precompute(recipe)
    run_dir = run_training(recipe, show_progress=False)
    return root, recipe, run_dir


def test_training_on_deepseek_features_lowers_the_loss(pipeline):
    _, recipe, run_dir = pipeline
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 24
    first, last = sum(r["loss"] for r in rows[:4]) / 4, sum(r["loss"] for r in rows[-4:]) / 4
    assert last < 0.9 * first, (first, last)
    head_config = json.loads((run_dir / "head" / "head_config.json").read_text())
    assert head_config["model_type"] == "deepseek_v3" and head_config["block_mlp"] == "dense"


def test_eval_greedy_speculative_equals_plain_greedy(pipeline):
    root, recipe, run_dir = pipeline
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in [
        {"question_id": 1, "category": "writing", "turns": ["hello world", "the model drafts tokens"]},
        {"question_id": 2, "category": "coding", "turns": ["python code data cache"]},
    ]) + "\n")
    report = run_evaluation(recipe, run_dir / "head", None, prompts, None, [1, 3], 40, root / "report",
                            show_progress=False)
    for method in ("mtp@k=1", "mtp@k=3", "lookup@k=3"):
        result = report["overall"][method]
        assert result["greedy_match"] is True and result["turns"] == 3
        assert 1.0 <= result["tau"] <= int(method[-1]) + 1
    # drafts were accepted (the latent caches kept their prefix and dropped the rejected tail), and greedy held
    assert max(report["overall"][m]["tau"] for m in ("mtp@k=3", "lookup@k=3")) > 1.0


def test_export_inspect_and_load_back(pipeline):
    root, recipe, run_dir = pipeline
    out = export_head(run_dir / "head", "deepseek-mtp", root / "export", recipe.target.path)
    target = load_model(recipe.target.path, dtype="float32", device="cpu")
    report = inspect_dir(out, target)
    assert report.ok, report.all_problems
    trained = load_head(run_dir / "head", target, dtype=torch.float32)
    exported = load_any_head(out, target, dtype=torch.float32)  # the same bf16-stored values, computed in fp32
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, target.config.vocab_size, (10,), generator=gen)
    hidden = torch.randn(10, target.config.hidden_size, generator=gen)
    with torch.no_grad():
        expected = trained.logits(trained(tokens, hidden, BatchInfo.without_cache([6, 4])))
        got = exported.logits(exported(tokens, hidden, BatchInfo.without_cache([6, 4])))
    assert torch.equal(got, expected)
