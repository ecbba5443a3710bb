"""Evaluation reports: report.json (everything), report.md (tables) and PNG plots."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # runner imports the runtime (torch); `compare` imports this module for its plot helpers
    from mtp_train.evaluate.runner import MethodTotals
    from mtp_train.profile.costs import CostCurve, TreeCost


def build_report(totals: dict[str, dict[str, MethodTotals]], meta: dict[str, Any],
                 cost_curves: dict[str, CostCurve] | None = None,
                 tree_costs: dict[str, TreeCost] | None = None) -> dict[str, Any]:
    """The report: `meta`, each method's numbers overall and per category, the draft's best method, per draft the
    best k by measured speedup (`best_k`); with `cost_curves` ({draft name: its profiled step costs}), each curve
    (`cost_curve`), the speedup it predicts for each "<name>@k=<k>" from the τ measured there (`predicted_speedup`),
    and the best k by that prediction. Tree methods ("<name>@tree=DxKxN[+lookup]") get a `trees` section against
    the draft's chain (`_add_trees`), with `tree_costs` ({shape label: TreeCost}) their verify cost and prediction."""
    plain = totals["plain"]
    categories = sorted(c for c in plain if c != "all")
    report: dict[str, Any] = {**meta, "overall": {}, "per_category": {}}
    for method, by_category in totals.items():
        report["overall"][method] = by_category["all"].summary(plain["all"] if method != "plain" else None)
        for category in categories:
            if category in by_category:
                report["per_category"].setdefault(category, {})[method] = by_category[category].summary(
                    plain.get(category) if method != "plain" else None
                )
    _add_best_k(report, cost_curves or {})
    draft_name = meta.get("draft_method")
    if any("@tree=" in method for method in report["overall"]):
        _add_trees(report, draft_name, tree_costs or {}, cost_curves or {})
    speculative = {m: r for m, r in report["overall"].items() if m != "plain" and
                   (draft_name is None or m.startswith(f"{draft_name}@"))}
    if speculative:
        best = max(speculative, key=lambda m: speculative[m].get("speedup", 0.0))
        report["best"] = {"method": best, **speculative[best]}
    return report


def batch_summary(totals: dict[str, dict[str, MethodTotals]], num_prompts: int, batch_size: int) -> dict[str, Any]:
    """One batch size's numbers: each method's overall summary (speedup against plain decoding at the same batch
    size) and the batch size the calls actually had (fewer prompts than `batch_size` make one smaller batch)."""
    plain = totals["plain"]["all"]
    return {
        "sequences_per_call": min(batch_size, num_prompts),
        "methods": {method: by_category["all"].summary(plain if method != "plain" else None)
                    for method, by_category in totals.items()},
    }


def measured_best_k(speedup_by_k: dict[int, float]) -> int:
    """The k with the largest measured speedup, the smaller k on a tie: the report's `best_k.<draft>.measured`, and
    the k `mtp-train export` writes for serving."""
    return max(sorted(speedup_by_k), key=lambda k: speedup_by_k[k])


def chain_results(overall: dict[str, Any], name: str) -> dict[int, Any]:
    """{k: the overall numbers of "<name>@k=<k>"}."""
    prefix = f"{name}@k="
    return {int(method[len(prefix):]): r for method, r in overall.items()
            if method.startswith(prefix) and method[len(prefix):].isdigit()}


def _add_best_k(report: dict[str, Any], cost_curves: dict[str, CostCurve]) -> None:
    """Into `report`: per draft with chain methods ("<name>@k=<k>") `best_k.<name>.measured` (the largest measured
    speedup); with its cost curve also the curve (`cost_curve`), `predicted_speedup` on each of those methods'
    overall numbers and `best_k.<name>.predicted`."""
    if cost_curves:
        report["cost_curve"] = {name: curve.as_dict() for name, curve in cost_curves.items()}
    best_k = {}
    for name in dict.fromkeys(method.rsplit("@k=", 1)[0] for method in report["overall"] if "@k=" in method):
        by_k = chain_results(report["overall"], name)
        if not by_k:
            continue
        best_k[name] = {}
        curve = cost_curves.get(name)
        if curve is not None:
            for k, r in by_k.items():
                r["predicted_speedup"] = round(curve.predicted_speedup(r["tau"], k), 4)
            best_k[name]["predicted"] = curve.best_k({k: r["tau"] for k, r in by_k.items()})
        best_k[name]["measured"] = measured_best_k({k: r.get("speedup", 0.0) for k, r in by_k.items()})
    if best_k:
        report["best_k"] = best_k


def _add_trees(report: dict[str, Any], draft_name: str | None, tree_costs: dict[str, TreeCost],
               cost_curves: dict[str, CostCurve]) -> None:
    """Into `report`: `trees` ({tree method: shape, τ, mean acceptance length, tokens/s, speedup, τ over the best
    chain τ of the same draft, and with its cost the verify cost per decode step, the mask's cost and the predicted
    speedup}) and `best_tree` (by measured speedup) with the settings engines take for it: SGLang's
    --speculative-num-steps / --speculative-eagle-topk / --speculative-num-draft-tokens (the root counted; SGLang has
    no lookup branch, so a hybrid tree's are for its head part) and the static `speculative_token_tree` (paths of child
    ranks) of its representative tree, the experimental option of earlier vLLM V1 releases (vLLM 0.32.0 has no tree
    option and rejects it: `mtp-train export` writes the chain k for vLLM, see docs/export.md)."""
    # local: the runtime imports torch, and `mtp-train --help` imports this module (through evaluate.compare)
    from mtp_train.runtime.spec.tree import parse_tree_method, representative_tree

    chains = {m: r for m, r in report["overall"].items() if draft_name and m.startswith(f"{draft_name}@k=")}
    best_chain_tau = max((r["tau"] for r in chains.values()), default=0.0)
    curve = cost_curves.get(draft_name) if draft_name else None
    trees = {}
    for method, r in report["overall"].items():
        if "@tree=" not in method:
            continue
        shape, hybrid = parse_tree_method(method.split("@tree=", 1)[1])
        entry = {"depth": shape.depth, "topk": shape.topk, "nodes": shape.nodes, "hybrid": hybrid,
                 **{key: r[key] for key in ("tau", "mean_acceptance_length", "tokens_per_s", "speedup") if key in r}}
        if best_chain_tau:
            entry["tau_over_best_chain"] = round(r["tau"] / best_chain_tau, 4)
        cost = tree_costs.get(shape.label)
        if cost is not None:
            entry.update(cost.as_dict())
            if curve is not None:
                r["predicted_speedup"] = entry["predicted_speedup"] = round(
                    cost.predicted_speedup(r["tau"], shape.depth, curve.draft_step_over_decode), 4)
        trees[method] = entry
    report["trees"] = trees
    if best_chain_tau:
        report["best_chain_tau"] = best_chain_tau
    best = max(trees, key=lambda m: trees[m].get("speedup", 0.0))
    shape, hybrid = parse_tree_method(best.split("@tree=", 1)[1])
    parents, _ = representative_tree(shape)
    paths: list[tuple[int, ...]] = []
    rank_among_siblings: dict[int, int] = {}
    for node, parent in enumerate(parents, start=1):
        rank = rank_among_siblings.get(parent, 0)
        rank_among_siblings[parent] = rank + 1
        paths.append((paths[parent - 1] if parent else ()) + (rank,))
    report["best_tree"] = {
        "method": best, **trees[best],
        "sglang_args": f"--speculative-num-steps {shape.depth} --speculative-eagle-topk {shape.topk} "
                       f"--speculative-num-draft-tokens {shape.nodes + 1}",
        "vllm_speculative_token_tree": str(paths),
    }


def _tree_lines(report: dict[str, Any]) -> list[str]:
    """The "Trees" section: each tree beside the draft's best chain."""
    lines = ["", "## Trees", "",
             (f"Tree drafting (depth × topk × nodes; +lookup: the prompt-lookup branch beside the head's). τ over "
              f"the best chain τ of the same head ({report.get('best_chain_tau', 0):.3f}); verify/decode: one target "
              "forward over the N + 1 tree tokens with the tree mask ÷ one decode step, beside a causal verify of "
              "the same size (mask cost = their ratio); predicted: τ / (verify/decode + depth · draft step/decode)."),
             ""]
    lines.append(_row(["method", "τ", "τ / best chain τ", "mean acceptance length", "verify/decode",
                       "causal verify/decode", "mask cost", "tokens/s", "speedup", "predicted"]))
    lines.append(_row(["---"] * 10))
    for method, t in report["trees"].items():
        lines.append(_row([method, f"{t['tau']:.3f}", _optional(t, "tau_over_best_chain", "{:.2f}×"),
                           _optional(t, "mean_acceptance_length", "{:.3f}"),
                           _optional(t, "verify_over_decode", "{:.2f}"),
                           _optional(t, "causal_verify_over_decode", "{:.2f}"), _optional(t, "mask_cost", "{:.2f}×"),
                           _optional(t, "tokens_per_s", "{:.1f}"), _optional(t, "speedup", "{:.2f}×"),
                           _optional(t, "predicted_speedup", "{:.2f}×")]))
    best = report.get("best_tree")
    if best:
        lines += ["", f"Best tree by measured speedup: {best['method']}. SGLang: `{best['sglang_args']}`; static tree "
                  f"(earlier vLLM V1 releases; vLLM 0.32.0 has no tree option): "
                  f"`speculative_token_tree: {best['vllm_speculative_token_tree']}`."]
    return lines


def _row(cells: list[Any]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _optional(r: dict[str, Any], key: str, form: str) -> str:
    return form.format(r[key]) if key in r else ""


def _match_cell(r: dict[str, Any]) -> str:
    if "greedy_match" not in r:
        return ""
    if r["greedy_match"]:
        return "yes"
    cell = f"no ({r['matched_turns']}/{r['turns']} turns identical"
    if "max_divergence_logit_gap" in r:
        cell += f"; at the first difference the target's logits differ by ≤ {r['max_divergence_logit_gap']:.3g}"
    if r.get("context_diverged_turns"):
        cell += f"; {r['context_diverged_turns']} later turn(s) not comparable: an earlier turn had parted"
    return cell + ")"


def _cost_curve_lines(report: dict[str, Any]) -> list[str]:
    """The "Cost curve" section: each draft's step costs and the best k they predict beside the measured best."""
    curves = report["cost_curve"]
    first = next(iter(curves.values()))
    lines = ["", "## Cost curve", "",
             (f"Step costs at batch 1 after the first prompt ({first['prompt_tokens']} tokens), measured before and "
              "after the runs with the same loaded models and averaged (each verify's ratio to the decode step taken "
              "within each of 5 interleaved rounds, the median). Predicted speedup at k = τ(k) / "
              "(verify(k+1)/decode + drafting(k)/decode), drafting(k) = k draft steps, or a head's greedy chain "
              "of k drafts in one kernel call timed whole (chain(k) below)."), ""]
    ns = list(first["verify_over_decode"])
    lines.append(_row(["draft", "decode ms", *[f"verify({n})/decode" for n in ns], "draft step/decode",
                       "chain(k)/decode", "best k: predicted", "best k: measured"]))
    lines.append(_row(["---"] * (len(ns) + 6)))
    for name, curve in curves.items():
        best = report.get("best_k", {}).get(name, {})
        cells = []
        for key in ("predicted", "measured"):
            k = best.get(key)
            r = report["overall"].get(f"{name}@k={k}", {})
            cells.append("" if k is None else f"{k} (predicted {r.get('predicted_speedup', 0):.2f}×, measured "
                         f"{r.get('speedup', 0):.2f}×)")
        chain = ", ".join(f"{k}: {r:.3f}" for k, r in curve.get("chain_over_decode", {}).items())
        lines.append(_row([name, f"{curve['decode_ms']:.2f}", *[f"{curve['verify_over_decode'][n]:.2f}" for n in ns],
                           f"{curve['draft_step_over_decode']:.3f}", chain, *cells]))
    return lines


def _batch_size_lines(report: dict[str, Any]) -> list[str]:
    """The "By batch size" section: per batch size and method, τ, mean acceptance length, tokens/s and speedup."""
    by_batch = report["by_batch_size"]
    methods = list(next(iter(by_batch.values()))["methods"])
    lines = ["", "## By batch size", "",
             ("Prompts answered B at a time: each turn of B conversations is one call of the engine (finished "
              "sequences leave the batch). tokens/s is the throughput of the batch; speedup is against plain "
              "decoding at the same batch size. Cells: τ / mean acceptance length / tokens/s / speedup."), ""]
    lines.append(_row(["method", *[f"batch {b} ({entry['sequences_per_call']} per call)"
                                   for b, entry in by_batch.items()]]))
    lines.append(_row(["---"] * (len(by_batch) + 1)))
    for method in methods:
        cells = []
        for entry in by_batch.values():
            r = entry["methods"].get(method)
            cells.append("" if r is None else
                         f"{r['tau']:.3f} / {r.get('mean_acceptance_length', 1.0):.3f} / {r['tokens_per_s']:.1f} / "
                         f"{r.get('speedup', 1.0):.2f}×" + ("" if r.get("greedy_match", True) else " (output differs)"))
        lines.append(_row([method, *cells]))
    return lines


def write_markdown(report: dict[str, Any], path: Path) -> None:
    lines = [f"# Speculative decoding evaluation: {report.get('name', '')}", ""]
    lines.append(f"- target: `{report['target']}`")
    lines.append(f"- draft: `{report['draft']}` ({report['draft_kind']})")
    lines.append(f"- prompts: {report['prompts']} ({report['num_prompts']} used, {len(report['skipped'])} skipped)")
    lines.append(f"- settings: {report['settings']}")
    lines.append("- greedy match: speculative output identical to plain greedy decoding. The CPU decode kernels compute "
                 "every row in the same order whatever the row count, so there a verify forward (k+1 rows) gives the "
                 "logits of k+1 decode steps bit for bit; on torch's bf16 ops (or a GPU) the two can round "
                 "differently, a near-tie can flip and the texts part: the logit gap at the first difference shows "
                 "whether it was a tie.")
    lines += ["", "## Overall", ""]
    lines.append(_row(["method", "τ (tokens/target fwd)", "mean acceptance length (tokens/verify)", "α",
                       "acceptance by position", "tokens/s", "speedup (totals)", "predicted (cost curve)",
                       "speedup per prompt: median [p25, p75]", "greedy match"]))
    lines.append(_row(["---"] * 10))
    for method, r in report["overall"].items():
        lines.append(_row([
            method, f"{r['tau']:.3f}", _optional(r, "mean_acceptance_length", "{:.3f}"),
            _optional(r, "alpha", "{:.3f}"), ", ".join(f"{a:.2f}" for a in r.get("acceptance_per_position", [])),
            f"{r['tokens_per_s']:.1f}", f"{r['speedup']:.2f}×" if "speedup" in r else "1.00×",
            _optional(r, "predicted_speedup", "{:.2f}×"),
            f"{r['speedup_median']:.2f}× [{r['speedup_p25']:.2f}, {r['speedup_p75']:.2f}]" if "speedup_median" in r
            else "", _match_cell(r),
        ]))
    if report.get("best_k"):
        bests = []
        for name, best in report["best_k"].items():
            k = best["measured"]
            bests.append(f"{name} k = {k} ({report['overall'][f'{name}@k={k}'].get('speedup', 0.0):.2f}×)")
        lines += ["", "Best k by measured speedup: " + "; ".join(bests) + "."]
    if report.get("trees"):
        lines += _tree_lines(report)
    if report.get("cost_curve"):
        lines += _cost_curve_lines(report)
    if len(report.get("by_batch_size", {})) > 1:
        lines += _batch_size_lines(report)
    if report["per_category"]:
        lines += ["", "## Per category (τ / speedup)", ""]
        methods = list(report["overall"])
        lines.append(_row(["category", *methods]))
        lines.append(_row(["---"] * (len(methods) + 1)))
        for category, by_method in report["per_category"].items():
            cells = []
            for m in methods:
                r = by_method.get(m)
                cells.append("" if r is None else f"{r['tau']:.2f} / {r.get('speedup', 1.0):.2f}×")
            lines.append(_row([category, *cells]))
    if report["skipped"]:
        lines += ["", "## Skipped prompts", ""] + [f"- {s}" for s in report["skipped"][:50]]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def label_axes(axis, xlabel: str, ylabel: str, title: str, ylim: tuple[float, float] | None = None,
               legend: bool = True) -> None:
    """Labels, title, a light grid and (unless `legend` is False) a small legend: the look every plot here shares."""
    axis.set_xlabel(xlabel)
    axis.set_ylabel(ylabel)
    if ylim is not None:
        axis.set_ylim(*ylim)
    axis.set_title(title)
    axis.grid(alpha=0.3)
    if legend:
        axis.legend(fontsize=8)


def save_figure(fig, path: Path, dpi: int) -> Path:
    import matplotlib.pyplot as plt  # local: matplotlib is slow to import and only the plots need it

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def write_plots(report: dict[str, Any], out_dir: Path) -> list[Path]:
    import matplotlib  # local, with the next one: matplotlib is slow to import and only the plots need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    speculative = {m: r for m, r in report["overall"].items() if "acceptance_per_position" in r}
    if speculative:
        fig, ax = plt.subplots(figsize=(6, 4))
        for method, r in speculative.items():
            rates = r["acceptance_per_position"]
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=method)
        label_axes(ax, "draft position", "acceptance rate (unconditional)", "Acceptance by position", ylim=(0, 1),
                   legend=False)
        ax.legend()
        paths.append(save_figure(fig, out_dir / "acceptance_by_position.png", dpi=120))
    by_batch = report.get("by_batch_size", {})
    if len(by_batch) > 1:
        fig, ax = plt.subplots(figsize=(6, 4))
        sizes = [int(b) for b in by_batch]
        for method in next(iter(by_batch.values()))["methods"]:
            if method == "plain":
                continue
            ax.plot(sizes, [by_batch[str(b)]["methods"][method].get("speedup", 0.0) for b in sizes], marker="o",
                    label=method)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(b) for b in sizes])
        label_axes(ax, "batch size (sequences decoded together)", "speedup over plain decoding at that batch size",
                   "Speculation's speedup against batch size")
        paths.append(save_figure(fig, out_dir / "speedup_by_batch_size.png", dpi=120))
    categories = list(report["per_category"]) or ["all"]
    methods = list(report["overall"])
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(categories) + 2), 4))
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        values = [
            (report["per_category"].get(c, {}).get(method) or report["overall"][method] if c == "all" else
             report["per_category"][c].get(method, {"tau": 0}))["tau"]
            for c in categories
        ]
        ax.bar([j + i * width for j in range(len(categories))], values, width, label=method)
    ax.set_xticks([j + width * (len(methods) - 1) / 2 for j in range(len(categories))], categories, rotation=30,
                  ha="right")
    ax.set_ylabel("τ (tokens per target forward)")
    ax.set_title("τ by category")
    ax.legend(fontsize=8)
    paths.append(save_figure(fig, out_dir / "tau_by_category.png", dpi=120))
    return paths
