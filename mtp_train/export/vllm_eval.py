"""Acceptance measured in vLLM (`mtp-train eval --engine vllm|both`): the number a user deploying to vLLM needs.

The head is exported in the format vLLM loads for its kind (an MTP head as `vllm-mtp`, over the full vocabulary
where it was trained with a reduced one, since vLLM's MiMo-MTP has no draft vocabulary; an EAGLE-3 head as `eagle3`,
keeping its draft vocabulary; an EAGLE-1 head as `eagle`), then vLLM decodes the eval prompts greedily, batch 1, once
plainly and once per k with the export as its speculative draft, each in an engine of its own
(`vllm_engine.engine.VllmWorker`). From vLLM's spec-decode counters: the mean acceptance length (1 + accepted /
drafts: vLLM's τ, tokens per target forward) and each position's acceptance (accepted at j / drafts); from the
wall time of each prompt's generate call: tokens/s and the speedup over vLLM's plain decoding; and whether the
speculative output equals the plain output prompt by prompt (it must, greedy, up to the engine's numerics).

Where it does not, the report says where and why, measured in vLLM itself, in the vocabulary of our own engine's
`evaluate.margins.Divergence`: the plain run's top-1/top-2 logprobs at the first differing token give the decode's
margin between the plain token and the speculative one; the same step scored in one prefill of the prompt and the
shared tokens (vLLM's `prompt_logprobs`: the numerics of a multi-token forward, as a verify is) moves the two
tokens' logprobs by the path's measured rounding. A margin ≤ SAFETY_FACTOR × that rounding, or a prefill that itself
picks the speculative token, is a near-tie of the engine's numerics; anything else is a fault, said loudly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mtp_train.errors import UserError
from mtp_train.evaluate.margins import SAFETY_FACTOR, Divergence, first_divergence
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


DECODE_LOGPROBS = 2  # the plain run's logprobs per new token: its top 2, the margin a divergence is measured by


def _run(target_dir: str, dtype: str, prompts: list[list[int]], max_new_tokens: int, stops: list[int],
         work_dir: Path, python: str | None, engine_args: dict, speculative: dict | None = None,
         hf_overrides: dict | None = None, logprobs: dict | None = None) -> dict[str, Any]:
    """One engine: the prompts decoded greedily one at a time; outputs, seconds per prompt, spec-decode counters;
    with `logprobs` ({"logprobs": n} and/or {"prompt_logprobs": n}) the generate reply's logprobs too."""
    settings = {"mode": "generate", "model": str(Path(target_dir).resolve()), "dtype": dtype,
                "speculative_config": speculative, "hf_overrides": hf_overrides, "engine_args": engine_args}
    with VllmWorker(settings, work_dir, python) as worker:
        reply = worker.request({"op": "generate", "prompts": prompts, "max_new_tokens": max_new_tokens,
                                "stop_token_ids": stops, **(logprobs or {})})
        metrics = worker.request({"op": "metrics"}, "metrics") if speculative else {}
        return {**reply, "metrics": metrics, "info": worker.info}


def find_divergences(plain_outputs: list[list[int]], spec_outputs: list[list[int]]) -> list[dict[str, Any]]:
    """Each prompt whose speculative output differs from the plain one: {prompt, position (the first differing new
    token), plain_token, spec_token} (a token None where that output had already ended)."""
    found = []
    for prompt, (plain, spec) in enumerate(zip(plain_outputs, spec_outputs)):
        position = first_divergence(plain, spec)
        if position is not None:
            found.append({"prompt": prompt, "position": position,
                          "plain_token": plain[position] if position < len(plain) else None,
                          "spec_token": spec[position] if position < len(spec) else None})
    return found


def classify_divergence(decode: dict[int, float], prefill: dict[int, float], plain_token: int,
                        spec_token: int) -> dict[str, Any]:
    """Why greedy speculative decoding picked `spec_token` where plain decoding picked `plain_token`, from vLLM's
    logprobs at that step: `decode` those of the plain run's decode step (its top 2: the plain token first), `prefill`
    those of the same step scored in one prefill (both tokens, and its own best). The margin is the decode's
    logprob of the plain token minus the speculative one's (where the speculative token is not in the decode's
    top 2, the top-1/top-2 margin: a lower bound); the rounding the largest |Δ logprob| of the two tokens between
    the paths. A near-tie (margins.Divergence.is_tie) when margin ≤ SAFETY_FACTOR × rounding, or when the prefill
    itself picks the speculative token; else a fault."""
    runner_up = spec_token if spec_token in decode else max((t for t in decode if t != plain_token), key=decode.get)
    margin = decode[plain_token] - decode[runner_up]
    rounding = max(abs(prefill[t] - decode[t]) for t in (plain_token, spec_token) if t in decode and t in prefill)
    prefill_argmax = max(prefill, key=prefill.get)
    tie = Divergence(0, margin, rounding).is_tie or prefill_argmax == spec_token
    return {"margin": round(margin, 5), "margin_is_lower_bound": runner_up != spec_token,
            "rounding": round(rounding, 5), "prefill_argmax": prefill_argmax,
            "verdict": "near-tie" if tie else "fault"}


def _prefill_logprobs(target_dir: str, dtype: str, sequences: list[list[int]], stops: list[int], work_dir: Path,
                      python: str | None, engine_args: dict) -> list[dict[int, float]]:
    """vLLM's plain engine scoring each sequence in one prefill: the logprobs of its last token and of the
    prefill's own best token at that position ({token: logprob})."""
    run = _run(target_dir, dtype, sequences, 1, stops, work_dir, python, engine_args, logprobs={"prompt_logprobs": 1})
    return [{token: logprob for token, logprob in positions[-1]} for positions in run["prompt_logprobs"]]


def explain_divergences(divergences: list[dict[str, Any]], prompts: list[list[int]], plain: dict[str, Any],
                        target_dir: str, dtype: str, stops: list[int], work_dir: Path, python: str | None,
                        engine_args: dict) -> None:
    """Adds to each of `divergences` (every method's `find_divergences`) the two tokens' text, the plain decode's
    margin and the decode/prefill rounding at that step and its verdict (`classify_divergence`), the prefills run
    in one more plain engine (in `work_dir`). A divergence where one output had ended has no tokens to compare: a
    fault."""
    from mtp_train.runtime.loader import load_tokenizer

    def shared(d: dict[str, Any]) -> list[int]:  # the prompt and the new tokens both outputs agree on
        return prompts[d["prompt"]] + plain["outputs"][d["prompt"]][: d["position"]]

    comparable = [d for d in divergences if d["plain_token"] is not None and d["spec_token"] is not None]
    sequences = sorted({tuple(shared(d) + [token])
                        for d in comparable for token in (d["plain_token"], d["spec_token"])})
    scored = dict(zip(sequences, _prefill_logprobs(target_dir, dtype, [list(s) for s in sequences], stops, work_dir,
                                                    python, engine_args))) if sequences else {}
    tokenizer = load_tokenizer(target_dir)
    for d in divergences:
        d.update(plain_text=None if d["plain_token"] is None else tokenizer.decode([d["plain_token"]]),
                 spec_text=None if d["spec_token"] is None else tokenizer.decode([d["spec_token"]]))
        if d["plain_token"] is None or d["spec_token"] is None:
            d.update(margin=None, margin_is_lower_bound=False, rounding=None, prefill_argmax=None, verdict="fault")
            continue
        prefill = {**scored[tuple(shared(d) + [d["plain_token"]])], **scored[tuple(shared(d) + [d["spec_token"]])]}
        decode = {token: logprob for token, logprob in plain["logprobs"][d["prompt"]][d["position"]]}
        d.update(classify_divergence(decode, prefill, d["plain_token"], d["spec_token"]))


def describe_divergence(method: str, d: dict[str, Any]) -> str:
    """One divergence in a sentence (the report's line under the table, and what eval prints)."""
    where = f"{method}, prompt {d['prompt']}: parts from plain at new token {d['position']}"
    if d["margin"] is None:
        ended = "plain" if d["plain_token"] is None else "speculative"
        return f"{where}, where the {ended} output had ended: a FAULT"
    tokens = f"(plain {d['plain_text']!r} = {d['plain_token']}, speculative {d['spec_text']!r} = {d['spec_token']})"
    figures = (f"decode margin {'≥ ' if d['margin_is_lower_bound'] else ''}{d['margin']:.4f} against a rounding of "
               f"{d['rounding']:.4f} between vLLM's decode and a prefill")
    if d["verdict"] == "near-tie":
        because = ("the prefill itself picks the speculative token" if d["prefill_argmax"] == d["spec_token"] else
                   f"margin ≤ {SAFETY_FACTOR:g} × rounding")
        return f"{where} {tokens}: {figures} (a near-tie: {because})"
    return f"{where} {tokens}: {figures} (NOT a near-tie: a FAULT)"


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
    plain = _run(target_dir, dtype, prompts, max_new_tokens, stops, work_dir / "plain", python, engine_args,
                 logprobs={"logprobs": DECODE_LOGPROBS})
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
        divergences = find_divergences(plain["outputs"], run["outputs"])
        differing = [d["prompt"] for d in divergences]
        methods[f"{head_config.kind}@k={k}"] = {
            "k": k, "tau": round(tau, 4), "acceptance_per_position": [round(a, 4) for a in per_position],
            "drafts": drafts, "new_tokens": tokens, "tokens_per_s": round(rate, 2),
            "speedup": round(rate / plain_rate, 4) if plain_rate else None,
            "outputs_identical_to_plain": not differing, "prompts_differing": differing, "divergences": divergences}
        show(f"eval (vLLM): {head_config.kind}@k={k}: τ {tau:.3f}, acceptance "
             f"{', '.join(f'{a:.2f}' for a in per_position)}, {rate:.1f} tok/s ({rate / plain_rate:.2f}× plain), "
             f"output {'identical to plain' if not differing else f'differs on {len(differing)} prompt(s)'}")
    every_divergence = [d for row in methods.values() for d in row["divergences"]]
    if every_divergence:
        show(f"eval (vLLM): {len(every_divergence)} speculative output(s) part from plain; scoring those steps in one "
             "prefill each (one more plain engine) to tell near-ties of vLLM's numerics from faults")
        explain_divergences(every_divergence, prompts, plain, target_dir, dtype, stops, work_dir / "plain-prefill",
                            python, engine_args)
        for name, row in methods.items():
            for d in row["divergences"]:
                show(f"eval (vLLM): {'FAULT: ' if d['verdict'] == 'fault' else ''}{describe_divergence(name, d)}")
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
        lines.append(f"| {name} | {row['tau']:.3f} | {', '.join(f'{a:.2f}' for a in row['acceptance_per_position'])} "
                     f"| {row['tokens_per_s']:.1f} | {row['speedup']:.2f}× | {_same_cell(row)} |")
    lines += divergence_lines(section["methods"])
    lines += ["", "Served as (the last k):", "", "```bash", vllm_serve_command(section["serve"]), "```"]
    return lines


def _same_cell(row: dict[str, Any]) -> str:
    """The table's "output = plain" cell: yes, or how many prompts part and how many of those are faults."""
    if row["outputs_identical_to_plain"]:
        return "yes"
    faults = sum(d.get("verdict") == "fault" for d in row.get("divergences", []))
    return (f"no ({len(row['prompts_differing'])} prompts; "
            + (f"**{faults} FAULT{'S' if faults > 1 else ''}**" if faults else "near-ties") + ")")


def divergence_lines(methods: dict[str, Any]) -> list[str]:
    """Under the table: how a divergence is judged, then one line per divergence (none where all are identical)."""
    lines = [f"- {describe_divergence(name, d)}" for name, row in methods.items() for d in row.get("divergences", [])]
    if not lines:
        return []
    return ["", "Where a speculative output parts from plain: at its first differing token, the plain decode's "
            "logprob margin between the two tokens against the rounding between vLLM's decode and a prefill of the "
            "same prefix (the larger |Δ logprob| of the two tokens); a near-tie of vLLM's numerics when the margin is "
            f"≤ {SAFETY_FACTOR:g} × the rounding or the prefill itself picks the speculative token, else a fault.",
            "", *lines]
