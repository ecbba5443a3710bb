#!/usr/bin/env python
"""The whole pipeline on the default recipe, stage by stage, then one summary table (`make demo`).

    prepare (self-distilled replies) -> precompute (torchrun, N ranks) -> draft-vocab -> train (torchrun, DeepSpeed)
    -> eval (held-out prompts: plain, prompt lookup, MTP speculative) -> export (every format) -> summary

Each stage is the normal `mtp-train` subcommand in a subprocess (its own progress bar shows); stages whose output
is already complete return at once (prepare/precompute are idempotent, train resumes), so a rerun after an
interruption continues. The summary is printed and written to `<run_dir>/demo_summary.md` and `.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_RECIPE = REPO / "recipes" / "smollm2-135m-mtp.yaml"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(DEFAULT_RECIPE))
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--nproc", type=int, default=2, help="ranks for precompute and train (torchrun)")
    args = parser.parse_args()

    from mtp_train.recipe import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    run_dir = recipe.run_dir
    prepared_dir = recipe.prepared_dir
    features_dir = recipe.features_dir
    exports_dir = REPO / "exports" / recipe.name
    sets = [a for o in args.overrides for a in ("--set", o)]
    recipe_args = ["--recipe", args.recipe, *sets]
    threads = str(max(1, (os.cpu_count() or 2) // args.nproc))
    timings: dict[str, float] = {}

    def stage(name: str, argv: list[str], ranks: int = 1) -> None:
        if ranks > 1:
            command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
                       "--master-port=29571", "-m", "mtp_train", *argv]
            env = {**os.environ, "OMP_NUM_THREADS": threads}
        else:
            command, env = [sys.executable, "-m", "mtp_train", *argv], dict(os.environ)
        print(f"\n=== {name}: mtp-train {' '.join(argv)}" + (f" (torchrun, {ranks} ranks)" if ranks > 1 else ""),
              flush=True)
        started = time.perf_counter()
        result = subprocess.run(command, cwd=REPO, env=env)
        timings[name] = time.perf_counter() - started
        if result.returncode != 0:
            raise SystemExit(f"demo: stage {name} failed (exit {result.returncode}); fix it and rerun `make demo` "
                             "(finished stages are skipped)")
        print(f"=== {name}: {timings[name]:.0f} s", flush=True)

    total_started = time.perf_counter()
    stage("prepare", ["prepare", *recipe_args])
    stage("precompute", ["precompute", *recipe_args], ranks=args.nproc)
    if recipe.head.draft_vocab_size != "full":
        stage("draft-vocab", ["draft-vocab", *recipe_args])
    stage("train", ["train", *recipe_args], ranks=args.nproc)
    stage("eval", ["eval", *recipe_args])
    exports = _export_all(run_dir / "head", recipe.target.path, exports_dir, timings)
    timings["total"] = time.perf_counter() - total_started

    summary = _summary(recipe, prepared_dir, features_dir, run_dir, exports, timings)
    markdown = _markdown(summary)
    print("\n" + markdown)
    (run_dir / "demo_summary.md").write_text(markdown + "\n", encoding="utf-8")
    (run_dir / "demo_summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    print(f"(also in {run_dir / 'demo_summary.md'})")
    return 0


def _export_all(head_dir: Path, target: str, exports_dir: Path, timings: dict[str, float]) -> dict:
    """Every format: {"written": {format: directory}, "refused": {format: the reason in one line}, "vllm": the
    `vllm serve` command of the export vLLM loads for this head (None if none was written)}."""
    from mtp_train.errors import UserError
    from mtp_train.export import FORMAT_NAMES
    from mtp_train.export.exporter import export_head
    from mtp_train.export.best_k import find_measured_k, serving_k
    from mtp_train.export.registry import get_format
    from mtp_train.export.vllm_serving import VLLM_FORMATS, vllm_serve_arguments, vllm_serve_command
    from mtp_train.heads.io import read_head_config

    print("\n=== export: " + ", ".join(FORMAT_NAMES), flush=True)
    started = time.perf_counter()
    kind = read_head_config(head_dir).kind
    written, refused = {}, {}
    for name in FORMAT_NAMES:
        try:
            written[name] = str(export_head(head_dir, name, exports_dir / name, target, overwrite=True))
            print(f"  {name}: {written[name]}", flush=True)
        except UserError as err:
            refused[name] = _refusal_line(get_format(name), kind, str(err))
            print(f"  {name}: refused: {err}", flush=True)
    timings["export"] = time.perf_counter() - started
    command = None
    vllm_format = VLLM_FORMATS.get(kind, (None,))[0]
    if vllm_format in written:
        k, k_source = serving_k(find_measured_k(head_dir, None)[0], None)  # as exported
        serve = vllm_serve_arguments(kind, str(Path(written[vllm_format]).resolve()), str(Path(target).resolve()), k)
        command = vllm_serve_command(serve, multiline=True)
    return {"written": written, "refused": refused, "vllm_format": vllm_format, "vllm": command,
            "vllm_k": None if command is None else f"k = {k}: {k_source}"}


def _refusal_line(fmt, kind: str, message: str) -> str:
    """One line for the summary: what the format holds when it is another kind's, else the reason's first clause
    (the whole message is in the export stage's output)."""
    if kind not in fmt.kinds:
        return f"holds {', '.join(fmt.kinds)} heads; this is an {kind} head"
    reason = message.split(f" as {fmt.name}: ", 1)[-1]
    return reason.split(": ", 1)[0].split("; ", 1)[0]


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _summary(recipe, prepared_dir: Path, features_dir: Path, run_dir: Path, exports: dict, timings: dict) -> dict:
    stats = _read_json(prepared_dir / "stats.json")
    manifest = _read_json(features_dir / "manifest.json")
    train_summary = _read_json(run_dir / "summary.json")
    report = _read_json(run_dir / "eval" / "report.json")
    cache_bytes = sum(
        shard["nbytes"] for split in manifest.get("splits", {}).values() for shard in split.get("shards", [])
    )
    overall = report.get("overall", {})
    methods = {
        method: {key: result.get(key) for key in ("tau", "tokens_per_s", "speedup", "predicted_speedup",
                                                  "acceptance_per_position")}
        for method, result in overall.items()
    }
    steps = sorted({int(k.split("/")[1][4:]) for k in train_summary if k.startswith("val/step") and k.endswith("/top1")})
    return {
        "recipe": recipe.name,
        "data": {
            "rows_read": stats.get("rows_read"), "samples": stats.get("kept"), "tokens": stats.get("tokens"),
            "assistant_tokens": stats.get("assistant_tokens"),
            "regenerated": (stats.get("regeneration") or {}).get("replies"),
            "train_samples": stats.get("splits", {}).get("train", {}).get("samples"),
            "eval_samples": stats.get("splits", {}).get("eval", {}).get("samples"),
        },
        "cache": {"bytes": cache_bytes, "bytes_per_token": manifest.get("bytes_per_token"),
                  "storage_dtype": manifest.get("storage_dtype"), "compute_dtype": manifest.get("target_dtype"),
                  "throughput": manifest.get("throughput")},
        "train": {
            "steps": train_summary.get("steps"), "tokens": train_summary.get("tokens"),
            "seconds": train_summary.get("train_seconds"), "world_size": train_summary.get("world_size"),
            "draft_vocab_size": train_summary.get("draft_vocab_size"),
            "draft_vocab_coverage": train_summary.get("draft_vocab_coverage"),
            "compute_dtype": train_summary.get("compute_dtype"), "gflops": train_summary.get("gflops"),
            "tokens_per_s": train_summary.get("tokens_per_s"),
            "heldout_top1": {k: train_summary.get(f"val/step{k}/top1") for k in steps},
            "heldout_top3": {k: train_summary.get(f"val/step{k}/top3") for k in steps},
        },
        "eval": {"prompts": report.get("prompts"), "num_prompts": report.get("num_prompts"),
                 "max_new_tokens": report.get("settings", {}).get("max_new_tokens"), "methods": methods,
                 "dtype": report.get("settings", {}).get("dtype"),
                 "decode_dtype": report.get("settings", {}).get("decode_dtype"),
                 "head_decode_weights": report.get("settings", {}).get("head_decode_weights"),
                 "kv_cache_dtype": report.get("settings", {}).get("kv_cache_dtype"),
                 "machine": report.get("settings", {}).get("cpu_capability"),
                 "best": report.get("best", {}).get("method"), "best_k": _best_k(report),
                 "cost_curve": report.get("cost_curve")},
        "exports": exports,
        "run_dir": str(run_dir),
        "seconds": {k: round(v, 1) for k, v in timings.items()},
    }


def _best_k(report: dict) -> dict:
    """{draft name: the best k by measurement and, where the eval ran the cost curve, by its prediction, with the
    predicted and measured speedup of each} from the eval report."""
    overall = report.get("overall", {})
    best = {}
    for name, ks in (report.get("best_k") or {}).items():
        best[name] = {}
        for key in ("predicted", "measured"):
            if key in ks:
                r = overall.get(f"{name}@k={ks[key]}", {})
                best[name][key] = {"k": ks[key], "predicted_speedup": r.get("predicted_speedup"),
                                   "speedup": r.get("speedup")}
    return best


def _best_k_line(name: str, best: dict) -> str:
    """E.g. "best k by cost curve (mtp): 2 (predicted 1.31×, measured 1.28×); measured best: k = 3 (1.30×)", or
    without a cost curve "best k by measured speedup (mtp): 3 (1.30×)"."""
    by_curve, by_measurement = best.get("predicted"), best["measured"]
    if by_curve is None:
        return f"best k by measured speedup ({name}): {by_measurement['k']} ({_fmt(by_measurement['speedup'], '.2f')}×)"
    line = (f"best k by cost curve ({name}): {by_curve['k']} "
            f"(predicted {_fmt(by_curve['predicted_speedup'], '.2f')}×, measured {_fmt(by_curve['speedup'], '.2f')}×)")
    if by_measurement["k"] != by_curve["k"]:
        line += (f"; measured best: k = {by_measurement['k']} ({_fmt(by_measurement['speedup'], '.2f')}×, "
                 f"predicted {_fmt(by_measurement['predicted_speedup'], '.2f')}×)")
    return line


def _fmt(value, spec: str = ".3f") -> str:
    return "–" if value is None else format(value, spec)


def _markdown(summary: dict) -> str:
    from mtp_train.export.registry import get_format

    data, cache, train, ev = summary["data"], summary["cache"], summary["train"], summary["eval"]
    seconds = summary["seconds"]
    lines = [f"## Demo summary: {summary['recipe']}", "", "| | |", "|---|---|"]
    replies = (f"{data['regenerated']} replies regenerated by the target" if data["regenerated"]
               else "the dataset's own replies")
    lines.append(f"| data | {data['samples']} samples from {data['rows_read']} rows ({replies}); {data['tokens']} tokens, "
                 f"{data['assistant_tokens']} assistant; {data['train_samples']} train / {data['eval_samples']} "
                 "held-out |")
    lines.append(f"| feature cache | {cache['bytes'] / 2**20:.1f} MiB ({cache['storage_dtype']}, "
                 f"{_fmt(cache['bytes_per_token'], '.0f')} B/token) |")
    lines.append(f"| training | {train['steps']} steps, {train['tokens']} tokens, {_fmt(train['seconds'], '.0f')} s on "
                 f"{train['world_size']} rank(s); draft vocabulary {train['draft_vocab_size']} tokens "
                 f"(covers {_fmt(train['draft_vocab_coverage'], '.1%')} of the labels) |")
    top1 = ", ".join(f"step {k}: {_fmt(v, '.1%')}" for k, v in train["heldout_top1"].items())
    lines.append(f"| held-out top-1 per unroll step | {top1} |")
    throughput = cache.get("throughput") or {}
    if throughput.get("tokens_per_s") is not None:
        gflops = f", {throughput['gflops']:.1f} GFLOP/s" if throughput.get("gflops") is not None else ""
        lines.append(f"| precompute speed | {throughput['tokens_per_s']:.0f} tok/s in {cache['compute_dtype']}{gflops} |")
    if train.get("gflops") is not None:
        lines.append(f"| training speed | {_fmt(train.get('tokens_per_s'), '.0f')} tok/s, {train['gflops']:.1f} GFLOP/s "
                     f"in {train['compute_dtype']} |")
    lines.append("| stage times | " + ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items()) + " |")
    decode = (f"{ev['dtype']}, decode weights {ev['decode_dtype']}" if ev.get("decode_dtype") not in (None, ev["dtype"])
              else ev.get("dtype"))
    if ev.get("kv_cache_dtype") not in (None, ev.get("dtype")):
        decode += f", K/V cache {ev['kv_cache_dtype']}"
    if ev.get("head_decode_weights"):
        decode += f", the head's draft weights {ev['head_decode_weights']}"
    lines += ["", (f"Held-out prompts: {ev['num_prompts']} ({ev['prompts']}), ≤ {ev['max_new_tokens']} new tokens, "
                   f"greedy, batch 1, {decode}; {ev.get('machine')}."), "",
              "| method | τ | acceptance by position | tok/s | speedup vs plain | predicted by the cost curve |",
              "|---|---|---|---|---|---|"]
    for method, r in ev["methods"].items():
        acceptance = ", ".join(f"{a:.2f}" for a in r.get("acceptance_per_position") or [])
        best = " **(best)**" if method == ev["best"] else ""
        predicted = f"{r['predicted_speedup']:.2f}×" if r.get("predicted_speedup") is not None else ""
        lines.append(f"| {method}{best} | {_fmt(r['tau'])} | {acceptance} | {_fmt(r['tokens_per_s'], '.1f')} | "
                     f"{_fmt(r.get('speedup') or (1.0 if method == 'plain' else None), '.2f')}× | {predicted} |")
    curves = ev.get("cost_curve") or {}
    if curves:
        first = next(iter(curves.values()))
        verify = ", ".join(f"verify({n}) {ratio:.2f}" for n, ratio in first.get("verify_over_decode", {}).items())
        lines += ["", f"Cost curve (first prompt, {first.get('prompt_tokens')} tokens): decode "
                  f"{_fmt(first.get('decode_ms'), '.1f')} ms; {verify} decode steps; draft step per decode: "
                  + ", ".join(f"{name} {_fmt(c.get('draft_step_over_decode'), '.3f')}" for name, c in curves.items())
                  + "".join(f"; {name}'s greedy chain of k drafts in one call per decode: "
                            + ", ".join(f"k = {k} {r:.3f}" for k, r in c["chain_over_decode"].items())
                            for name, c in curves.items() if c.get("chain_over_decode"))
                  + ". Predicted speedup at k = τ(k) / (verify(k+1)/decode + drafting(k)/decode), drafting(k) = "
                  "the chain where timed, else k draft steps."]
    if ev.get("best_k"):
        lines += [""] + [f"- {_best_k_line(name, best)}" for name, best in ev["best_k"].items()]
    exports = summary["exports"]
    lines += ["", "| export format | result |", "|---|---|"]
    lines += [f"| {name} | {where} ({get_format(name).description}) |" for name, where in exports["written"].items()]
    lines += [f"| {name} | refused: {why} |" for name, why in exports["refused"].items()]
    if exports["vllm"]:
        lines += ["", f"Serve the head with vLLM (the `{exports['vllm_format']}` export; {exports['vllm_k']}):", "",
                  "```bash", exports["vllm"], "```", "",
                  f"Check it in vLLM against our eval: `make serve-check HEAD={summary['run_dir']}`."]
    else:
        lines += ["", "No export vLLM loads was written for this head (see the refusals above)."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
