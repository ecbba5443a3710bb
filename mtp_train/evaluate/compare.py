"""`mtp-train compare RUN_DIR... [--out DIR]`: compare training runs side by side.

For each run dir (a `train.run_dir`: `recipe.resolved.yaml`, `metrics.jsonl`, `summary.json`, optionally
`eval/report.json` from `mtp-train eval`; or an `mtp-train eval --out DIR` directory holding only `report.json`,
e.g. a target–draft baseline) it collects: the recipe keys that differ between the runs (dotted keys;
output locations and the name are ignored), the final train loss, training tokens/s, the held-out accuracy per unroll
step (`val/step{k}/top1`, from summary.json or else the last validation row of metrics.jsonl), and from the eval
report τ, the mean acceptance length and α at each k and the best speedup of the evaluated draft (`draft_method`;
ratio of totals, and median [p25, p75] of the per-prompt ratios), with baselines run beside it (the prompt-lookup
proposer) kept apart. A missing piece is reported per run, never fatal; a directory that
holds none of these files is not a run and is an error.

Writes `<out>/compare.md`, `<out>/compare.json` and PNG plots (`loss_curves.png`, `val_top1_by_step.png`,
`acceptance_by_position.png`), and prints the table. Runs logged to W&B with the same `tracking.wandb.group` can
also be compared in the W&B UI (offline runs: `wandb sync runs/<name>/wandb/offline-run-*`).
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mtp_train.errors import UserError
from mtp_train.evaluate.report import label_axes, save_figure
from mtp_train.fileio import atomic_write_text, read_json_object, write_json_atomic
from mtp_train.recipe import flatten_recipe

DEFAULT_OUT = "runs/compare"
RUN_FILES = ("recipe.resolved.yaml", "metrics.jsonl", "summary.json", "eval/report.json")
# Keys that name where outputs go (or the run itself): they always differ and say nothing about the experiment.
IGNORED_KEYS = frozenset(
    {"name", "train.run_dir", "data.output_dir", "precompute.output_dir", "tracking.wandb.run_name"}
)
VAL_METRICS = ("top1", "top3", "alpha", "kl", "feature")
_METHOD = re.compile(r"^(?P<name>.+)@k=(?P<k>\d+)$")
_VAL_KEY = re.compile(r"^val/step(?P<k>\d+)/(?P<metric>[a-z0-9]+)$")
_ABSENT = "<absent>"
BASELINE_METHODS = frozenset({"lookup"})  # model-free proposers `mtp-train eval` runs beside the draft
EVAL_KEYS = ("tau", "mean_acceptance_length", "alpha", "speedup", "speedup_median", "speedup_p25", "speedup_p75",
             "predicted_speedup")  # predicted_speedup: from the eval's cost curve (None without eval.cost_curve)


# ---------------------------------------------------------------------------------------------------------------
# reading one run
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Run:
    path: Path
    label: str = ""
    recipe: dict[str, Any] | None = None
    metrics: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] | None = None
    report: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)  # missing or unreadable pieces


def _read_json(path: Path, run: Run) -> dict[str, Any] | None:
    """The JSON object at `path`, or None with a note on `run` (a missing or unreadable piece is never fatal)."""
    if not path.is_file():
        run.notes.append(f"no {path.relative_to(run.path).as_posix()}")
        return None
    try:
        return read_json_object(path)
    except UserError as err:
        run.notes.append(str(err))
        return None


def _read_report(path: Path, run: Run) -> dict[str, Any] | None:
    """The eval report at `path`, or None with a note: unreadable, no 'overall' section, or no 'draft_method' (a
    report of an older mtp-train, not guessed from its method names)."""
    report = _read_json(path, run)
    if report is not None and not isinstance(report.get("overall"), dict):
        run.notes.append(f"{path.relative_to(run.path).as_posix()}: no 'overall' section")
        return None
    if report is not None and "draft_method" not in report:
        run.notes.append(f"{path.relative_to(run.path).as_posix()}: no 'draft_method': written by an older "
                         "mtp-train; run `mtp-train eval` again to compare it")
        return None
    return report


def load_run(path: str | Path) -> Run:
    """Read what a run dir holds. UserError when `path` is not a directory or holds none of the run files."""
    run_path = Path(path)
    if not run_path.is_dir():
        raise UserError(f"{run_path}: run directory not found")
    if not any((run_path / name).is_file() for name in RUN_FILES):
        if (run_path / "report.json").is_file():  # an `mtp-train eval --out DIR` directory on its own (e.g. the
            run = Run(path=run_path, label=run_path.resolve().name)  # target–draft baseline): no recipe, no metrics
            run.report = _read_report(run_path / "report.json", run)
            run.notes.append("eval report only (no training run)")
            return run
        raise UserError(
            f"{run_path}: not a run directory (none of {', '.join(RUN_FILES)} found; expected the train.run_dir "
            "of a `mtp-train train` run, e.g. runs/<name>, or an `mtp-train eval --out` directory with report.json)"
        )
    run = Run(path=run_path)

    recipe_path = run_path / "recipe.resolved.yaml"
    if recipe_path.is_file():
        try:
            recipe = yaml.safe_load(recipe_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
            run.notes.append(f"recipe.resolved.yaml: unreadable ({str(err).splitlines()[0]})")
        else:
            if isinstance(recipe, dict):
                run.recipe = recipe
            else:
                run.notes.append("recipe.resolved.yaml: expected a mapping")
    else:
        run.notes.append("no recipe.resolved.yaml")

    metrics_path = run_path / "metrics.jsonl"
    if metrics_path.is_file():
        bad: list[int] = []
        for number, line in enumerate(metrics_path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                bad.append(number)
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), (int, float)):
                run.metrics.append(row)
            else:
                bad.append(number)
        if bad:
            run.notes.append(f"metrics.jsonl: {len(bad)} malformed row(s) skipped (first at line {bad[0]})")
        if not run.metrics:
            run.notes.append("metrics.jsonl: no rows")
    else:
        run.notes.append("no metrics.jsonl")

    run.summary = _read_json(run_path / "summary.json", run)
    run.report = _read_report(run_path / "eval" / "report.json", run)

    # Label: the run dir's name (= the recipe name for the default runs/<name>; distinct for --set train.run_dir=...).
    run.label = run_path.resolve().name
    return run


def _unique_labels(runs: list[Run]) -> None:
    seen = Counter(run.label for run in runs)
    for run in runs:
        if seen[run.label] > 1:
            run.label = f"{run.label} ({run.path})"


# ---------------------------------------------------------------------------------------------------------------
# extracting numbers
# ---------------------------------------------------------------------------------------------------------------


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(float(value)) else None


def differing_keys(runs: list[Run]) -> dict[str, dict[str, Any]]:
    """{dotted key: {run label: value}} for the keys whose values are not all equal across the runs with a recipe
    (runs without a recipe are left out; a key one recipe lacks shows as '<absent>')."""
    flat = {run.label: flatten_recipe(run.recipe) for run in runs if run.recipe is not None}
    if len(flat) < 2:
        return {}
    keys = sorted(set().union(*(set(values) for values in flat.values())) - IGNORED_KEYS)
    result: dict[str, dict[str, Any]] = {}
    for key in keys:
        values = {label: values.get(key, _ABSENT) for label, values in flat.items()}
        distinct = {json.dumps(v, sort_keys=True, default=str) for v in values.values()}
        if len(distinct) > 1:
            result[key] = values
    return result


def _train_rows(run: Run) -> list[dict[str, Any]]:
    return [row for row in run.metrics if _number(row.get("loss")) is not None]


def _val_by_step(values: dict[str, Any]) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for key, value in values.items():
        match = _VAL_KEY.match(str(key))
        number = _number(value)
        if match and match["metric"] in VAL_METRICS and number is not None:
            out.setdefault(int(match["k"]), {})[match["metric"]] = number
    return dict(sorted(out.items()))


def _eval_numbers(result: dict[str, Any]) -> dict[str, Any]:
    """One method's numbers in an eval report (None where the report has none, e.g. predicted_speedup)."""
    numbers = {key: _number(result.get(key)) for key in EVAL_KEYS}
    return {**numbers, "acceptance_per_position": list(result.get("acceptance_per_position") or [])}


def run_numbers(run: Run) -> dict[str, Any]:
    """The numbers compare reports for one run (None where the run lacks them)."""
    train_rows = _train_rows(run)
    last = train_rows[-1] if train_rows else {}
    summary = run.summary or {}
    tokens = _number(summary.get("tokens"))
    if tokens is None and train_rows:
        per_step = [_number(row.get("tokens")) for row in train_rows]
        tokens = sum(v for v in per_step if v is not None) or None
    tokens_per_s = _number(last.get("tokens_per_s"))
    if tokens_per_s is None and tokens and _number(summary.get("train_seconds")):
        tokens_per_s = tokens / float(summary["train_seconds"])
    train = {
        "steps": int(last["step"]) if last else (int(summary["steps"]) if _number(summary.get("steps")) else None),
        "final_loss": _number(last.get("loss")),
        "tokens": int(tokens) if tokens is not None else None,
        "tokens_per_s": tokens_per_s,
        "final_train_top1": {k: v["top1"] for k, v in _val_by_step(
            {key.replace("train/", "val/", 1): value for key, value in last.items() if key.startswith("train/")}
        ).items() if "top1" in v},
    }

    val_source, val = None, _val_by_step(summary)
    if val:
        val_source = "summary.json"
    else:
        rows = [row for row in run.metrics if any(_VAL_KEY.match(str(key)) for key in row)]
        if rows:
            val = _val_by_step(rows[-1])
            val_source = f"metrics.jsonl step {rows[-1]['step']}"
    if not val and (run.metrics or run.summary is not None):
        run.notes.append("no held-out validation numbers")

    evaluation = None
    if run.report is not None:
        overall = run.report["overall"]
        by_name: dict[str, dict[int, dict[str, Any]]] = {}  # method name (before "@k=") -> k -> numbers
        for method, result in overall.items():
            match = _METHOD.match(str(method))
            if not match or not isinstance(result, dict):
                continue
            by_name.setdefault(match["name"], {})[int(match["k"])] = {
                "method": method, **_eval_numbers(result), "tokens_per_s": _number(result.get("tokens_per_s")),
                "greedy_match": result.get("greedy_match"),
            }
        # The evaluated draft (head or draft model) vs baselines run beside it (the prompt-lookup proposer).
        draft_name = run.report.get("draft_method")
        if draft_name not in by_name:
            candidates = [name for name in by_name if name not in BASELINE_METHODS] or list(by_name)
            draft_name = candidates[0] if candidates else None
        by_k = by_name.get(draft_name, {}) if draft_name else {}
        baselines = {name: dict(sorted(ks.items())) for name, ks in by_name.items() if name != draft_name}
        best = run.report.get("best")
        if not (isinstance(best, dict) and str(best.get("method", "")).startswith(f"{draft_name}@")):
            best = max(by_k.values(), key=lambda e: e["speedup"] or 0.0) if by_k else None
        best_out = None
        if isinstance(best, dict):
            best_out = {"method": best.get("method"), **_eval_numbers(best)}
        plain = overall.get("plain") if isinstance(overall.get("plain"), dict) else {}
        evaluation = {
            "prompts": run.report.get("prompts"), "num_prompts": run.report.get("num_prompts"),
            "draft_method": draft_name, "plain_tokens_per_s": _number(plain.get("tokens_per_s")),
            "by_k": dict(sorted(by_k.items())), "best": best_out, "baselines": baselines,
        }
    return {"train": train, "val": val, "val_source": val_source, "eval": evaluation}


# ---------------------------------------------------------------------------------------------------------------
# table, files
# ---------------------------------------------------------------------------------------------------------------


def _fmt(value: Any, kind: str = "") -> str:
    if value is None:
        return "—"
    if kind == "int":
        return f"{int(value):,}"
    if kind == "rate":
        return f"{value:,.0f}"
    if kind == "x":
        return f"{value:.2f}×"
    if kind == "acc":
        return f"{value:.4f}"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


def build_table(runs: list[Run], numbers: list[dict[str, Any]], diffs: dict[str, dict[str, Any]]
                ) -> tuple[list[str], list[list[str]]]:
    """Rows of (what, one cell per run)."""
    header = ["", *[run.label for run in runs]]
    rows: list[list[str]] = [["run dir", *[str(run.path) for run in runs]]]
    for key, values in diffs.items():
        rows.append([f"recipe: {key}", *[_fmt(values.get(run.label, "?")) for run in runs]])
    rows.append(["steps", *[_fmt(n["train"]["steps"], "int") for n in numbers]])
    rows.append(["final train loss", *[_fmt(n["train"]["final_loss"], "acc") for n in numbers]])
    rows.append(["train tokens", *[_fmt(n["train"]["tokens"], "int") for n in numbers]])
    rows.append(["train tokens/s", *[_fmt(n["train"]["tokens_per_s"], "rate") for n in numbers]])
    val_ks = sorted({k for n in numbers for k in n["val"]})
    for k in val_ks:
        rows.append([f"held-out top-1 step {k}", *[_fmt(n["val"].get(k, {}).get("top1"), "acc") for n in numbers]])
    for k in val_ks:
        rows.append([f"held-out α step {k}", *[_fmt(n["val"].get(k, {}).get("alpha"), "acc") for n in numbers]])
    eval_ks = sorted({k for n in numbers if n["eval"] for k in n["eval"]["by_k"]})
    for key, label in (("tau", "τ"), ("mean_acceptance_length", "mean acceptance length"), ("alpha", "α")):
        for k in eval_ks:
            rows.append([f"eval {label} @k={k}", *[_fmt(n["eval"]["by_k"].get(k, {}).get(key) if n["eval"] else None,
                                                        "acc") for n in numbers]])
    best = [n["eval"]["best"] if n["eval"] and n["eval"]["best"] else {} for n in numbers]
    rows.append(["eval best method", *[_fmt(b.get("method")) for b in best]])
    rows.append(["eval best speedup", *[_fmt(b.get("speedup"), "x") for b in best]])
    rows.append(["eval best speedup per prompt: median [p25, p75]", *[
        f"{_fmt(b['speedup_median'], 'x')} [{_fmt(b['speedup_p25'], 'x')}, {_fmt(b['speedup_p75'], 'x')}]"
        if b.get("speedup_median") is not None else "—" for b in best]])
    baseline_names = sorted({name for n in numbers if n["eval"] for name in n["eval"]["baselines"]})
    for name in baseline_names:
        cells = []
        for n in numbers:
            ks = (n["eval"] or {}).get("baselines", {}).get(name) or {}
            top = max(ks.values(), key=lambda e: e["speedup"] or 0.0) if ks else None
            cells.append(f"{_fmt(top['speedup'], 'x')} ({top['method']}, τ {_fmt(top['tau'], 'acc')})" if top else "—")
        rows.append([f"baseline {name}: best speedup", *cells])
    rows.append(["eval plain tokens/s", *[_fmt(n["eval"]["plain_tokens_per_s"] if n["eval"] else None, "rate")
                                          for n in numbers]])
    rows.append(["missing", *["; ".join(run.notes) or "—" for run in runs]])
    return header, rows


def format_text_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(line[i]) for line in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(header, widths)).rstrip()]
    lines.append("  ".join("-" * width for width in widths))
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|")


def format_markdown(runs: list[Run], header: list[str], rows: list[list[str]], diffs: dict[str, Any],
                    plots: list[Path], out_dir: Path) -> str:
    lines = ["# Run comparison", ""]
    lines.append(f"Runs: {', '.join(f'`{run.path}`' for run in runs)}.")
    lines.append("")
    if len([run for run in runs if run.recipe is not None]) >= 2:
        lines.append(f"{len(diffs)} recipe key(s) differ (output locations and names ignored)." if diffs
                     else "The recipes are identical (output locations and names ignored).")
    else:
        lines.append("Fewer than two runs have a recipe.resolved.yaml: no recipe differences computed.")
    lines += ["", "| " + " | ".join(_md_cell(c) for c in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows]
    groups = {}
    for run in runs:
        wandb = ((run.recipe or {}).get("tracking") or {}).get("wandb") or {}
        if wandb.get("mode") not in (None, "disabled"):
            groups.setdefault((wandb.get("project"), wandb.get("group")), []).append(run.label)
    if groups:
        lines += ["", "## W&B", ""]
        for (project, group), labels in groups.items():
            where = f"project `{project}`" + (f", group `{group}`" if group else " (no group set)")
            lines.append(f"- {where}: {', '.join(labels)}")
        lines.append("")
        lines.append("Offline runs: `wandb sync <run_dir>/wandb/offline-run-*`, then filter by group in the UI.")
    if plots:
        lines += ["", "## Plots", ""]
        lines += [f"![{p.stem}]({p.relative_to(out_dir).as_posix()})" for p in plots]
    return "\n".join(lines) + "\n"


def _plain(value: Any) -> Any:
    """JSON-safe: NaN/inf -> None, int keys -> str."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# ---------------------------------------------------------------------------------------------------------------
# plots
# ---------------------------------------------------------------------------------------------------------------


def write_plots(runs: list[Run], numbers: list[dict[str, Any]], out_dir: Path) -> tuple[list[Path], list[str]]:
    """Returns (PNG paths written, notes about plots skipped)."""
    import matplotlib  # local, with the next two: matplotlib is slow to import and only the plots need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    paths: list[Path] = []
    skipped: list[str] = []

    # 1. Loss curves and held-out step-1 top-1 against the optimizer step.
    if any(_train_rows(run) for run in runs):
        fig, (ax_loss, ax_val) = plt.subplots(1, 2, figsize=(11, 4))
        any_val = False
        for run in runs:
            rows = _train_rows(run)
            if rows:
                ax_loss.plot([r["step"] for r in rows], [r["loss"] for r in rows], label=run.label, linewidth=1.2)
            val = [(r["step"], _number(r.get("val/step1/top1"))) for r in run.metrics]
            val = [(s, v) for s, v in val if v is not None]
            if val:
                any_val = True
                ax_val.plot(*zip(*val), marker="o", label=run.label)
        label_axes(ax_loss, "optimizer step", "train loss", "Train loss")
        label_axes(ax_val, "optimizer step", "top-1 vs target argmax", "Held-out step-1 top-1", legend=any_val)
        if not any_val:
            ax_val.text(0.5, 0.5, "no validation rows", ha="center", va="center", transform=ax_val.transAxes)
        paths.append(save_figure(fig, out_dir / "loss_curves.png", dpi=110))
    else:
        skipped.append("loss_curves.png: no run has train rows in metrics.jsonl")

    # 2. Held-out top-1 by unroll step.
    with_val = [(run, n["val"]) for run, n in zip(runs, numbers) if any("top1" in v for v in n["val"].values())]
    if with_val:
        fig, ax = plt.subplots(figsize=(6, 4))
        for run, val in with_val:
            ks = [k for k in val if "top1" in val[k]]
            ax.plot(ks, [val[k]["top1"] for k in ks], marker="o", label=run.label)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        label_axes(ax, "unroll step k", "held-out top-1", "Held-out accuracy by unroll step", ylim=(0, 1))
        paths.append(save_figure(fig, out_dir / "val_top1_by_step.png", dpi=110))
    else:
        skipped.append("val_top1_by_step.png: no run has held-out validation numbers")

    # 3. Acceptance by position (at the largest k evaluated) and τ by k, from the eval reports.
    with_eval = [(run, n["eval"]) for run, n in zip(runs, numbers) if n["eval"] and n["eval"]["by_k"]]
    if with_eval:
        fig, (ax_acc, ax_tau) = plt.subplots(1, 2, figsize=(11, 4))
        longest = 1
        for run, evaluation in with_eval:
            # The largest k evaluated shows the whole draft chain (the best k may be 1: a single point).
            deepest = evaluation["by_k"][max(evaluation["by_k"])]
            rates = deepest.get("acceptance_per_position") or []
            if rates:
                longest = max(longest, len(rates))
                ax_acc.plot(range(1, len(rates) + 1), rates, marker="o", label=f"{run.label} ({deepest['method']})")
            line = ax_tau.plot(list(evaluation["by_k"]), [e["tau"] or 0.0 for e in evaluation["by_k"].values()],
                               marker="o", label=f"{run.label} ({evaluation['draft_method']})")[0]
            for name, ks in evaluation["baselines"].items():
                ax_tau.plot(list(ks), [e["tau"] or 0.0 for e in ks.values()], marker="x", linestyle="--",
                            color=line.get_color(), alpha=0.6, label=f"{run.label} ({name})")
        for axis in (ax_acc, ax_tau):
            axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax_acc.set_xlim(0.5, longest + 0.5)
        label_axes(ax_acc, "draft position", "acceptance rate (unconditional)", "Acceptance by position (largest k)",
                   ylim=(0, 1))
        label_axes(ax_tau, "speculative tokens k", "τ (tokens per target forward)", "τ by k")
        paths.append(save_figure(fig, out_dir / "acceptance_by_position.png", dpi=110))
    else:
        skipped.append("acceptance_by_position.png: no run has an eval/report.json (run `mtp-train eval`)")
    return paths, skipped


# ---------------------------------------------------------------------------------------------------------------
# entry points
# ---------------------------------------------------------------------------------------------------------------


def compare_runs(run_dirs: list[str | Path], out_dir: str | Path = DEFAULT_OUT, echo: bool = True) -> dict[str, Any]:
    """Compare the runs, write compare.md / compare.json / PNGs into `out_dir`, return the compare.json content."""
    if not run_dirs:
        raise UserError("compare: expected at least one run directory")
    runs = [load_run(path) for path in run_dirs]
    _unique_labels(runs)
    numbers = [run_numbers(run) for run in runs]
    diffs = differing_keys(runs)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots, skipped = write_plots(runs, numbers, out)
    header, rows = build_table(runs, numbers, diffs)

    result = {
        "runs": [
            {"label": run.label, "run_dir": str(run.path), "missing": list(run.notes),
             "recipe_values": {key: values.get(run.label) for key, values in diffs.items()},
             **n}
            for run, n in zip(runs, numbers)
        ],
        "differing_keys": diffs,
        "plots": [p.name for p in plots],
        "plots_skipped": skipped,
    }
    result = _plain(result)
    write_json_atomic(out / "compare.json", result)
    atomic_write_text(out / "compare.md", format_markdown(runs, header, rows, diffs, plots, out))
    if echo:
        print(format_text_table(header, rows))
        for note in skipped:
            print(f"compare: skipped {note}")
        print(f"compare: wrote {out / 'compare.md'}, {out / 'compare.json'} and {len(plots)} plot(s) to {out}")
    return result
