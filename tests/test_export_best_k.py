"""`mtp-train export` takes the serving k from the head's eval report: the k with the largest measured speedup,
recorded with the τ and speedup measured per k in config.json's `mtp_train.speculative` and written where vLLM reads
it. The reports are made by the real report builder (`evaluate.report.build_report`) from chosen counters, so which
k wins is known; a cost curve in the report (which predicts another k) changes nothing."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

from mtp_train.errors import UserError
from mtp_train.evaluate.report import build_report
from mtp_train.evaluate.runner import MethodTotals
from mtp_train.export import export_head
from mtp_train.fileio import write_json_atomic
from mtp_train.heads import DraftHead, HeadConfig, head_class, save_head
from mtp_train.profile.costs import CostCurve
from mtp_train.runtime.spec import SpecStats
from tests.export_helpers import read_config, run_cli

# k -> (verify steps of 10 new tokens after a 1-token prefill, seconds; plain takes 1 s): τ = 10 / (1 + verifies),
# speedup = 1 / seconds. k = 3 has the best τ and (by the cost curve below) the best prediction, k = 2 the best
# measured speedup. A tree beside them is faster still: the export's k is a chain's.
CHAINS = {1: (6, 0.6), 2: (4, 0.5), 3: (3, 0.55)}
TREES = {"3x2x6": (2, 0.4)}
CURVE = CostCurve(decode_s=0.05, verify_over_decode={2: 1.0, 3: 1.05, 4: 1.1}, draft_step_over_decode=0.1,
                  prompt_tokens=20)


def method_totals(schedule: str, k: int, verifies: int, seconds: float) -> MethodTotals:
    totals = MethodTotals()
    totals.add(0, SpecStats(schedule, k, target_sequence_forwards=1 + verifies, verify_sequence_steps=verifies,
                            new_tokens=10, prefill_tokens=1), seconds=seconds)
    return totals


def write_report(path: Path, head_dir: Path, draft: str = "mtp", chains=CHAINS, trees=TREES,
                 draft_kind: str | None = None, cost_curve: bool = False) -> dict:
    """report.json of an eval of `head_dir` (the `draft` method) as `evaluate` writes it (build_report + its meta)."""
    plain = MethodTotals()
    plain.add(0, SpecStats("plain", 0, target_sequence_forwards=10, new_tokens=10), seconds=1.0)
    totals = {"plain": {"all": plain}}
    for k, (verifies, seconds) in chains.items():
        totals[f"{draft}@k={k}"] = {"all": method_totals("mtp_chain", k, verifies, seconds)}
    for label, (verifies, seconds) in trees.items():
        totals[f"{draft}@tree={label}"] = {"all": method_totals("tree", 3, verifies, seconds)}
    meta = {"name": "tiny", "target": "t", "draft": str(head_dir), "draft_kind": draft_kind or f"head ({draft})",
            "draft_method": draft, "prompts": "prompts.jsonl", "num_prompts": 1, "skipped": [],
            "settings": {"dtype": "float32", "cpu_capability": "test machine", "batch_size": 1,
                         "num_speculative_tokens": sorted(chains)}}
    report = build_report(totals, meta, {draft: CURVE} if cost_curve else None)
    write_json_atomic(path, report)
    return report


def measured(report: dict, draft: str = "mtp") -> dict:
    """The block's per-k record: the report's τ and speedup of each chain."""
    return {str(k): {"tau": report["overall"][f"{draft}@k={k}"]["tau"],
                     "speedup": report["overall"][f"{draft}@k={k}"]["speedup"]} for k in sorted(CHAINS)}


def mtp_head(target, path: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    return save_head(DraftHead.from_target(target, HeadConfig.for_target(target.config, target.fingerprint)), path)


@pytest.fixture(scope="module")
def run_dir(target, tmp_path_factory) -> Path:
    """runs/<name>/ with an MTP head in head/ and its eval report (with a cost curve) in eval/report.json, where
    `mtp-train eval` puts them."""
    root = tmp_path_factory.mktemp("run")
    mtp_head(target, root / "head", seed=0)
    write_report(root / "eval" / "report.json", root / "head", cost_curve=True)
    return root


def test_export_records_the_reports_best_k_by_measured_speedup(run_dir, target_dir, tmp_path, capsys):
    """The run's report is found next to its head; the block holds its best k by measured speedup (2, not the cost
    curve's 3) with τ and speedup per k; vLLM's k is written into vllm_serve.json; the CLI prints the same. An
    explicit --num-speculative-tokens wins for serving; the measurement is recorded all the same."""
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    assert report["best_k"]["mtp"] == {"predicted": 3, "measured": 2}  # the chosen counters do what they should

    out = export_head(run_dir / "head", "vllm-mtp", tmp_path / "vllm-mtp", target_dir)
    block = read_config(out)["mtp_train"]["speculative"]
    assert block == {"eval_report": str((run_dir / "eval" / "report.json").resolve()), "best_k": 2,
                     "method": "mtp@k=2", "measured": measured(report)}
    assert block["measured"]["2"] == {"tau": 2.0, "speedup": 2.0}
    serve = json.loads((out / "vllm_serve.json").read_text())
    assert serve["speculative_config"]["num_speculative_tokens"] == 2

    assert run_cli(["export", "--head", str(run_dir / "head"), "--format", "vllm-mtp", "--target", str(target_dir),
                    "--out", str(tmp_path / "cli"), "--num-speculative-tokens", "4"]) == 0
    printed = capsys.readouterr().out
    assert ("best k by measured speedup: 2 (mtp_train.speculative in config.json; k=1 1.67× (τ 1.429), k=2 2.00× "
            "(τ 2.000), k=3 1.82× (τ 2.500); from ") in printed
    assert "no k beat plain decoding" not in printed
    assert read_config(tmp_path / "cli")["mtp_train"]["speculative"] == block
    assert json.loads((tmp_path / "cli" / "vllm_serve.json").read_text())["speculative_config"][
        "num_speculative_tokens"] == 4


def test_a_report_without_a_cost_curve_gives_the_same_k(target, target_dir, tmp_path):
    """The eval's default (no cost curve) writes the measured speedups per k and best_k.measured: the export needs
    nothing more."""
    head_dir = mtp_head(target, tmp_path / "run" / "head", seed=2)
    report = write_report(tmp_path / "run" / "eval" / "report.json", head_dir, trees={})
    assert "cost_curve" not in report and report["best_k"] == {"mtp": {"measured": 2}}
    out = export_head(head_dir, "native", tmp_path / "native", target_dir)
    assert read_config(out)["mtp_train"]["speculative"] == {
        "eval_report": str((tmp_path / "run" / "eval" / "report.json").resolve()), "best_k": 2, "method": "mtp@k=2",
        "measured": measured(report)}


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
    assert config["mtp_train"]["speculative"]["best_k"] == 2


def test_no_report_no_block_and_the_log_says_so(run_dir, target, target_dir, tmp_path, caplog):
    """No report next to the head: no block, k = 3, and the export's log line says why. --no-eval-report ignores a
    report that is there."""
    head_dir = mtp_head(target, tmp_path / "lone" / "head", seed=1)
    with caplog.at_level(logging.INFO, logger="mtp_train.export.exporter"):
        out = export_head(head_dir, "vllm-mtp", tmp_path / "out", target_dir)
    config = read_config(out)
    assert "speculative" not in config["mtp_train"]
    assert json.loads((out / "vllm_serve.json").read_text())["speculative_config"]["num_speculative_tokens"] == 3
    line = caplog.records[-1].getMessage()
    assert f"no eval report at {tmp_path / 'lone' / 'eval' / 'report.json'}" in line
    assert "config.json records no measured k; serving k = 3 (the default (no measured k))" in line

    out = export_head(run_dir / "head", "native", tmp_path / "native", target_dir, use_eval_report=False)
    assert "speculative" not in read_config(out)["mtp_train"]


def test_a_report_of_another_draft_is_never_used(run_dir, target, target_dir, tmp_path, caplog):
    """The default place holds a report of another head: not used (the log says whose it is). Given explicitly, it
    is refused, naming both; so is a report of a draft model. A copy of the measured head (same recorded weights
    checksum) is the same head."""
    other = mtp_head(target, tmp_path / "other" / "head", seed=3)
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

    copy = Path(shutil.copytree(run_dir / "head", tmp_path / "copy" / "head"))
    out = export_head(copy, "native", tmp_path / "d", target_dir, eval_report=run_dir / "eval")
    assert read_config(out)["mtp_train"]["speculative"]["best_k"] == 2


def test_a_malformed_report_names_the_key(run_dir, target_dir, tmp_path):
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    report["overall"]["mtp@k=2"]["speedup"] = "fast"
    bad = tmp_path / "report.json"
    bad.write_text(json.dumps(report))
    with pytest.raises(UserError, match=r"report.json: overall.mtp@k=2.speedup='fast'; expected a number"):
        export_head(run_dir / "head", "native", tmp_path / "out", target_dir, eval_report=bad)
    assert not (tmp_path / "out").exists()

    report["overall"] = {"plain": report["overall"]["plain"], "mtp@tree=3x2x6": report["overall"]["mtp@tree=3x2x6"]}
    bad.write_text(json.dumps(report))
    with pytest.raises(UserError, match=r"overall holds no chain of the draft \(mtp@k=<k>\) to take a k from"):
        export_head(run_dir / "head", "native", tmp_path / "out", target_dir, eval_report=bad)


def test_a_report_older_than_the_heads_weights_is_not_found_by_default(target, target_dir, tmp_path, caplog):
    """A head trained again after its eval: the report next to it is stale and not used (the log says so); given
    explicitly it is used, with a warning. A malformed report next to the head stops the export with the way out."""
    head_dir = mtp_head(target, tmp_path / "run" / "head", seed=4)
    report_path = tmp_path / "run" / "eval" / "report.json"
    write_report(report_path, head_dir)
    later = report_path.stat().st_mtime + 60
    os.utime(head_dir / "model.safetensors", (later, later))
    with caplog.at_level(logging.INFO, logger="mtp_train.export"):
        out = export_head(head_dir, "native", tmp_path / "a", target_dir)
        assert "speculative" not in read_config(out)["mtp_train"]
        assert f"{report_path} not used: it is older than {head_dir / 'model.safetensors'}" in caplog.text
        out = export_head(head_dir, "native", tmp_path / "b", target_dir, eval_report=report_path)
    assert read_config(out)["mtp_train"]["speculative"]["best_k"] == 2
    assert f"{report_path} is older than" in caplog.text

    report_path.write_text("{not json")
    with pytest.raises(UserError, match=r"invalid JSON .*\(found next to the head: fix it, pass --eval-report FILE, "
                                        r"or --no-eval-report\)"):
        export_head(head_dir, "native", tmp_path / "c", target_dir)


def vllm_section(kind: str, speedups: dict[int, float]) -> dict:
    """The report's `vllm` section as `export.vllm_eval.evaluate_in_vllm` writes it (the fields export reads)."""
    return {"engine": "vllm", "methods": {f"{kind}@k={k}": {"k": k, "tau": 1.0 + k / 4, "speedup": speedup}
                                          for k, speedup in speedups.items()}}


def test_the_export_takes_vllms_k_from_an_eval_in_vllm(target, target_dir, tmp_path):
    """`eval --engine vllm` writes its section and the draft's names (no figures of our engine): the export records
    vLLM's best k; beside our engine's figures (`--engine both`) vLLM's measurement wins too (it serves the export)."""
    head_dir = mtp_head(target, tmp_path / "run" / "head", seed=4)
    report_path = tmp_path / "run" / "eval" / "report.json"
    write_json_atomic(report_path, {"name": "tiny", "target": "t", "draft": str(head_dir), "draft_kind": "head (mtp)",
                                    "draft_method": "mtp", "vllm": vllm_section("mtp", {1: 1.1, 2: 1.05, 3: 0.9})})
    block = read_config(export_head(head_dir, "vllm-mtp", tmp_path / "only", target_dir))["mtp_train"]["speculative"]
    assert (block["best_k"], block["method"]) == (1, "vllm mtp@k=1")
    assert block["measured"]["2"] == {"tau": 1.5, "speedup": 1.05}
    both = write_report(report_path, head_dir, trees={})  # our engine: k = 2 by measured speedup
    write_json_atomic(report_path, {**both, "vllm": vllm_section("mtp", {1: 1.0, 2: 1.02, 3: 1.2})})
    block = read_config(export_head(head_dir, "vllm-mtp", tmp_path / "both", target_dir))["mtp_train"]["speculative"]
    assert (block["best_k"], block["method"]) == (3, "vllm mtp@k=3")
