"""`mtp-train eval`: acceptance and speed of a head (MTP chain) or a draft model (target–draft) vs plain decoding."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def register(subparsers) -> None:
    from mtp_train.recipe import add_recipe_args

    p = subparsers.add_parser(
        "eval",
        help="measure τ, acceptance and speedup through the speculative inference path",
        description="Run plain and speculative decoding (same prompts, same settings, batch 1) and write "
        "report.json, report.md and PNG plots. Default draft: the recipe run's head (runs/<name>/head).",
    )
    add_recipe_args(p)
    group = p.add_mutually_exclusive_group()
    group.add_argument("--head", default=None, help="draft head directory (native or any exported format)")
    group.add_argument("--draft", default=None, help="draft model directory (target–draft schedule)")
    p.add_argument("--prompts", default=None, help="MT-bench-format JSONL (default: eval.prompts, else held-out split)")
    p.add_argument("--limit", type=int, default=None, help="prompts evaluated (default: eval.limit)")
    p.add_argument("--num-speculative-tokens", type=int, nargs="+", default=None, metavar="K",
                   help="k values (default: eval.num_speculative_tokens)")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--out", default=None, help="report directory (default: <run_dir>/eval)")
    p.add_argument("--run-dir", default=None, help="log the results into this run's metrics.jsonl / W&B")
    p.add_argument("--no-prompt-lookup", action="store_true",
                   help="skip the prompt-lookup (n-gram) baseline that runs beside the draft by default")
    p.set_defaults(func=run_eval_cli)


def run_eval_cli(args: argparse.Namespace) -> int:
    from mtp_train.errors import UserError
    from mtp_train.recipe import recipe_from_args

    recipe = recipe_from_args(args)
    run_dir = Path(recipe.train.run_dir or f"runs/{recipe.name}")
    head_dir = args.head or (None if args.draft else str(run_dir / "head"))
    if head_dir and not Path(head_dir).is_dir():
        raise UserError(f"{head_dir}: head directory not found (train first, or pass --head DIR / --draft DIR)")
    ks = args.num_speculative_tokens or list(recipe.eval.num_speculative_tokens)
    bad = [k for k in ks if not 1 <= k <= 8]
    if bad:
        raise UserError(f"--num-speculative-tokens: {bad} out of range; expected 1..8")
    report = evaluate(
        recipe,
        head_dir=head_dir,
        draft_dir=args.draft,
        prompts_path=args.prompts or recipe.eval.prompts,
        limit=args.limit if args.limit is not None else recipe.eval.limit,
        ks=ks,
        max_new_tokens=args.max_new_tokens or recipe.eval.max_new_tokens,
        out_dir=Path(args.out) if args.out else run_dir / "eval",
        log_run_dir=Path(args.run_dir) if args.run_dir else (run_dir if head_dir == str(run_dir / "head") else None),
        prompt_lookup=not args.no_prompt_lookup,
    )
    best = report.get("best", {})
    print(f"eval: plain {report['overall']['plain']['tokens_per_s']:.1f} tok/s; best {best.get('method')}: "
          f"τ {best.get('tau', 0):.3f}, speedup {best.get('speedup', 0):.2f}×; report in {report['out_dir']}")
    return 0


def evaluate(recipe, head_dir, draft_dir, prompts_path, limit, ks, max_new_tokens, out_dir: Path,
             log_run_dir: Path | None = None, show_progress: bool = True, prompt_lookup: bool = True) -> dict:
    """Plain decoding, the draft (head or model) and, if `prompt_lookup`, the n-gram baseline, at each k."""
    from mtp_train.evaluate.prompts import load_heldout, load_mt_bench
    from mtp_train.evaluate.report import build_report, write_markdown, write_plots
    from mtp_train.evaluate.runner import run_methods
    from mtp_train.fileio import write_json_atomic
    from mtp_train.runtime.chat import stop_token_ids
    from mtp_train.runtime.hardware import machine_name
    from mtp_train.runtime.loader import load_model, load_tokenizer, resolve_device
    from mtp_train.runtime.precision import apply_decode_weights, resolve_precision
    from mtp_train.runtime.sampler import SamplingParams

    device = resolve_device(recipe.target.device)
    precision = resolve_precision(recipe.target.dtype, recipe.target.decode_dtype, device)
    print(f"eval: {precision.describe()}", flush=True)
    target = load_model(recipe.target.path, device=device, precision=precision)
    tokenizer = load_tokenizer(recipe.target.path)
    if head_dir:
        from mtp_train.export.load import load_any_head

        # The head computes like the target: its weights in the compute dtype, few-row matmuls on decode weights.
        draft = apply_decode_weights(load_any_head(head_dir, target, dtype=target.dtype), precision)
        name, kind, draft_path = "mtp" if draft.kind == "mtp" else draft.kind, f"head ({draft.kind})", head_dir
    else:
        draft = _load_draft_model(recipe, draft_dir, target, tokenizer, precision)
        name, kind, draft_path = "draft", "draft model (target–draft)", draft_dir
    if prompts_path:
        prompt_set = load_mt_bench(prompts_path, limit)
    else:
        prompt_set = load_heldout(recipe.data.output_dir or f"data/prepared/{recipe.name}", limit)
    sampling = SamplingParams(temperature=recipe.eval.temperature)
    from mtp_train.runtime.speculative import PromptLookup

    drafts = {name: draft, **({"lookup": PromptLookup()} if prompt_lookup else {})}
    totals = run_methods(target, tokenizer, prompt_set.prompts, drafts, ks, max_new_tokens, sampling,
                         stop_token_ids(tokenizer, target.config), show_progress=show_progress)
    meta = {
        "name": recipe.name, "target": str(recipe.target.path), "draft": str(draft_path), "draft_kind": kind,
        "draft_method": name,
        "prompts": prompt_set.source, "num_prompts": len(prompt_set.prompts), "skipped": prompt_set.skipped,
        "settings": {"dtype": precision.dtype, "decode_dtype": precision.decode_dtype,
                     "decode_max_rows": precision.decode_max_rows, "precision_reason": precision.reason,
                     "cpu_capability": machine_name(device), "batch_size": 1, "max_new_tokens": max_new_tokens,
                     "temperature": recipe.eval.temperature, "num_speculative_tokens": ks},
    }
    report = build_report(totals, meta)
    out_dir.mkdir(parents=True, exist_ok=True)
    report["out_dir"] = str(out_dir)
    write_json_atomic(out_dir / "report.json", report)
    write_markdown(report, out_dir / "report.md")
    plots = write_plots(report, out_dir)
    if log_run_dir is not None and log_run_dir.is_dir():
        _log_to_run(recipe, log_run_dir, report, plots)
    return report


def _load_draft_model(recipe, draft_dir, target, tokenizer, precision):
    from mtp_train.errors import UserError
    from mtp_train.runtime.loader import load_model, load_tokenizer

    draft = load_model(draft_dir, device=target.device, precision=precision)
    draft_tokenizer = load_tokenizer(draft_dir)
    if draft_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise UserError(f"{draft_dir}: the draft's tokenizer differs from the target's; a draft model must share it")
    return draft


def _log_to_run(recipe, run_dir: Path, report: dict, plots: list[Path]) -> None:
    """Append the eval results to the run's metrics.jsonl (and its W&B run, resumed by id, when enabled)."""
    metrics_path = run_dir / "metrics.jsonl"
    last_step = 0
    if metrics_path.is_file():
        lines = [l for l in metrics_path.read_text().splitlines() if l.strip()]
        last_step = json.loads(lines[-1])["step"] if lines else 0
    row = {"step": last_step}
    for method, r in report["overall"].items():
        for key in ("tau", "alpha", "tokens_per_s", "speedup"):
            if key in r:
                row[f"eval/{method}/{key}"] = r[key]
    with metrics_path.open("a") as stream:
        stream.write(json.dumps(row) + "\n")
    if recipe.tracking.wandb.mode != "disabled" and (run_dir / "wandb_run_id").is_file():
        from mtp_train.train.tracking import Tracker

        tracker = Tracker(run_dir, recipe, enabled=True, resume=True)
        if tracker.wandb_run is not None:
            tracker.wandb_run.log({k: v for k, v in row.items() if k != "step"})
            tracker.log_files(plots)
            tracker.wandb_run.finish()
