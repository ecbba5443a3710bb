"""One evaluation: plain decoding, a draft (head or model) and the prompt-lookup baseline at each k, over the same
prompts with the same settings, and the measured speedup of each; when asked (`eval.cost_curve`), each draft's cost
curve from the profile layer (decode, verify and draft step times on the same loaded models) and the speedup it
predicts per k; report.json, report.md, plots, and the results logged into the training run. The draft arrives
loaded (`mtp-train eval` loads any head format through `export.load_any_head`)."""

from __future__ import annotations

import json
from pathlib import Path

from mtp_train.errors import UserError
from mtp_train.evaluate.prompts import load_heldout, load_mt_bench
from mtp_train.evaluate.report import batch_summary, build_report, write_markdown, write_plots
from mtp_train.evaluate.runner import first_turn_ids, run_methods
from mtp_train.fileio import write_json_atomic
from mtp_train.profile.costs import CostCurve, measure_cost_curves, measure_tree_costs
from mtp_train.runtime.chat import stop_token_ids
from mtp_train.runtime.hardware import machine_name
from mtp_train.runtime.model import CausalLM
from mtp_train.runtime.sampler import SamplingParams
from mtp_train.runtime.spec import DraftTree, HybridDraft, PromptLookup
from mtp_train.runtime.spec.tree import parse_tree_method
from mtp_train.train.tracking import Tracker, read_metric_rows


def evaluate(recipe, target, tokenizer, precision, draft, draft_method: str, draft_kind: str, draft_path: str,
             prompts_path, limit, ks, max_new_tokens, out_dir: Path, log_run_dir: Path | None = None,
             show_progress: bool = True, prompt_lookup: bool = True, cost_curve: bool = False,
             batch_sizes: tuple[int, ...] = (1,), trees: tuple[str, ...] = (), hybrid: bool = True) -> dict:
    """Plain decoding, `draft` (reported as `draft_method`@k), if `prompt_lookup` the n-gram baseline and, for a head
    with `hybrid`, the hybrid of the two (`runtime/spec/hybrid.py`: the head's chain or the context's copy), at each
    k and each of `batch_sizes`: the first batch size gives the report's main tables ("overall", per category),
    every one its entry in "by_batch_size" and a point of the speedup-against-batch-size plot. `target` is loaded
    with `precision`; the draft computes like it. The report's speedups are measured: tokens/s against plain
    decoding's on the same prompts. Only with `cost_curve` (the recipe's `eval.cost_curve`) does the eval also profile
    each draft's step costs (`profile.costs.measure_cost_curves`, a few seconds each) on the first prompt at batch 1,
    before and after the runs, averaged (a shared machine's state moves within a run: docs/benchmarks.md), and the
    report gives the speedup they predict beside the measured one.

    `trees`: tree drafting with the head beside its chain, one method per 'DEPTHxTOPKxNODES' (a hybrid tree with the
    prompt-lookup branch: 'DEPTHxTOPKxNODES+lookup'), reported as "<draft_method>@tree=..."; with `cost_curve` each
    tree's verify forward (tree mask) is timed beside a causal verify of the same size."""
    if prompts_path:
        prompt_set = load_mt_bench(prompts_path, limit)
    else:
        prompt_set = load_heldout(recipe.prepared_dir, limit)
    sampling = SamplingParams(temperature=recipe.eval.temperature)
    drafts = {draft_method: draft, **({"lookup": PromptLookup()} if prompt_lookup else {}),
              **({"hybrid": HybridDraft(draft)} if hybrid and not isinstance(draft, CausalLM) else {})}
    tree_drafts = _tree_drafts(draft, draft_method, trees)
    stops = stop_token_ids(tokenizer, target.config)
    curve_prompt = first_turn_ids(tokenizer, prompt_set.prompts[0])
    curves_before = measure_cost_curves(target, drafts, curve_prompt, ks) if cost_curve else None
    totals_by_batch = {
        batch_size: run_methods(target, tokenizer, prompt_set.prompts, drafts, ks, max_new_tokens, sampling, stops,
                                show_progress=show_progress, batch_size=batch_size, trees=tree_drafts)
        for batch_size in batch_sizes
    }
    totals = totals_by_batch[batch_sizes[0]]
    curves, tree_costs = None, None
    if cost_curve:  # the same loaded target and drafts, so the same decode path the runs took
        curves_after = measure_cost_curves(target, drafts, curve_prompt, ks)
        curves = {name: CostCurve.averaged([curves_before[name], curves_after[name]]) for name in curves_after}
        if tree_drafts:
            shapes = list({tree.shape.label: tree.shape for tree in tree_drafts.values()}.values())
            tree_costs = measure_tree_costs(target, curve_prompt, shapes, curves_after[draft_method].decode_s)
        if show_progress:
            print(f"eval: cost curves of {', '.join(curves)} measured before and after the runs "
                  f"({sum(curve.measure_s for curve in curves.values()):.1f} s in all)", flush=True)
    meta = {
        "name": recipe.name, "target": str(recipe.target.path), "draft": str(draft_path), "draft_kind": draft_kind,
        "draft_method": draft_method,
        "prompts": prompt_set.source, "num_prompts": len(prompt_set.prompts), "skipped": prompt_set.skipped,
        "settings": {"dtype": precision.dtype, "decode_dtype": precision.decode_dtype,
                     "decode_max_rows": precision.decode_max_rows, "precision_reason": precision.reason,
                     "kv_cache_dtype": precision.kv_cache_dtype or precision.dtype,
                     "head_decode_weights": getattr(draft, "decode_weights", None),
                     "cpu_capability": machine_name(target.device), "batch_size": batch_sizes[0],
                     "batch_sizes": list(batch_sizes),
                     "max_new_tokens": max_new_tokens, "temperature": recipe.eval.temperature,
                     "num_speculative_tokens": ks, "trees": list(tree_drafts)},
    }
    report = build_report(totals, meta, curves, tree_costs)
    report["by_batch_size"] = {
        str(batch_size): batch_summary(by_method, len(prompt_set.prompts), batch_size)
        for batch_size, by_method in totals_by_batch.items()
    }
    report["out_dir"] = str(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out_dir / "report.json", report)
        write_markdown(report, out_dir / "report.md")
        plots = write_plots(report, out_dir)
    except OSError as err:  # a full disk: name the report's directory where the writer (matplotlib) named no file
        err.filename = err.filename or str(out_dir)
        raise
    if log_run_dir is not None and log_run_dir.is_dir():
        _log_to_run(recipe, log_run_dir, report, plots)
    return report


def _tree_drafts(draft, draft_method: str, trees: tuple[str, ...]) -> dict[str, object]:
    """{method name: DraftTree} for the tree specs (a head only: trees are drafted by a head's top-k)."""
    if trees and isinstance(draft, CausalLM):
        raise UserError("--tree drafts with a head (--head); a draft model (--draft) drafts chains only")
    out = {}
    for spec in trees:
        shape, hybrid = parse_tree_method(spec)
        tree = DraftTree(draft, shape, PromptLookup() if hybrid else None)
        out[f"{draft_method}@{tree.label}"] = tree
    return out


def _log_to_run(recipe, run_dir: Path, report: dict, plots: list[Path]) -> None:
    """Append the eval results to the run's metrics.jsonl (and its W&B run, resumed by id, when enabled)."""
    metrics_path = run_dir / "metrics.jsonl"
    rows = read_metric_rows(metrics_path)
    row = {"step": rows[-1]["step"] if rows else 0}
    for method, r in report["overall"].items():
        for key in ("tau", "mean_acceptance_length", "alpha", "tokens_per_s", "speedup", "speedup_median",
                    "predicted_speedup"):
            if key in r:
                row[f"eval/{method}/{key}"] = r[key]
    with metrics_path.open("a") as stream:
        stream.write(json.dumps(row) + "\n")
    if recipe.tracking.wandb.mode != "disabled" and (run_dir / "wandb_run_id").is_file():
        tracker = Tracker(run_dir, recipe, enabled=True, resume=True)
        if tracker.wandb_run is not None:
            tracker.wandb_run.log({k: v for k, v in row.items() if k != "step"})
            tracker.log_files(plots)
            tracker.wandb_run.finish()
