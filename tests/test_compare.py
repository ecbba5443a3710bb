"""`mtp-train compare`: recipe differences, numbers, plots and missing pieces, on hand-built run dirs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from mtp_train.errors import UserError
from mtp_train.evaluate import compare
from mtp_train.recipe import load_recipe, save_resolved

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RECIPE = REPO_ROOT / "recipes" / "smollm2-135m-mtp.yaml"


def _report(taus: dict[int, tuple[int, int, list[int], list[int]]], plain_seconds: float = 2.0,
            lookup: dict[int, tuple[int, int, list[int], list[int]]] | None = None, draft: str = "mtp") -> dict:
    """An eval report in the real format, built by the real report code from engine counters (one prompt).
    taus (the draft) and lookup (the prompt-lookup baseline): k -> (new_tokens, target_forwards,
    drafted_per_position, accepted_per_position); time = plain_seconds × forwards / 100."""
    from mtp_train.evaluate.report import build_report
    from mtp_train.evaluate.runner import MethodTotals
    from mtp_train.runtime.spec import SpecStats

    totals = {"plain": {"all": MethodTotals()}}
    totals["plain"]["all"].add(0, SpecStats("plain", 0, target_sequence_forwards=100, new_tokens=100), plain_seconds)
    for name, counts in ((draft, taus), ("lookup", lookup or {})):
        for k, (tokens, forwards, drafted, accepted) in counts.items():
            method = MethodTotals()
            engine = SpecStats(name, k, target_sequence_forwards=forwards, verify_sequence_steps=forwards - 1,
                               new_tokens=tokens, prefill_tokens=1, drafted_tokens=sum(drafted),
                               accepted_tokens=sum(accepted), drafted_per_position=drafted,
                               accepted_per_position=accepted)
            method.add(0, engine, plain_seconds * forwards / 100, matched_turns=1)
            totals[f"{name}@k={k}"] = {"all": method}
    meta = {"name": "x", "target": "t", "draft": "d", "draft_kind": f"head ({draft})", "draft_method": draft,
            "prompts": "p.jsonl", "num_prompts": 2, "skipped": [], "settings": {}}
    return build_report(totals, meta)


def make_run(root: Path, name: str, overrides: list[str], losses: list[float], val_top1: list[float],
             with_summary: bool = True, report: dict | None = None) -> Path:
    run_dir = root / name
    recipe = load_recipe(DEFAULT_RECIPE, [f"name={name}", f"train.run_dir={run_dir}", "train.unroll_steps=2",
                                          *overrides])
    run_dir.mkdir(parents=True)
    save_resolved(recipe, run_dir)
    rows = []
    for step, loss in enumerate(losses, 1):
        row = {"step": step, "time": step * 0.5, "loss": loss, "lr": 1e-4, "tokens": 4000, "epoch": 0,
               "train/step1/top1": 0.5 + 0.01 * step, "train/step2/top1": 0.3 + 0.01 * step,
               "tokens_per_s": 1000.0 + step}
        if step % 2 == 0:
            top1 = val_top1[step // 2 - 1]
            row.update({"val/step1/top1": top1, "val/step1/alpha": top1 + 0.05, "val/step1/rows": 50,
                        "val/step2/top1": top1 - 0.2, "val/step2/alpha": top1 - 0.15, "val/step2/rows": 48})
        rows.append(row)
    if report is not None:  # what `mtp-train eval` appends to the run's metrics.jsonl (no loss)
        best = report["best"]["method"]
        rows.append({"step": len(losses), f"eval/{best}/tau": report["overall"][best]["tau"]})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if with_summary:
        last_val = [r for r in rows if "val/step1/top1" in r][-1]
        summary = {"steps": len(losses), "tokens": 4000 * len(losses), "train_seconds": 4.0, "world_size": 2,
                   "head_dir": str(run_dir / "head"), "target_fingerprint": "abc",
                   **{k: v for k, v in last_val.items() if k.startswith("val/")}}
        (run_dir / "summary.json").write_text(json.dumps(summary))
    if report is not None:
        (run_dir / "eval").mkdir()
        (run_dir / "eval" / "report.json").write_text(json.dumps(report))
    return run_dir


@pytest.fixture()
def two_runs(tmp_path: Path) -> tuple[Path, Path]:
    report_a = _report({1: (100, 60, [59], [41]), 3: (100, 40, [39, 39, 39], [30, 20, 10])},
                       lookup={1: (100, 55, [54], [45]), 3: (100, 35, [34, 34, 34], [30, 25, 10])})
    run_a = make_run(tmp_path / "runs", "mtp-lr3e-4", ["head.kind=mtp", "train.lr=3e-4"],
                     losses=[2.0, 1.5, 1.2, 1.0], val_top1=[0.55, 0.62], report=report_a)
    run_b = make_run(tmp_path / "runs", "eagle1-lr1e-4", ["head.kind=eagle1", "train.lr=1e-4"],
                     losses=[2.1, 1.8, 1.6, 1.4, 1.3, 1.25], val_top1=[0.40, 0.45, 0.48], with_summary=False)
    return run_a, run_b


def test_compare_two_runs(two_runs: tuple[Path, Path], tmp_path: Path, capsys) -> None:
    run_a, run_b = two_runs
    out = tmp_path / "cmp"
    result = compare.compare_runs([run_a, run_b], out)

    # Only the experiment's keys differ; output locations and names are ignored.
    assert set(result["differing_keys"]) == {"head.kind", "train.lr"}
    assert result["differing_keys"]["head.kind"] == {"mtp-lr3e-4": "mtp", "eagle1-lr1e-4": "eagle1"}
    assert result["differing_keys"]["train.lr"] == {"mtp-lr3e-4": pytest.approx(3e-4),
                                                    "eagle1-lr1e-4": pytest.approx(1e-4)}

    a, b = result["runs"]
    assert a["label"] == "mtp-lr3e-4" and b["label"] == "eagle1-lr1e-4"
    assert a["recipe_values"] == {"head.kind": "mtp", "train.lr": pytest.approx(3e-4)}
    # Final train loss: the last row with a loss (the appended eval row is skipped).
    assert a["train"]["final_loss"] == pytest.approx(1.0) and a["train"]["steps"] == 4
    assert b["train"]["final_loss"] == pytest.approx(1.25) and b["train"]["steps"] == 6
    assert a["train"]["tokens"] == 16000 and b["train"]["tokens"] == 24000  # summary, else the sum of rows
    assert a["train"]["tokens_per_s"] == pytest.approx(1004.0) and b["train"]["tokens_per_s"] == pytest.approx(1006.0)
    # Held-out accuracy per unroll step: from summary.json (a), else the last validation row (b).
    assert a["val_source"] == "summary.json" and b["val_source"] == "metrics.jsonl step 6"
    assert a["val"]["1"]["top1"] == pytest.approx(0.62) and a["val"]["2"]["top1"] == pytest.approx(0.42)
    assert b["val"]["1"]["top1"] == pytest.approx(0.48) and b["val"]["2"]["alpha"] == pytest.approx(0.33)
    # Eval: τ and α per k, the best method and its speedup, from the report.
    ev = a["eval"]
    assert ev["by_k"]["1"]["tau"] == pytest.approx(100 / 60, abs=1e-4)
    assert ev["by_k"]["3"]["tau"] == pytest.approx(2.5)
    assert ev["by_k"]["3"]["alpha"] == pytest.approx(60 / 117, abs=1e-4)
    assert ev["by_k"]["3"]["acceptance_per_position"] == pytest.approx([30 / 39, 20 / 39, 10 / 39], abs=1e-4)
    assert ev["best"]["method"] == "mtp@k=3" and ev["best"]["speedup"] == pytest.approx(2.5)
    # Mean acceptance length (tokens per verify, prefill left out) and the per-prompt speedups (one prompt here).
    assert ev["by_k"]["3"]["mean_acceptance_length"] == pytest.approx(99 / 39, abs=1e-4)
    assert ev["best"]["speedup_median"] == ev["best"]["speedup_p25"] == ev["best"]["speedup_p75"] == pytest.approx(2.5)
    # The prompt-lookup baseline is kept apart, never mistaken for the head (it has the higher τ at every k here).
    assert ev["draft_method"] == "mtp" and ev["by_k"]["1"]["method"] == "mtp@k=1"
    assert ev["baselines"]["lookup"]["3"]["tau"] == pytest.approx(100 / 35, abs=1e-4)
    assert ev["plain_tokens_per_s"] == pytest.approx(50.0)
    assert b["eval"] is None
    assert "no eval/report.json" in b["missing"] and "no summary.json" in b["missing"]
    assert a["missing"] == []

    # Files: compare.json equals what was returned; compare.md has the table; plots exist and are non-empty.
    assert json.loads((out / "compare.json").read_text()) == json.loads(json.dumps(result))
    markdown = (out / "compare.md").read_text()
    assert "| recipe: head.kind | mtp | eagle1 |" in markdown
    assert "| eval best speedup | 2.50× | — |" in markdown
    assert "| eval mean acceptance length @k=3 | 2.5385 | — |" in markdown
    assert "| eval best speedup per prompt: median [p25, p75] | 2.50× [2.50×, 2.50×] | — |" in markdown
    assert "| baseline lookup: best speedup | 2.86× (lookup@k=3, τ 2.8571) | — |" in markdown
    for name in ("loss_curves.png", "val_top1_by_step.png", "acceptance_by_position.png"):
        path = out / name
        assert path.is_file() and path.stat().st_size > 1000, name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result["plots"] == ["loss_curves.png", "val_top1_by_step.png", "acceptance_by_position.png"]

    printed = capsys.readouterr().out
    assert "recipe: train.lr" in printed and "final train loss" in printed and "held-out top-1 step 2" in printed


def test_compare_without_any_eval_report_skips_the_acceptance_plot(tmp_path: Path) -> None:
    run_a = make_run(tmp_path, "a", ["train.lr=3e-4"], losses=[1.0, 0.9], val_top1=[0.5])
    run_b = make_run(tmp_path, "b", ["train.lr=2e-4"], losses=[1.0, 0.8], val_top1=[0.6])
    result = compare.compare_runs([run_a, run_b], tmp_path / "cmp", echo=False)
    assert set(result["differing_keys"]) == {"train.lr"}
    assert all(run["eval"] is None and "no eval/report.json" in run["missing"] for run in result["runs"])
    assert not (tmp_path / "cmp" / "acceptance_by_position.png").exists()
    assert any(s.startswith("acceptance_by_position.png") for s in result["plots_skipped"])
    assert (tmp_path / "cmp" / "loss_curves.png").stat().st_size > 0
    assert "| eval best method | — | — |" in (tmp_path / "cmp" / "compare.md").read_text()


def test_partial_runs_are_reported_not_fatal(tmp_path: Path) -> None:
    # A run that only has a summary (metrics.jsonl lost) and one with a malformed metrics line and no recipe.
    only_summary = tmp_path / "only-summary"
    only_summary.mkdir()
    (only_summary / "summary.json").write_text(json.dumps({"steps": 7, "tokens": 700, "train_seconds": 7.0,
                                                           "val/step1/top1": 0.3}))
    no_recipe = tmp_path / "no-recipe"
    no_recipe.mkdir()
    (no_recipe / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0, "tokens": 10}\nnot json\n')
    result = compare.compare_runs([only_summary, no_recipe], tmp_path / "cmp", echo=False)
    a, b = result["runs"]
    assert a["train"]["steps"] == 7 and a["train"]["final_loss"] is None and a["train"]["tokens_per_s"] == 100.0
    assert a["val"]["1"]["top1"] == pytest.approx(0.3)
    assert "no metrics.jsonl" in a["missing"] and "no recipe.resolved.yaml" in a["missing"]
    assert b["train"]["final_loss"] == 3.0
    assert any("1 malformed row(s) skipped (first at line 2)" in note for note in b["missing"])
    assert "no held-out validation numbers" in b["missing"]
    assert result["differing_keys"] == {}
    assert (tmp_path / "cmp" / "compare.md").is_file()


def test_an_eval_output_dir_compares_as_a_report_only_run(two_runs: tuple[Path, Path], tmp_path: Path) -> None:
    # The target–draft baseline: `mtp-train eval --draft ... --out DIR` writes DIR/report.json and nothing else.
    baseline = tmp_path / "eval-draft-0.5b"
    baseline.mkdir()
    report = _report({1: (100, 80, [79], [20]), 3: (100, 70, [69, 69, 69], [20, 8, 3])},
                     lookup={1: (100, 50, [49], [40])}, draft="draft")
    (baseline / "report.json").write_text(json.dumps(report))
    # A report of an older mtp-train (no draft_method): left out with a note saying to run eval again.
    legacy = tmp_path / "legacy-eval"
    legacy.mkdir()
    (legacy / "report.json").write_text(json.dumps({k: v for k, v in report.items()
                                                     if k not in ("draft_method", "best")}))
    result = compare.compare_runs([two_runs[0], baseline, legacy], tmp_path / "cmp", echo=False)
    head, draft, old = result["runs"]
    assert draft["label"] == "eval-draft-0.5b" and draft["missing"] == ["eval report only (no training run)"]
    assert draft["eval"]["draft_method"] == "draft" and draft["eval"]["best"]["method"] == "draft@k=3"
    assert draft["eval"]["by_k"]["3"]["tau"] == pytest.approx(100 / 70, abs=1e-4)
    assert old["eval"] is None and any("report.json: no 'draft_method': written by an older mtp-train; run "
                                       "`mtp-train eval` again" in note for note in old["missing"])
    assert draft["train"]["final_loss"] is None and draft["val"] == {}
    assert result["differing_keys"] == {}  # one recipe only
    assert (tmp_path / "cmp" / "acceptance_by_position.png").stat().st_size > 0


def test_not_a_run_dir_is_a_user_error_naming_it(tmp_path: Path) -> None:
    empty = tmp_path / "not-a-run"
    empty.mkdir()
    (empty / "notes.txt").write_text("hi")
    with pytest.raises(UserError, match="not-a-run: not a run directory"):
        compare.compare_runs([empty], tmp_path / "cmp", echo=False)
    with pytest.raises(UserError, match="missing-dir: run directory not found"):
        compare.compare_runs([tmp_path / "missing-dir"], tmp_path / "cmp", echo=False)


def test_same_recipe_name_gets_distinct_labels(tmp_path: Path) -> None:
    run_a = make_run(tmp_path / "x", "same", ["train.lr=3e-4"], losses=[1.0, 0.9], val_top1=[0.5])
    run_b = make_run(tmp_path / "y", "same", ["train.lr=1e-4"], losses=[1.0, 0.8], val_top1=[0.6])
    result = compare.compare_runs([run_a, run_b], tmp_path / "cmp", echo=False)
    labels = [run["label"] for run in result["runs"]]
    assert len(set(labels)) == 2
    assert set(result["differing_keys"]["train.lr"]) == set(labels)


def test_flatten_indexes_lists_of_mappings() -> None:
    flat = compare.flatten_recipe({"data": {"sources": [{"path": "a"}, {"path": "b"}], "seed": 0},
                                   "eval": {"num_speculative_tokens": [1, 2]}})
    assert flat == {"data.sources.0.path": "a", "data.sources.1.path": "b", "data.sources.length": 2,
                    "data.seed": 0, "eval.num_speculative_tokens": [1, 2]}


def test_cli_subcommand(two_runs: tuple[Path, Path], tmp_path: Path, capsys) -> None:
    from mtp_train.cli import main
    from mtp_train.commands import compare as compare_command

    parser = argparse.ArgumentParser(prog="mtp-train")
    subparsers = parser.add_subparsers(dest="command")
    compare_command.register(subparsers)
    out = tmp_path / "cli-out"
    args = parser.parse_args(["compare", *map(str, two_runs), "--out", str(out)])
    assert args.func(args) == 0
    assert (out / "compare.json").is_file() and (out / "compare.md").is_file()
    assert "eval best speedup" in capsys.readouterr().out
    # Default output directory.
    args = parser.parse_args(["compare", str(two_runs[0])])
    assert args.out == "runs/compare"
    # Through the real entry point: a bad dir exits 2 with a one-line error.
    assert main(["compare", str(tmp_path / "nope"), "--out", str(out)]) == 2
    assert "nope: run directory not found" in capsys.readouterr().err
