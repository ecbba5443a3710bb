"""`mtp-train eval`: reports from the speculative path on MT-bench-format prompts and the held-out split."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mtp_train.errors import UserError
from mtp_train.commands.eval import run_evaluation as evaluate
from mtp_train.evaluate.prompts import load_mt_bench
from mtp_train.heads import DraftHead, HeadConfig, save_head
from mtp_train.runtime.loader import load_model
from tests.pipeline_fixtures import tiny_pipeline

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "smollm2-135m-mtp.yaml"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    recipe, overrides = tiny_pipeline(root, num_conversations=40)
    target = load_model(recipe.target.path, dtype="float32", device="cpu")
    torch.manual_seed(0)
    head = DraftHead.from_target(target, HeadConfig.for_target(target.config, target.fingerprint, kind="mtp"))
    save_head(head, root / "head")
    prompts = root / "prompts.jsonl"
    rows = [
        {"question_id": 1, "category": "writing", "turns": ["hello world", "the model drafts tokens"]},
        {"question_id": 2, "category": "coding", "turns": ["python code data cache"]},
        {"question_id": 3, "category": "coding"},  # no turns: skipped and counted
        "not json",
    ]
    prompts.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return root, recipe, prompts


def test_eval_report_on_mt_bench_prompts(setup):
    root, recipe, prompts = setup
    out = root / "report-mt"
    report = evaluate(recipe, root / "head", None, prompts, None, [1, 3], 12, out, show_progress=False)
    assert report["num_prompts"] == 2 and len(report["skipped"]) == 2
    assert any(":3: no 'turns'" in s for s in report["skipped"]) and any("invalid JSON" in s for s in report["skipped"])
    overall = report["overall"]
    assert set(overall) == {"plain", "mtp@k=1", "mtp@k=3", "lookup@k=1", "lookup@k=3", "hybrid@k=1", "hybrid@k=3"}
    assert report["best"]["method"].startswith("mtp@")
    for method in ("mtp@k=1", "mtp@k=3", "lookup@k=1", "lookup@k=3", "hybrid@k=1", "hybrid@k=3"):
        r = overall[method]
        assert r["greedy_match"] is True  # greedy speculative == plain greedy, every turn
        assert r["turns"] == 3  # 2 turns + 1 turn
        assert 1.0 <= r["tau"] <= int(method[-1]) + 1
        assert len(r["acceptance_per_position"]) == int(method[-1]) and "speedup" in r
        assert 1.0 <= r["mean_acceptance_length"] <= int(method[-1]) + 1  # tokens per verify
        assert r["speedup_p25"] <= r["speedup_median"] <= r["speedup_p75"]
    assert "mean_acceptance_length" not in overall["plain"] and "speedup" not in overall["plain"]
    assert set(report["per_category"]) == {"writing", "coding"}
    for name in ("report.json", "report.md", "acceptance_by_position.png", "tau_by_category.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0
    # The cost curve, measured once per draft after the runs on the first prompt, and the speedup it predicts:
    # τ(k) / (verify(k+1)/decode + drafting(k)/decode) from the stored curve (drafting(k): a head's greedy chain of k
    # drafts timed whole where it drafts in one call, else k draft steps); the best k by it and by measurement.
    assert set(report["cost_curve"]) == {"mtp", "lookup", "hybrid"}
    for name, curve in report["cost_curve"].items():
        assert curve["decode_ms"] > 0 and set(curve["verify_over_decode"]) == {"2", "4"}
        assert curve["draft_step_over_decode"] > 0 and curve["prompt_tokens"] > 0
        for k in (1, 3):
            r = overall[f"{name}@k={k}"]
            drafting = curve.get("chain_over_decode", {}).get(str(k), k * curve["draft_step_over_decode"])
            expected = r["tau"] / (curve["verify_over_decode"][str(k + 1)] + drafting)
            assert r["predicted_speedup"] == pytest.approx(expected, rel=1e-3, abs=1e-4)  # the report's 4 decimals
        best = report["best_k"][name]
        assert best["predicted"] == max((1, 3), key=lambda k: overall[f"{name}@k={k}"]["predicted_speedup"])
        assert best["measured"] == max((1, 3), key=lambda k: overall[f"{name}@k={k}"]["speedup"])
    assert "predicted_speedup" not in overall["plain"]
    assert report["best"]["predicted_speedup"] == overall[report["best"]["method"]]["predicted_speedup"]
    markdown = (out / "report.md").read_text()
    assert "| mtp@k=3 |" in markdown and "## Per category" in markdown
    assert "predicted (cost curve)" in markdown and "## Cost curve" in markdown
    assert f"{overall['mtp@k=3']['predicted_speedup']:.2f}× |" in markdown


def test_eval_without_a_cost_curve_profiles_nothing_and_still_measures_speedup(setup, monkeypatch):
    """`eval.cost_curve` false (the schema's default): the eval calls nothing of the profile layer, and the report
    still gives each method's measured speedup and each draft's best k by it (what `mtp-train export` reads)."""
    import mtp_train.evaluate.evaluation as evaluation

    def refuse(*args, **kwargs):
        raise AssertionError("the eval profiled step costs without eval.cost_curve")

    monkeypatch.setattr(evaluation, "measure_cost_curves", refuse)
    monkeypatch.setattr(evaluation, "measure_tree_costs", refuse)
    root, recipe, prompts = setup
    assert recipe.eval.cost_curve  # the demo recipe asks for the curve explicitly
    unprofiled = recipe.model_copy(update={"eval": recipe.eval.model_copy(update={"cost_curve": False})})
    out = root / "report-unprofiled"
    report = evaluate(unprofiled, root / "head", None, prompts, None, [1, 2], 8, out, show_progress=False)
    overall = report["overall"]
    assert "cost_curve" not in report
    for name in ("mtp", "lookup"):
        speedups = {k: overall[f"{name}@k={k}"]["speedup"] for k in (1, 2)}
        assert all(s > 0 for s in speedups.values())
        assert all("predicted_speedup" not in overall[f"{name}@k={k}"] for k in (1, 2))
        assert report["best_k"][name] == {"measured": max((1, 2), key=lambda k: speedups[k])}
    markdown = (out / "report.md").read_text()
    assert "## Cost curve" not in markdown and "Best k by measured speedup: mtp k = " in markdown


def test_a_recipe_that_does_not_ask_for_the_cost_curve_gets_none():
    from mtp_train.recipe import load_recipe

    recipes = Path(__file__).resolve().parent.parent / "recipes"
    assert load_recipe(recipes / "qwen2.5-coder-1.5b-mtp.yaml", []).eval.cost_curve is False  # no eval.cost_curve key
    assert load_recipe(RECIPE, []).eval.cost_curve is True  # `make demo` asks for it


def test_eval_on_heldout_split_and_errors(setup, capsys):
    root, recipe, _ = setup
    report = evaluate(recipe, root / "head", None, None, 3, [2], 8, root / "report-heldout", show_progress=False,
                      prompt_lookup=False, hybrid=False)
    printed = capsys.readouterr().out
    assert printed.count("compute dtype") == 1 and "eval: compute dtype float32 (as set)" in printed  # once per stage
    assert report["num_prompts"] == 3 and report["overall"]["mtp@k=2"]["greedy_match"]
    assert set(report["overall"]) == {"plain", "mtp@k=2"}
    settings = report["settings"]  # the dtypes that ran and the machine they ran on
    assert (settings["dtype"], settings["decode_dtype"]) == ("float32", "float32")
    assert settings["precision_reason"] == "set in the recipe" and settings["cpu_capability"]
    from mtp_train.runtime.kernels import cpu_kernels

    # precision.head_decode auto: the head drafts on int8 weights where the CPU kernels serve it
    assert settings["head_decode_weights"] == ("int8" if cpu_kernels() is not None else "float32")
    with pytest.raises(UserError, match="prompts file not found"):
        load_mt_bench(root / "missing.jsonl")


def test_eval_at_several_batch_sizes(setup):
    """`--batch-size 1 2 4`: the prompts answered 1, 2 and 4 at a time (two-turn conversations beside one-turn ones,
    so a batch shrinks between turns); greedy output identical to plain decoding at every batch size; τ, mean
    acceptance length, tokens/s and speedup per batch size in report.json/report.md and the speedup plot."""
    root, recipe, _ = setup
    prompts = root / "batch-prompts.jsonl"
    rows = [{"question_id": i, "category": "c", "turns": [f"question {i} about data"] + ["and more?"] * (i % 2)}
            for i in range(5)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = root / "report-batch"
    report = evaluate(recipe, root / "head", None, prompts, None, [2], 10, out, show_progress=False,
                      batch_sizes=(1, 2, 4))
    assert report["settings"]["batch_sizes"] == [1, 2, 4] and report["settings"]["batch_size"] == 1
    by_batch = report["by_batch_size"]
    assert list(by_batch) == ["1", "2", "4"]
    assert [by_batch[b]["sequences_per_call"] for b in by_batch] == [1, 2, 4]
    assert by_batch["1"]["methods"]["mtp@k=2"]["tau"] == report["overall"]["mtp@k=2"]["tau"]
    for entry in by_batch.values():
        for method in ("mtp@k=2", "lookup@k=2"):
            r = entry["methods"][method]
            assert r["greedy_match"] is True and r["turns"] == 7  # 5 first turns + 2 second turns
            assert 1.0 <= r["tau"] <= 3.0 and 1.0 <= r["mean_acceptance_length"] <= 3.0
            assert r["speedup"] > 0 and r["tokens_per_s"] > 0
        assert entry["methods"]["plain"]["turns"] == 7
    # The same head and greedy decoding: the same tokens whatever the batch, so the same acceptance.
    assert by_batch["4"]["methods"]["mtp@k=2"]["tau"] == by_batch["1"]["methods"]["mtp@k=2"]["tau"]
    assert (out / "speedup_by_batch_size.png").stat().st_size > 0
    markdown = (out / "report.md").read_text()
    assert "## By batch size" in markdown and "batch 4 (4 per call)" in markdown


def test_divergence_gap_reads_the_targets_logits_at_the_first_difference(setup):
    from mtp_train.evaluate.runner import divergence_gap
    from mtp_train.runtime.attention import BatchInfo

    _, recipe, _ = setup
    target = load_model(recipe.target.path, dtype="float32", device="cpu")
    prompt, plain, other = [3, 4, 5], [7, 8, 9, 10], [7, 8, 11, 12]
    logits = target(torch.tensor(prompt + plain[:2]), BatchInfo.without_cache([5])).logits[-1]
    assert divergence_gap(target, prompt, plain, other) == pytest.approx(abs(float(logits[9] - logits[11])))
    assert divergence_gap(target, prompt, plain, plain[:2]) is None


def test_report_gives_per_prompt_speedup_quartiles_and_mean_acceptance_length(tmp_path):
    """Four prompts whose method ÷ plain tok/s are 3, 1, 4, 2: median 2.5 and quartiles 1.75 / 3.25 (linear
    interpolation), beside the ratio of the totals' tokens/s. The mean acceptance length is the committed tokens per
    verify (the prefill's token left out), summed over the calls; τ counts the prefill's forward and token. With a
    cost curve (verify of 3 tokens at 1.2 decode steps, a draft step at 0.1), k = 2 predicts τ / (1.2 + 2 · 0.1)."""
    from mtp_train.evaluate.report import build_report, write_markdown
    from mtp_train.evaluate.runner import MethodTotals
    from mtp_train.runtime.spec import SpecStats
    from mtp_train.profile.costs import CostCurve

    plain, mtp = MethodTotals(), MethodTotals()
    for prompt, (ratio, verifies) in enumerate([(3, 3), (1, 9), (4, 3), (2, 3)]):
        plain.add(prompt, SpecStats("plain", 0, target_sequence_forwards=10, new_tokens=10), seconds=1.0)
        engine = SpecStats("mtp_chain", 2, target_sequence_forwards=1 + verifies, verify_sequence_steps=verifies,
                           new_tokens=10, prefill_tokens=1)
        mtp.add(prompt, engine, seconds=1.0 / ratio)
    meta = {"name": "x", "target": "t", "draft": "d", "draft_kind": "head (mtp)", "prompts": "p", "num_prompts": 4,
            "skipped": [], "settings": {}}
    report = build_report({"plain": {"all": plain}, "mtp@k=2": {"all": mtp}}, meta)
    assert "cost_curve" not in report and "predicted_speedup" not in report["overall"]["mtp@k=2"]  # none measured
    curve = CostCurve(decode_s=0.05, verify_over_decode={3: 1.2}, draft_step_over_decode=0.1, prompt_tokens=30)
    report = build_report({"plain": {"all": plain}, "mtp@k=2": {"all": mtp}}, meta, {"mtp": curve})
    r = report["overall"]["mtp@k=2"]
    assert r["predicted_speedup"] == round(r["tau"] / (1.2 + 2 * 0.1), 4) == 1.2987
    assert report["cost_curve"]["mtp"]["verify_over_decode"] == {"3": 1.2}
    assert report["best_k"] == {"mtp": {"predicted": 2, "measured": 2}}
    assert (r["speedup_median"], r["speedup_p25"], r["speedup_p75"]) == (2.5, 1.75, 3.25)
    assert r["speedup"] == round((40 / (1 / 3 + 1 + 1 / 4 + 1 / 2)) / 10, 4)  # the ratio of totals: 1.92
    assert r["mean_acceptance_length"] == (4 * 9) / (3 + 9 + 3 + 3) == 2.0
    assert r["tau"] == round(40 / (4 + 18), 4)
    assert list(r)[list(r).index("tau") + 1] == "mean_acceptance_length"  # next to τ
    write_markdown(report, tmp_path / "report.md")
    row = "| mtp@k=2 | 1.818 | 2.000 | 0.000 | 0.00, 0.00 | 19.2 | 1.92× | 1.30× | 2.50× [1.75, 3.25] |"
    markdown = (tmp_path / "report.md").read_text()
    assert row in markdown
    best = "2 (predicted 1.30×, measured 1.92×)"  # by the cost curve and by measurement: the only k
    assert f"| mtp | 50.00 | 1.20 | 0.100 |  | {best} | {best} |" in markdown  # no chain(k) measured
