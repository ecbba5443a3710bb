"""`mtp-train eval`: acceptance and speed of a head (MTP chain) or a draft model (target–draft) vs plain decoding
(evaluate/evaluation.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from mtp_train.cli_options import add_recipe_args, recipe_from_args

# Recipe keys `eval` takes as options (cli_options: type, choices, limits and help from the recipe's fields).
RECIPE_OPTIONS = ("eval.prompts", "eval.limit", "eval.num_speculative_tokens", "eval.max_new_tokens",
                  "eval.temperature", "eval.batch_sizes", "eval.engine", "target.tensor_parallel",
                  "precision.compute", "precision.decode", "precision.kv_cache", "precision.head_decode")
FLAGS = {"eval.batch_sizes": "--batch-size", "target.tensor_parallel": "--tp"}


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "eval",
        help="measure τ, acceptance and speedup through the speculative inference path",
        description="Run plain and speculative decoding (same prompts, same settings; batch 1 unless --batch-size) and write "
        "report.json, report.md and PNG plots. Default draft: the recipe run's head (runs/<name>/head).",
    )
    add_recipe_args(p, RECIPE_OPTIONS, FLAGS)
    group = p.add_mutually_exclusive_group()
    group.add_argument("--head", default=None, help="draft head directory (native or any exported format)")
    group.add_argument("--draft", default=None, help="draft model directory (target–draft schedule)")
    p.add_argument("--out", default=None, help="report directory (default: <run_dir>/eval)")
    p.add_argument("--run-dir", default=None, help="log the results into this run's metrics.jsonl / W&B")
    p.add_argument("--no-prompt-lookup", action="store_true",
                   help="skip the prompt-lookup (n-gram) baseline that runs beside the draft by default")
    p.add_argument("--no-hybrid", action="store_true",
                   help="skip the hybrid drafter (per step the head's chain or a copy from the context) that runs "
                        "beside a head by default")
    p.add_argument("--tree", nargs="+", default=None, metavar="DxKxN[+lookup]",
                   help="also draft trees with the head, one method per shape DEPTHxTOPKxNODES (e.g. 4x2x8; "
                        "+lookup: a hybrid tree with the prompt-lookup branch), beside the chain at each k")
    p.set_defaults(func=run_eval_command)


def run_eval_command(args: argparse.Namespace) -> int:
    from mtp_train.errors import UserError

    if args.tree:
        from mtp_train.runtime.spec.tree import parse_tree_method

        for spec in args.tree:
            parse_tree_method(spec)  # a bad shape is refused before the recipe and the models load
    recipe = recipe_from_args(args)
    run_dir = recipe.run_dir
    head_dir = args.head or (None if args.draft else str(run_dir / "head"))
    if head_dir and not Path(head_dir).is_dir():
        raise UserError(f"{head_dir}: head directory not found (train first, or pass --head DIR / --draft DIR)")
    ks = list(recipe.eval.num_speculative_tokens)
    batch_sizes = list(recipe.eval.batch_sizes)
    engine = recipe.eval.engine
    if engine != "ours" and not head_dir:
        raise UserError("--engine vllm/both measures a head (vLLM serves a draft model otherwise); use --head")
    prompts_path = recipe.eval.prompts
    if prompts_path:
        from mtp_train.evaluate.prompts import prompts_file

        prompts_file(prompts_path)  # an unknown set name or a missing file is refused before the models load
    limit = recipe.eval.limit
    max_new_tokens = recipe.eval.max_new_tokens
    out_dir = Path(args.out) if args.out else run_dir / "eval"
    report = None
    if engine in ("ours", "both"):
        report = run_evaluation(
            recipe, head_dir=head_dir, draft_dir=args.draft, prompts_path=prompts_path, limit=limit, ks=ks,
            max_new_tokens=max_new_tokens, out_dir=out_dir,
            log_run_dir=Path(args.run_dir) if args.run_dir else (run_dir if head_dir == str(run_dir / "head") else None),
            prompt_lookup=not args.no_prompt_lookup, batch_sizes=tuple(batch_sizes), trees=tuple(args.tree or ()),
            hybrid=not args.no_hybrid,
        )
        if not report.get("written", True):
            return 0  # a follower rank of a tensor-parallel eval: rank 0 reports
        best = report.get("best", {})
        print(f"eval: plain {report['overall']['plain']['tokens_per_s']:.1f} tok/s; best {best.get('method')}: "
              f"τ {best.get('tau', 0):.3f}, speedup {best.get('speedup', 0):.2f}×; report in {report['out_dir']}")
    if engine in ("vllm", "both"):
        section = _evaluate_in_vllm(recipe, head_dir, prompts_path, limit, ks, max_new_tokens, out_dir)
        best = section["best"]
        print(f"eval (vLLM {section['vllm_version']}): plain {section['plain']['tokens_per_s']:.1f} tok/s; best "
              f"{best['method']}: τ {best['tau']:.3f}, speedup {best['speedup']:.2f}×; report in {out_dir}")
    return 0


def _evaluate_in_vllm(recipe, head_dir: str, prompts_path, limit, ks, max_new_tokens, out_dir: Path) -> dict:
    """The head served by vLLM on the eval prompts (their first turns), its section added to report.json and
    report.md in `out_dir` (beside our engine's figures when they were just written there)."""
    import json

    from mtp_train.evaluate.prompts import load_heldout, load_mt_bench
    from mtp_train.evaluate.runner import first_turn_ids
    from mtp_train.export.vllm_eval import evaluate_in_vllm, markdown_lines
    from mtp_train.features.vllm_target import engine_args
    from mtp_train.fileio import atomic_write_text, write_json_atomic
    from mtp_train.heads.io import read_head_config
    from mtp_train.runtime.chat import stop_token_ids
    from mtp_train.runtime.config import load_config
    from mtp_train.runtime.loader import load_tokenizer

    tokenizer = load_tokenizer(recipe.target.path)
    prompt_set = load_mt_bench(prompts_path, limit) if prompts_path else load_heldout(recipe.prepared_dir, limit)
    prompts = [first_turn_ids(tokenizer, prompt) for prompt in prompt_set.prompts]
    stops = sorted(stop_token_ids(tokenizer, load_config(recipe.target.path)))
    # The engine is spread as precompute's (tensor/pipeline parallel sizes, quantization, ...); the context length
    # is the prompts' unless the recipe sets one.
    spread = engine_args(recipe.precompute.vllm, max_sample_len=1)
    if recipe.precompute.vllm.max_model_len is None:
        del spread["max_model_len"]
    section = evaluate_in_vllm(head_dir, recipe.target.path, prompts, stops, list(ks), max_new_tokens,
                               out_dir / "vllm", dtype=recipe.precision.compute, python=recipe.precompute.vllm.python,
                               engine_args=spread)
    section["prompt_source"] = prompt_set.source + (" (first turns)" if prompts_path else "")
    report_path, markdown_path = out_dir / "report.json", out_dir / "report.md"
    report = json.loads(report_path.read_text(encoding="utf-8")) if report_path.is_file() else {}
    if "draft_kind" not in report:  # vLLM alone: what it measured, as our engine's report names it (export reads it)
        kind = read_head_config(head_dir).kind
        report.update(name=recipe.name, target=str(recipe.target.path), draft=str(head_dir),
                      draft_kind=f"head ({kind})", draft_method=kind)
    report["vllm"] = section
    write_json_atomic(report_path, report)
    markdown = markdown_path.read_text(encoding="utf-8") if markdown_path.is_file() else ""
    marker = "\n## vLLM "
    if marker in markdown:
        markdown = markdown[: markdown.index(marker)]
    atomic_write_text(markdown_path, markdown.rstrip() + "\n\n" + "\n".join(markdown_lines(section)) + "\n")
    return section


def run_evaluation(recipe, head_dir, draft_dir, prompts_path, limit, ks, max_new_tokens, out_dir: Path,
                   log_run_dir: Path | None = None, show_progress: bool = True, prompt_lookup: bool = True,
                   batch_sizes: tuple[int, ...] = (1,), trees: tuple[str, ...] = (), hybrid: bool = True) -> dict:
    """`_run_evaluation`, holding the run dir's lock (`train.checkpoints.RunDirLock`'s file) where the results are
    logged into a run: an eval never appends to the metrics of a run that is training (it stops at once, naming the
    trainer), and a trainer never starts in a run an eval is logging into."""
    import os

    from mtp_train.fileio import OutputLock
    from mtp_train.train.checkpoints import LOCK_FILENAME

    def busy(who: str) -> str:
        return (f"{log_run_dir}: another process is using this run dir ({who}), and eval would log into its "
                "metrics.jsonl while it runs: wait for it, or evaluate a copy of the head (--head DIR), which logs "
                "into no run")

    leader = int(os.environ.get("RANK", "0")) == 0
    logs = log_run_dir is not None and log_run_dir.is_dir() and leader
    lock = OutputLock(log_run_dir / LOCK_FILENAME, busy, label="eval").acquire() if logs else None
    try:
        return _run_evaluation(recipe, head_dir, draft_dir, prompts_path, limit, ks, max_new_tokens, out_dir,
                               log_run_dir, show_progress, prompt_lookup, batch_sizes, trees, hybrid)
    finally:
        if lock is not None:
            lock.release()


def _run_evaluation(recipe, head_dir, draft_dir, prompts_path, limit, ks, max_new_tokens, out_dir: Path,
                    log_run_dir: Path | None, show_progress: bool, prompt_lookup: bool,
                    batch_sizes: tuple[int, ...], trees: tuple[str, ...], hybrid: bool = True) -> dict:
    """Load the target (in the precision `auto` resolves to) and the draft: the head at `head_dir` (a trainer's head/
    or any export format) or the model at `draft_dir`; then `evaluate`.

    With `target.tensor_parallel` N (under `torchrun --nproc_per_node=N`) the target is split over the N ranks and the
    draft replicated: every rank runs the same decoding loop on the same inputs (the leader's precision, so the same
    decode path), so each target forward's all-reduces line up and every rank commits the same tokens, with no
    broadcast of proposals or accepted tokens. A head is one decoder layer (a few % of the target): replicating it
    costs little and keeps the speculative engine unchanged. Only rank 0 writes the report and logs the run; the other
    ranks' reports go to a temporary directory and their return value says `written: False`."""
    import tempfile

    from mtp_train.errors import UserError
    from mtp_train.evaluate.evaluation import evaluate
    from mtp_train.export.load import load_draft
    from mtp_train.runtime.loader import load_tokenizer, resolve_device
    from mtp_train.runtime.precision import resolve_section
    from mtp_train.runtime.tensor_parallel import (
        ParallelLayout,
        describe,
        init_tensor_parallel,
        load_model_tensor_parallel,
    )

    layout = ParallelLayout.from_environ(recipe.target.tensor_parallel)
    if layout.dp_size > 1:
        raise UserError(f"target.tensor_parallel (--tp): eval runs one copy of the target; launch torchrun with as "
                        f"many processes as --tp ({layout.tensor_parallel}), not {layout.world_size}")
    device = resolve_device(recipe.target.device)
    group = init_tensor_parallel(layout, device, recipe.distributed.timeout_minutes)
    if device.type == "cuda" and layout.tensor_parallel > 1:
        import os

        import torch

        device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
    precision = resolve_section(recipe.precision, device) if layout.is_leader else None
    precision = group.broadcast_object(precision)  # one decode path on every rank: the same logits, the same tokens
    if layout.is_leader:
        print(f"eval: {precision.describe()}", flush=True)
    target = load_model_tensor_parallel(recipe.target.path, group, device=device, precision=precision,
                                       backend=recipe.target.attention)
    if layout.is_leader and layout.tensor_parallel > 1:
        print(f"eval: {describe(layout, target.config)}", flush=True)
    tokenizer = load_tokenizer(recipe.target.path)
    draft = load_draft(target, tokenizer, precision, head=head_dir, draft_model=draft_dir,
                       head_decode_dtype=recipe.precision.head_decode)
    if head_dir:
        method, kind, draft_path = draft.kind, f"head ({draft.kind})", head_dir
    else:
        method, kind, draft_path = "draft", "draft model (target–draft)", draft_dir
    if layout.is_leader:
        return evaluate(recipe, target, tokenizer, precision, draft, method, kind, draft_path, prompts_path, limit, ks,
                        max_new_tokens, out_dir, log_run_dir, show_progress, prompt_lookup,
                        cost_curve=recipe.eval.cost_curve, batch_sizes=batch_sizes, trees=trees, hybrid=hybrid)
    with tempfile.TemporaryDirectory(prefix="mtp-eval-follower-") as scratch:
        report = evaluate(recipe, target, tokenizer, precision, draft, method, kind, draft_path, prompts_path, limit,
                          ks, max_new_tokens, Path(scratch), None, False, prompt_lookup,
                          cost_curve=recipe.eval.cost_curve, batch_sizes=batch_sizes, trees=trees, hybrid=hybrid)
    return {**report, "written": False}
