"""Issue 19 item 5: `mtp-train export` records the speculative settings a head was measured best with (its eval
report's best chain k and draft trees) in config.json's `mtp_train.speculative`, with the values each engine that
loads the format takes (SGLang's three flags, vLLM's chain k, written where vLLM reads it). The reports are made by
the real report builder (`evaluate.report.build_report`) from chosen counters, so which setting wins is known."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from mtp_train.errors import UserError
from mtp_train.evaluate.report import build_report
from mtp_train.evaluate.runner import MethodTotals
from mtp_train.export import export_head
from mtp_train.fileio import write_json_atomic
from mtp_train.heads import DraftHead, HeadConfig, head_class, save_head
from mtp_train.runtime.spec import SpecStats
from mtp_train.runtime.spec.costs import CostCurve, TreeCost
from tests.export_helpers import read_config, run_cli

SGLANG_NOTE = "server flags: SGLang reads none of them from the draft's config.json"
VLLM_TREE_NOTE = ("vLLM 0.32.0 drafts chains only: its SpeculativeConfig has no tree option (it rejects "
                  "speculative_token_tree), so vLLM takes the best chain k")

# method suffix -> (verify steps of 10 new tokens after a 1-token prefill, seconds; plain takes 1 s): τ = 10 / (1 +
# verifies), speedup = 1 / seconds. Chains: k=3 has the best τ and (by the cost curve below) the best prediction, k=2
# the best measured speedup. Trees: 3x2x6 the best τ, 2x3x7+lookup the best speedup (a hybrid, which no engine
# drafts), 2x2x4 the best head-only tree, faster than every chain.
CHAINS = {1: (6, 0.6), 2: (4, 0.5), 3: (3, 0.55)}
TREES = {"3x2x6": (2, 0.6), "2x2x4": (3, 0.45), "2x3x7+lookup": (3, 0.4)}
CURVE = CostCurve(decode_s=0.05, verify_over_decode={2: 1.0, 3: 1.05, 4: 1.1}, draft_step_over_decode=0.1,
                  prompt_tokens=20)
TREE_COSTS = {"3x2x6": TreeCost(1.3, 1.2), "2x2x4": TreeCost(1.1, 1.05), "2x3x7": TreeCost(1.4, 1.3)}


def method_totals(schedule: str, k: int, verifies: int, seconds: float) -> MethodTotals:
    totals = MethodTotals()
    totals.add(0, SpecStats(schedule, k, target_sequence_forwards=1 + verifies, verify_sequence_steps=verifies,
                            new_tokens=10, prefill_tokens=1), seconds=seconds)
    return totals


def write_report(path: Path, head_dir: Path, draft: str = "mtp", chains=CHAINS, trees=TREES,
                 draft_kind: str | None = None, cost_curve: bool = True) -> dict:
    """report.json of an eval of `head_dir` (the `draft` method) as `evaluate` writes it (build_report + its meta)."""
    plain = MethodTotals()
    plain.add(0, SpecStats("plain", 0, target_sequence_forwards=10, new_tokens=10), seconds=1.0)
    totals = {"plain": {"all": plain}}
    for k, (verifies, seconds) in chains.items():
        totals[f"{draft}@k={k}"] = {"all": method_totals("mtp_chain", k, verifies, seconds)}
    for label, (verifies, seconds) in trees.items():
        totals[f"{draft}@tree={label}"] = {"all": method_totals("tree", 3, verifies, seconds)}
    meta = {"name": "tiny", "target": "t", "draft": str(head_dir), "draft_kind": draft_kind or f"head ({draft})",
            "draft_method": draft, "prompts": "prompts.jsonl", "num_prompts": 1, "skipped": ["prompts.jsonl:3: x"],
            "settings": {"dtype": "float32", "decode_dtype": "float32", "cpu_capability": "test machine",
                         "batch_size": 1, "max_new_tokens": 10, "temperature": 0.0, "num_speculative_tokens":
                         sorted(chains), "trees": [f"{draft}@tree={label}" for label in trees]}}
    tree_costs = {label.split("+")[0]: TREE_COSTS[label.split("+")[0]] for label in trees}
    report = build_report(totals, meta, {draft: CURVE} if cost_curve else None, tree_costs if cost_curve else None)
    write_json_atomic(path, report)
    return report


@pytest.fixture(scope="module")
def run_dir(target, tmp_path_factory) -> Path:
    """runs/<name>/ with an MTP head in head/ and its eval report in eval/report.json, where `mtp-train eval` puts
    them."""
    root = tmp_path_factory.mktemp("run")
    torch.manual_seed(0)
    save_head(DraftHead.from_target(target, HeadConfig.for_target(target.config, target.fingerprint, kind="mtp")),
              root / "head")
    write_report(root / "eval" / "report.json", root / "head")
    return root


def expected_chain(report: dict, k: int, draft: str = "mtp") -> dict:
    r = report["overall"][f"{draft}@k={k}"]
    return {"method": f"{draft}@k={k}", "k": k, "tau": r["tau"], "speedup": r["speedup"],
            "predicted_speedup": r["predicted_speedup"]}


def expected_tree(report: dict, label: str, draft: str = "mtp") -> dict:
    t = report["trees"][f"{draft}@tree={label}"]
    return {"method": f"{draft}@tree={label}", "depth": t["depth"], "topk": t["topk"], "nodes": t["nodes"],
            "hybrid": t["hybrid"], "tau": t["tau"], "speedup": t["speedup"],
            "predicted_speedup": t["predicted_speedup"]}


def test_export_records_exactly_the_reports_best_settings(run_dir, target_dir, tmp_path, capsys):
    """The run's report is found next to its head; the block holds its best chain k by measured speedup (2) and by
    prediction (3), its best tree by τ (3x2x6) and by measured speedup (the hybrid 2x3x7+lookup), what they were
    measured on; vLLM's k (the measured best) is written into vllm_serve.json; the CLI prints the same."""
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    assert report["best_k"]["mtp"] == {"predicted": 3, "measured": 2}  # the chosen counters do what they should
    assert report["best_tree"]["method"] == "mtp@tree=2x3x7+lookup"

    out = export_head(run_dir / "head", "vllm-mtp", tmp_path / "vllm-mtp", target_dir)
    block = read_config(out)["mtp_train"]["speculative"]
    assert block == {
        "eval_report": str((run_dir / "eval" / "report.json").resolve()),
        "measured_on": {"draft": str(run_dir / "head"), "prompts": "prompts.jsonl", "num_prompts": 1,
                        "skipped_prompts": 1, "batch_size": 1, "max_new_tokens": 10, "temperature": 0.0,
                        "dtype": "float32", "decode_dtype": "float32", "cpu_capability": "test machine"},
        "chain": {"by_measured_speedup": expected_chain(report, 2), "by_predicted_speedup": expected_chain(report, 3)},
        "tree": {"by_tau": expected_tree(report, "3x2x6"),
                 "by_measured_speedup": expected_tree(report, "2x3x7+lookup")},
        "engines": {"vllm": {"num_speculative_tokens": 2,
                             "from": "the eval report's best k by measured speedup (mtp@k=2)",
                             "tree": VLLM_TREE_NOTE}},  # vllm-mtp: vLLM's MiMoMTP only, so no SGLang entry
    }
    serve = json.loads((out / "vllm_serve.json").read_text())
    assert serve["speculative_config"]["num_speculative_tokens"] == 2

    assert run_cli(["export", "--head", str(run_dir / "head"), "--format", "vllm-mtp", "--target", str(target_dir),
                    "--out", str(tmp_path / "cli"), "--num-speculative-tokens", "4"]) == 0
    printed = capsys.readouterr().out
    assert "chain: best k by measured speedup k=2 (τ 2.000, measured 2.00×, predicted 1.60×); by the cost curve's " \
           "prediction k=3 (τ 2.500, measured 1.82×, predicted 1.79×)" in printed
    assert "tree: best by τ 3x2x6 (τ 3.333" in printed and "by measured speedup 2x3x7+lookup (τ 2.500" in printed
    assert 'vLLM: "num_speculative_tokens": 4 (--num-speculative-tokens)' in printed  # an explicit k wins
    assert "no measured setting beat plain decoding" not in printed  # 2.50× did
    config = read_config(tmp_path / "cli")
    assert config["mtp_train"]["speculative"]["chain"] == block["chain"]  # the measurements are recorded all the same
    assert json.loads((tmp_path / "cli" / "vllm_serve.json").read_text())["speculative_config"][
        "num_speculative_tokens"] == 4


def test_sglang_gets_the_faster_of_the_best_chain_and_the_best_head_only_tree(target, target_dir, tmp_path):
    """The eagle format (SGLang and vLLM): SGLang's flags are those of 2x2x4 (2.22×, faster than the best chain's
    2.00×; the hybrid tree is faster still but SGLang has no lookup branch): steps = depth, topk, draft tokens =
    nodes + 1 (the root counted). When a chain beats every head-only tree, SGLang gets the chain: topk 1, k + 1
    tokens. The eagle3 format writes the measured k into speculators_config, which vLLM reads."""
    torch.manual_seed(0)
    config = HeadConfig.for_target(target.config, target.fingerprint, kind="eagle1", fc_bias=False)
    head_dir = save_head(DraftHead.from_target(target, config), tmp_path / "eagle1" / "head")
    report_path = tmp_path / "reports" / "report.json"
    write_report(report_path, head_dir, draft="eagle1")
    out = export_head(head_dir, "eagle", tmp_path / "eagle", target_dir, eval_report=report_path.parent)
    engines = read_config(out)["mtp_train"]["speculative"]["engines"]
    assert engines["sglang"] == {
        "speculative_num_steps": 2, "speculative_eagle_topk": 2, "speculative_num_draft_tokens": 5,
        "from": "eagle1@tree=2x2x4", "measured_speedup": 2.2222,
        "args": "--speculative-num-steps 2 --speculative-eagle-topk 2 --speculative-num-draft-tokens 5",
        "note": SGLANG_NOTE,
        "not_used": "eagle1@tree=2x3x7+lookup, the fastest tree: SGLang drafts no prompt-lookup branch",
    }
    assert engines["vllm"]["num_speculative_tokens"] == 2

    slow_trees = {"3x2x6": (2, 0.6), "2x2x4": (3, 0.7)}
    write_report(report_path, head_dir, draft="eagle1", trees=slow_trees)
    out = export_head(head_dir, "eagle", tmp_path / "eagle-chain", target_dir, eval_report=report_path)
    sglang = read_config(out)["mtp_train"]["speculative"]["engines"]["sglang"]
    assert (sglang["args"], sglang["from"], "not_used" in sglang) == (
        "--speculative-num-steps 2 --speculative-eagle-topk 1 --speculative-num-draft-tokens 3", "eagle1@k=2", False)


def test_eagle3_writes_the_measured_k_where_vllm_reads_it(tmp_path):
    """vLLM reads num_speculative_tokens from an eagle3 export's speculators_config.proposal_methods[0].
    speculative_tokens when the export itself is served (`vllm serve <export>`): the measured best k goes there."""
    from mtp_train.runtime.loader import load_model

    from tests.tiny_models import save_tiny_model

    deeper_dir = save_tiny_model(tmp_path / "target4", "llama", seed=3, num_hidden_layers=4)
    deeper = load_model(deeper_dir, dtype="float32", device="cpu")
    torch.manual_seed(0)
    config = HeadConfig.for_target(deeper.config, deeper.fingerprint, kind="eagle3", aux_layers=(0, 1, 3))
    head_dir = save_head(head_class("eagle3").from_target(deeper, config), tmp_path / "run" / "head")
    report = write_report(tmp_path / "run" / "eval" / "report.json", head_dir, draft="eagle3")
    out = export_head(head_dir, "eagle3", tmp_path / "eagle3", deeper_dir)
    config = read_config(out)
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 2 == report["best_k"][
        "eagle3"]["measured"]
    assert set(config["mtp_train"]["speculative"]["engines"]) == {"vllm", "sglang"}


def test_no_report_no_block_and_the_log_says_so(run_dir, target, target_dir, tmp_path, caplog):
    """No report next to the head: no block, k = 3, and the export's log line says why. --no-eval-report ignores a
    report that is there."""
    torch.manual_seed(1)
    head_dir = save_head(DraftHead.from_target(target, HeadConfig.for_target(target.config, target.fingerprint)),
                         tmp_path / "lone" / "head")
    with caplog.at_level(logging.INFO, logger="mtp_train.export.exporter"):
        out = export_head(head_dir, "vllm-mtp", tmp_path / "out", target_dir)
    config = read_config(out)
    assert "speculative" not in config["mtp_train"]
    assert json.loads((out / "vllm_serve.json").read_text())["speculative_config"]["num_speculative_tokens"] == 3
    line = caplog.records[-1].getMessage()
    assert f"no eval report at {tmp_path / 'lone' / 'eval' / 'report.json'}" in line
    assert "config.json records no measured speculative settings; serving k = 3 (the default (no measured k))" in line

    out = export_head(run_dir / "head", "native", tmp_path / "native", target_dir, use_eval_report=False)
    assert "speculative" not in read_config(out)["mtp_train"]


def test_a_report_without_trees_gives_the_chain_only(target, target_dir, tmp_path):
    torch.manual_seed(2)
    head_dir = save_head(DraftHead.from_target(target, HeadConfig.for_target(target.config, target.fingerprint)),
                         tmp_path / "run" / "head")
    report = write_report(tmp_path / "run" / "eval" / "report.json", head_dir, trees={})
    assert "trees" not in report
    out = export_head(head_dir, "native", tmp_path / "native", target_dir)
    block = read_config(out)["mtp_train"]["speculative"]
    assert block["chain"] == {"by_measured_speedup": expected_chain(report, 2),
                              "by_predicted_speedup": expected_chain(report, 3)}
    assert "tree" not in block and "engines" not in block  # native: our runtime, no engine flags

    report = write_report(tmp_path / "run" / "eval" / "report.json", head_dir, trees={}, cost_curve=False)
    assert "best_k" not in report  # no cost curve: no prediction to record
    out = export_head(head_dir, "vllm-mtp", tmp_path / "vllm-mtp", target_dir)
    block = read_config(out)["mtp_train"]["speculative"]
    r = report["overall"]["mtp@k=2"]
    assert block["chain"] == {"by_measured_speedup": {"method": "mtp@k=2", "k": 2, "tau": r["tau"],
                                                      "speedup": r["speedup"]}}
    assert block["engines"]["vllm"]["num_speculative_tokens"] == 2


def test_a_report_of_another_draft_is_never_used(run_dir, target, target_dir, tmp_path, caplog):
    """The default place holds a report of another head: not used (the log says whose it is). Given explicitly, it
    is refused, naming both; so is a report of a draft model. A copy of the measured head (same recorded weights
    checksum) is the same head."""
    torch.manual_seed(3)
    other = save_head(DraftHead.from_target(target, HeadConfig.for_target(target.config, target.fingerprint)),
                      tmp_path / "other" / "head")
    write_report(tmp_path / "other" / "eval" / "report.json", run_dir / "head")
    with caplog.at_level(logging.INFO, logger="mtp_train.export.exporter"):
        out = export_head(other, "native", tmp_path / "a", target_dir)
    assert "speculative" not in read_config(out)["mtp_train"]
    assert f"it measured the head {run_dir / 'head'}, not {other}" in caplog.records[-1].getMessage()
    with pytest.raises(UserError, match="it measured the head .*pass the report of an eval of this head"):
        export_head(other, "native", tmp_path / "b", target_dir, eval_report=run_dir / "eval" / "report.json")
    write_report(tmp_path / "draft-model" / "report.json", tmp_path / "small-model",
                 draft_kind="draft model (target–draft)")
    with pytest.raises(UserError, match=r"it measured a draft model \(target–draft\)"):
        export_head(other, "native", tmp_path / "c", target_dir, eval_report=tmp_path / "draft-model")

    import shutil

    copy = Path(shutil.copytree(run_dir / "head", tmp_path / "copy" / "head"))
    out = export_head(copy, "native", tmp_path / "d", target_dir, eval_report=run_dir / "eval")
    assert read_config(out)["mtp_train"]["speculative"]["chain"]["by_measured_speedup"]["k"] == 2


def test_a_malformed_report_names_the_key(run_dir, target_dir, tmp_path):
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    report["trees"]["mtp@tree=2x2x4"]["topk"] = "two"
    bad = tmp_path / "report.json"
    bad.write_text(json.dumps(report))
    with pytest.raises(UserError, match=r"report.json: trees.mtp@tree=2x2x4.topk='two'; expected a positive integer"):
        export_head(run_dir / "head", "native", tmp_path / "out", target_dir, eval_report=bad)
    assert not (tmp_path / "out").exists()


def test_a_report_older_than_the_heads_weights_is_not_found_by_default(target, target_dir, tmp_path, caplog):
    """A head trained again after its eval: the report next to it is stale and not used (the log says so); given
    explicitly it is used, with a warning. A malformed report next to the head stops the export with the way out."""
    import os

    torch.manual_seed(4)
    head_dir = save_head(DraftHead.from_target(target, HeadConfig.for_target(target.config, target.fingerprint)),
                         tmp_path / "run" / "head")
    report_path = tmp_path / "run" / "eval" / "report.json"
    write_report(report_path, head_dir)
    later = report_path.stat().st_mtime + 60
    os.utime(head_dir / "model.safetensors", (later, later))
    with caplog.at_level(logging.INFO, logger="mtp_train.export"):
        out = export_head(head_dir, "native", tmp_path / "a", target_dir)
        assert "speculative" not in read_config(out)["mtp_train"]
        assert f"{report_path} not used: it is older than {head_dir / 'model.safetensors'}" in caplog.text
        out = export_head(head_dir, "native", tmp_path / "b", target_dir, eval_report=report_path)
    assert read_config(out)["mtp_train"]["speculative"]["chain"]["by_measured_speedup"]["k"] == 2
    assert f"{report_path} is older than" in caplog.text

    report_path.write_text("{not json")
    with pytest.raises(UserError, match=r"invalid JSON .*\(found next to the head: fix it, pass --eval-report FILE, "
                                        r"or --no-eval-report\)"):
        export_head(head_dir, "native", tmp_path / "c", target_dir)
