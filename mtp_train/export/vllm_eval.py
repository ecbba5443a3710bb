"""Acceptance measured in vLLM (`mtp-train eval --engine vllm|both`): the number a user deploying to vLLM needs.

The head is exported in the format vLLM loads for its kind (an MTP head as `vllm-mtp`, over the full vocabulary
where it was trained with a reduced one, since vLLM's MiMo-MTP has no draft vocabulary; an EAGLE-3 head as `eagle3`,
keeping its draft vocabulary; an EAGLE-1 head as `eagle`), then vLLM decodes the eval prompts greedily, batch 1, once
plainly and once per k with the export as its speculative draft, each in an engine of its own
(`vllm_engine.engine.VllmWorker`). From vLLM's spec-decode counters: the mean acceptance length (1 + accepted /
drafts: vLLM's τ, tokens per target forward) and each position's acceptance (accepted at j / drafts); from the
wall time of each prompt's generate call: tokens/s and the speedup over vLLM's plain decoding; and whether the
speculative output equals the plain output prompt by prompt (it must, greedy, up to the engine's numerics)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mtp_train.errors import UserError
from mtp_train.export.exporter import export_head
from mtp_train.export.registry import get_format
from mtp_train.export.vllm_serving import VLLM_FORMATS, vllm_serve_arguments, vllm_serve_command
from mtp_train.heads.io import read_head_config
from mtp_train.vllm_engine.engine import VllmWorker


def acceptance_from_counters(metrics: dict[str, Any], k: int) -> tuple[float, list[float], int]:
    """(mean acceptance length, acceptance per position, drafts) from vLLM's spec-decode counters: 1 + accepted /
    drafts, and accepted at position j / drafts (every draft proposes k tokens; position j's token counts when 1..j
    all are accepted)."""
    drafts = float(metrics.get("vllm:spec_decode_num_drafts") or 0)
    accepted = float(metrics.get("vllm:spec_decode_num_accepted_tokens") or 0)
    per_position = list(metrics.get("vllm:spec_decode_num_accepted_tokens_per_pos") or [0] * k)[:k]
    if not drafts:
        return 1.0, [0.0] * k, 0
    return 1.0 + accepted / drafts, [float(a) / drafts for a in per_position], int(drafts)


def _run(target_dir: str, dtype: str, prompts: list[list[int]], max_new_tokens: int, stops: list[int],
         work_dir: Path, python: str | None, engine_args: dict, speculative: dict | None = None,
         hf_overrides: dict | None = None) -> dict[str, Any]:
    """One engine: the prompts decoded greedily one at a time; outputs, seconds per prompt, spec-decode counters."""
    settings = {"mode": "generate", "model": str(Path(target_dir).resolve()), "dtype": dtype,
                "speculative_config": speculative, "hf_overrides": hf_overrides, "engine_args": engine_args}
    with VllmWorker(settings, work_dir, python) as worker:
        reply = worker.request({"op": "generate", "prompts": prompts, "max_new_tokens": max_new_tokens,
                                "stop_token_ids": stops})
        metrics = worker.request({"op": "metrics"}, "metrics") if speculative else {}
        return {"outputs": reply["outputs"], "seconds": reply["seconds"], "metrics": metrics, "info": worker.info}


def evaluate_in_vllm(head_dir: str | Path, target_dir: str, prompts: list[list[int]], stops: list[int], ks: list[int],
                     max_new_tokens: int, work_dir: Path, dtype: str = "auto", python: str | None = None,
                     engine_args: dict | None = None, show=print) -> dict[str, Any]:
    """The report's `vllm` section for the native head at `head_dir` (see the module docstring). `work_dir` receives
    the export and each engine's log."""
    head_config = read_head_config(head_dir)
    if head_config.kind not in VLLM_FORMATS:
        raise UserError(f"{head_dir}: no vLLM format serves a {head_config.kind} head")
    fmt, method = VLLM_FORMATS[head_config.kind]
    full_vocab = get_format(fmt).draft_vocab is None and head_config.draft_vocab_size is not None
    work_dir.mkdir(parents=True, exist_ok=True)
    export_dir = export_head(head_dir, fmt, work_dir / "export", target_dir, dtype="float32", overwrite=True,
                             num_speculative_tokens=max(ks))
    engine_args = {"max_model_len": max(len(p) for p in prompts) + max_new_tokens + max(ks) + 8,
                   **(engine_args or {})}
    show(f"eval (vLLM): {len(prompts)} prompts, plain and k = {', '.join(map(str, ks))}, one engine each; "
         f"the head exported as {fmt}{' over the full vocabulary' if full_vocab else ''} to {export_dir}")
    plain = _run(target_dir, dtype, prompts, max_new_tokens, stops, work_dir / "plain", python, engine_args)
    plain_tokens = sum(len(o) for o in plain["outputs"])
    plain_rate = plain_tokens / max(sum(plain["seconds"]), 1e-9)
    methods: dict[str, Any] = {}
    serve = None
    for k in ks:
        serve = vllm_serve_arguments(head_config.kind, str(export_dir), target_dir, k)
        speculative, overrides = serve["speculative_config"], serve["hf_overrides"]
        run = _run(target_dir, dtype, prompts, max_new_tokens, stops, work_dir / f"{method}-k{k}", python,
                   engine_args, speculative, overrides)
        tau, per_position, drafts = acceptance_from_counters(run["metrics"], k)
        tokens = sum(len(o) for o in run["outputs"])
        rate = tokens / max(sum(run["seconds"]), 1e-9)
        differing = [i for i, (a, b) in enumerate(zip(run["outputs"], plain["outputs"])) if a != b]
        methods[f"{head_config.kind}@k={k}"] = {
            "k": k, "tau": round(tau, 4), "acceptance_per_position": [round(a, 4) for a in per_position],
            "drafts": drafts, "new_tokens": tokens, "tokens_per_s": round(rate, 2),
            "speedup": round(rate / plain_rate, 4) if plain_rate else None,
            "outputs_identical_to_plain": not differing, "prompts_differing": differing}
        show(f"eval (vLLM): {head_config.kind}@k={k}: τ {tau:.3f}, acceptance "
             f"{', '.join(f'{a:.2f}' for a in per_position)}, {rate:.1f} tok/s ({rate / plain_rate:.2f}× plain), "
             f"output {'identical to plain' if not differing else f'differs on {len(differing)} prompt(s)'}")
    best = max(methods.items(), key=lambda item: item[1]["speedup"] or 0)
    return {
        "engine": "vllm", "vllm_version": plain["info"].get("vllm"), "device": plain["info"].get("device"),
        "dtype": plain["info"].get("dtype"), "export": {"format": fmt, "dir": str(export_dir), "full_vocab": full_vocab},
        "prompts": len(prompts), "max_new_tokens": max_new_tokens,
        "plain": {"new_tokens": plain_tokens, "tokens_per_s": round(plain_rate, 2)},
        "methods": methods, "best": {"method": best[0], **best[1]},
        "serve": serve,
    }


def markdown_lines(section: dict[str, Any]) -> list[str]:
    """The report.md section of `evaluate_in_vllm`'s result."""
    lines = [f"## vLLM {section['vllm_version']} ({section['device']}, {section['dtype']})", "",
             f"The head exported as `{section['export']['format']}`"
             + (" over the full vocabulary" if section["export"]["full_vocab"] else "")
             + f" ({section['export']['dir']}); {section['prompts']} prompts, ≤ {section['max_new_tokens']} new tokens, "
             "greedy, batch 1, one engine per row.", "",
             "| method | τ (mean acceptance length) | acceptance by position | tok/s | speedup vs vLLM plain | "
             "output = plain |", "|---|---|---|---|---|---|",
             f"| plain | 1.000 |  | {section['plain']['tokens_per_s']:.1f} | 1.00× | |"]
    for name, row in section["methods"].items():
        same = "yes" if row["outputs_identical_to_plain"] else f"no ({len(row['prompts_differing'])} prompts)"
        lines.append(f"| {name} | {row['tau']:.3f} | {', '.join(f'{a:.2f}' for a in row['acceptance_per_position'])} "
                     f"| {row['tokens_per_s']:.1f} | {row['speedup']:.2f}× | {same} |")
    lines += ["", "Served as (the last k):", "", "```bash", vllm_serve_command(section["serve"]), "```"]
    return lines
