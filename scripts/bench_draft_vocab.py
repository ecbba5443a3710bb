#!/usr/bin/env python
"""Reduced draft vocabularies side by side: trains one MTP head per draft-vocabulary size (full, 32k, 16k, 8k by
default) with the same recipe and step budget, then, in one process on the held-out prompts (bf16, batch 1, greedy,
interleaved per prompt), measures each head's coverage, held-out top-1, τ and speculative tokens/s at k = 1..4, and
its head step time (one draft token, vocabulary projection included), with ratios to the full-vocabulary head.
Ends with a `RESULT` line.

    python scripts/bench_draft_vocab.py --recipe recipes/smollm2-135m-mtp.yaml --steps 64
    python scripts/bench_draft_vocab.py --quick          # full and 8k, 8 steps each, 2 prompts

Heads are trained by `mtp-train train` (subprocess, `--nproc` ranks under torchrun) into `<out>/<size>/`; pass
`--reuse` to evaluate heads already there. Without the recipe's features (`mtp-train precompute`), it prepares and
precomputes a small set of its own under `--out` first."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def _train(recipe: str, sets: list[str], size: str, steps: int, run_dir: Path, nproc: int) -> None:
    command = ["-m", "mtp_train", "train", "--recipe", recipe]
    if nproc > 1:
        command = ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master-port=29561", *command]
    overrides = [*sets, f"head.draft_vocab_size={size}", f"train.max_steps={steps}", f"train.run_dir={run_dir}",
                 f"train.eval_every={steps}", f"train.save_every={steps}", "tracking.wandb.mode=disabled"]
    command = [sys.executable, *command, *[a for o in overrides for a in ("--set", o)]]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // nproc))}
    print(f"training the {size} head: {' '.join(command[1:])}", flush=True)
    started = time.perf_counter()
    subprocess.run(command, cwd=REPO, env=env, check=True)
    print(f"  trained in {time.perf_counter() - started:.0f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "smollm2-135m-mtp.yaml"))
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--sizes", nargs="+", default=["full", "32768", "16384", "8192"])
    parser.add_argument("--steps", type=int, default=64, help="optimizer steps per head")
    parser.add_argument("--nproc", type=int, default=1, help="training ranks (torchrun)")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench-draft-vocab")
    parser.add_argument("--reuse", action="store_true", help="evaluate heads already trained in --out")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--quick", action="store_true", help="full and 8192, 8 steps, 2 prompts, 48 tokens, k = 1, 3")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.steps, args.num_prompts, args.new_tokens, args.ks = ["full", "8192"], 8, 2, 48, [1, 3]
    if "full" not in args.sizes:
        args.sizes.insert(0, "full")

    from mtp_train.evaluate.prompts import load_heldout
    from mtp_train.evaluate.runner import run_methods
    from mtp_train.heads import load_head
    from mtp_train.recipe import load_recipe
    from mtp_train.runtime.chat import stop_token_ids
    from mtp_train.runtime.cpu import tune_malloc
    from mtp_train.runtime.loader import load_model, load_tokenizer
    from mtp_train.runtime.sampler import SamplingParams
    from mtp_train.profile.costs import head_step_seconds, target_step_seconds

    tune_malloc()
    recipe = load_recipe(args.recipe, args.overrides)
    if not (recipe.features_dir / "manifest.json").is_file():
        # No features yet (a fresh clone before `make demo`): prepare and precompute a small set of the bench's own
        # under --out, leaving the recipe's own output folders to the pipeline.
        args.overrides = [*args.overrides, f"data.output_dir={args.out / 'prepared'}",
                          f"precompute.output_dir={args.out / 'features'}",
                          f"data.max_samples={80 if args.quick else 300}"]
        print(f"{recipe.features_dir}: no features; preparing {args.out / 'features'} for this bench", flush=True)
        sets = [a for o in args.overrides for a in ("--set", o)]
        for stage in ("prepare", "precompute"):
            subprocess.run([sys.executable, "-m", "mtp_train", stage, "--recipe", args.recipe, *sets], check=True)
        recipe = load_recipe(args.recipe, args.overrides)
    for size in args.sizes:
        run_dir = args.out / size
        if not (args.reuse and (run_dir / "head" / "model.safetensors").is_file()):
            _train(args.recipe, args.overrides, size, args.steps, run_dir, args.nproc)

    from mtp_train.runtime.hardware import machine_fields
    from mtp_train.runtime.decode_runner import head_runner
    from mtp_train.runtime.precision import resolve_section

    precision = resolve_section(recipe.precision, "cpu")
    print(f"eval: {precision.describe()}")
    target = load_model(recipe.target.path, device="cpu", precision=precision)
    tokenizer = load_tokenizer(recipe.target.path)
    heads, summaries = {}, {}
    for size in args.sizes:
        heads[size] = head_runner(load_head(args.out / size / "head", target), precision, "target")
        summaries[size] = json.loads((args.out / size / "summary.json").read_text())
    prepared_dir = recipe.prepared_dir
    prompts = load_heldout(prepared_dir, args.num_prompts).prompts
    stops = stop_token_ids(tokenizer, target.config)
    with torch.inference_mode():
        totals = run_methods(target, tokenizer, prompts, heads, args.ks, args.new_tokens,
                             SamplingParams(temperature=0.0), stops, show_progress=True)
    step_seconds = {size: head_step_seconds(target, head, prompts[0].prompt_ids) for size, head in heads.items()}
    decode_seconds = target_step_seconds(target, prompts[0].prompt_ids, [1])[1]
    plain = totals["plain"]["all"]
    plain_tps = plain.tokens_per_s

    print(f"\n{len(prompts)} held-out prompts, <= {args.new_tokens} new tokens, {precision.describe()}, batch 1, greedy; "
          f"{args.steps} training steps per head; plain decode {plain_tps:.1f} tok/s")
    print(f"{'draft vocab':>11s} {'coverage':>8s} {'top1':>6s} {'head ms':>8s} {'vs full':>7s} " +
          " ".join(f"{'tau@' + str(k):>6s} {'tok/s@' + str(k):>8s}" for k in args.ks) + f" {'best':>9s}")
    result: dict[str, float | str] = {"plain_tok_s": round(plain_tps, 2), "decode_step_ms": round(decode_seconds * 1e3, 3)}
    best_by_size = {}
    for size in args.sizes:
        summary = summaries[size]
        per_k = {k: totals[f"{size}@k={k}"]["all"].summary(plain) for k in args.ks}
        best_k = max(args.ks, key=lambda k: per_k[k]["tokens_per_s"])
        best_by_size[size] = (best_k, per_k[best_k])
        step_ratio = step_seconds[size] / step_seconds["full"]
        print(f"{size:>11s} {summary.get('draft_vocab_coverage', 1.0):8.4f} {summary.get('val/step1/top1', 0):6.4f} "
              f"{step_seconds[size] * 1e3:8.3f} {step_ratio:7.2f} " +
              " ".join(f"{per_k[k]['tau']:6.3f} {per_k[k]['tokens_per_s']:8.1f}" for k in args.ks) +
              f" k={best_k} {per_k[best_k]['speedup']:.2f}x")
        key = "full" if size == "full" else f"v{size}"
        result[f"{key}_coverage"] = round(summary.get("draft_vocab_coverage", 1.0), 4)
        result[f"{key}_top1"] = round(summary.get("val/step1/top1", 0.0), 4)
        result[f"{key}_head_step_ms"] = round(step_seconds[size] * 1e3, 3)
        result[f"{key}_head_step_vs_decode"] = round(step_seconds[size] / decode_seconds, 3)
        result[f"{key}_head_step_vs_full"] = round(step_ratio, 3)
        for k in args.ks:
            result[f"{key}_tau_k{k}"] = per_k[k]["tau"]
            result[f"{key}_tok_s_k{k}"] = per_k[k]["tokens_per_s"]
        result[f"{key}_best_k"] = best_k
        result[f"{key}_best_vs_plain"] = per_k[best_k]["speedup"]
    full_best = best_by_size["full"][1]["tokens_per_s"]
    for size in args.sizes:
        key = "full" if size == "full" else f"v{size}"
        result[f"{key}_best_vs_full"] = round(best_by_size[size][1]["tokens_per_s"] / full_best, 3)
    fastest = max(args.sizes, key=lambda s: best_by_size[s][1]["tokens_per_s"])
    result["fastest"] = fastest
    print("RESULT " + " ".join(f"{k}={v}" for k, v in result.items()) + f" decode_dtype={precision.decode_dtype} "
          + machine_fields(precision.dtype))


if __name__ == "__main__":
    main()
