#!/usr/bin/env python
"""Speculative decoding speed on MT-bench prompts, SmolLM2 in the dtypes `auto` picks here (`--dtype`), batch 1,
greedy, in one process:
transformers `generate`, transformers prompt-lookup generation, our plain decode, our MTP speculative decode
(k = 1..4) and our prompt lookup; tokens/s and ratios to transformers `generate`, τ, and a cost profile (target
decode step, target verify of k+1 tokens, one head step). Ends with a `RESULT` line."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=None)
    parser.add_argument("--head", default="runs/smollm2-135m-mtp/head", help="trained head (else an untrained one)")
    parser.add_argument("--prompts", type=Path, default=Path("../shared/data/eval/mt_bench.jsonl"))
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16")
    parser.add_argument("--quick", action="store_true", help="2 prompts, 48 tokens, k = 1 and 3")
    args = parser.parse_args()
    if args.quick:
        args.num_prompts, args.new_tokens, args.ks = 2, 48, [1, 3]
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from mtp_train.assets import ensure_default_model
    from mtp_train.export.load import load_any_head
    from mtp_train.heads import DraftHead, HeadConfig
    from mtp_train.runtime.chat import encode_chat, stop_token_ids
    from mtp_train.runtime.generate import generate
    from mtp_train.runtime.loader import load_model, load_tokenizer
    from mtp_train.runtime.spec import PromptLookup, speculative_generate
    from mtp_train.runtime.spec.costs import head_step_seconds, target_step_seconds

    target_dir = Path(args.target) if args.target else ensure_default_model()
    from mtp_train.runtime.hardware import machine_fields
    from mtp_train.runtime.precision import apply_decode_weights, resolve_precision

    precision = resolve_precision(args.dtype, "auto", "cpu")
    print(f"ours: {precision.describe()}; transformers: {precision.decode_dtype}")
    ours = load_model(target_dir, device="cpu", precision=precision)
    tokenizer = load_tokenizer(target_dir)
    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=precision.decode_torch_dtype).eval()
    if Path(args.head).is_dir():
        head, head_label = load_any_head(args.head, ours, dtype=ours.dtype), args.head
    else:
        head = DraftHead.from_target(ours, HeadConfig.for_target(ours.config, ours.fingerprint, kind="mtp"))
        head_label = "untrained random-init head (no --head found)"
    head = apply_decode_weights(head, precision)
    rows = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": r["turns"][0]}]) for r in rows[: args.num_prompts]]
    stops = stop_token_ids(tokenizer, ours.config)
    eos = list(stops)

    def hf_run(ids, lookup: bool):
        kwargs = dict(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=eos)
        if lookup:
            kwargs["prompt_lookup_num_tokens"] = 10
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), **kwargs)
        return out.shape[1] - len(ids)

    contenders = {
        "hf_generate": lambda ids: (hf_run(ids, False), None),
        "hf_prompt_lookup": lambda ids: (hf_run(ids, True), None),
        "ours_plain": lambda ids: (len(generate(ours, [ids], args.new_tokens, stop_token_ids=stops)[0][0].token_ids), None),
    }
    for k in args.ks:
        contenders[f"ours_mtp_k{k}"] = lambda ids, k=k: _spec(speculative_generate(ours, head, [ids], args.new_tokens, k,
                                                                                    stop_token_ids=stops))
    contenders["ours_lookup_k3"] = lambda ids: _spec(speculative_generate(ours, PromptLookup(), [ids], args.new_tokens,
                                                                            3, stop_token_ids=stops))
    for fn in contenders.values():  # warm-up
        fn(prompts[0][:12])
    totals = {name: [0, 0.0, 0, 0] for name in contenders}  # tokens, seconds, target forwards, spec tokens
    for ids in prompts:
        for name, fn in contenders.items():  # interleaved: noise hits every contender alike
            start = time.perf_counter()
            tokens, stats = fn(ids)
            totals[name][0] += tokens
            totals[name][1] += time.perf_counter() - start
            if stats is not None:
                totals[name][2] += stats.target_sequence_forwards
                totals[name][3] += stats.new_tokens
    base = totals["hf_generate"][0] / totals["hf_generate"][1]
    plain = totals["ours_plain"][0] / totals["ours_plain"][1]
    print(f"head: {head_label}; {len(prompts)} MT-bench prompts, <= {args.new_tokens} new tokens, batch 1, greedy")
    print(f"{'contender':18s} {'tok/s':>8s} {'vs HF':>6s} {'vs plain':>8s} {'tau':>6s}")
    result = {}
    for name, (tokens, seconds, forwards, spec_tokens) in totals.items():
        tps = tokens / seconds
        tau = spec_tokens / forwards if forwards else float("nan")
        print(f"{name:18s} {tps:8.1f} {tps / base:6.2f} {tps / plain:8.2f} {tau:6.2f}")
        result[name] = (tps, tau)

    # Cost profile: what one target decode step, one verify of k+1 tokens and one head step cost.
    target_seconds = target_step_seconds(ours, prompts[0], [1] + [k + 1 for k in args.ks], repeats=10)
    decode = target_seconds[1]
    profile = {f"verify{k + 1}": target_seconds[k + 1] / decode for k in args.ks}
    head_cost = head_step_seconds(ours, head, prompts[0], repeats=10) / decode
    print("cost relative to one target decode step: " + ", ".join(f"{k}={v:.2f}" for k, v in profile.items()) +
          f", head step (with vocab projection)={head_cost:.2f}")
    best = max((n for n in result if n.startswith("ours_mtp")), key=lambda n: result[n][0])
    print(f"RESULT hf_tok_s={base:.2f} ours_plain_tok_s={plain:.2f} plain_vs_hf={plain / base:.3f} "
          f"hf_lookup_vs_hf={result['hf_prompt_lookup'][0] / base:.3f} best_mtp={best} "
          f"best_mtp_vs_plain={result[best][0] / plain:.3f} best_mtp_vs_hf={result[best][0] / base:.3f} "
          f"best_mtp_tau={result[best][1]:.3f} lookup_tau={result['ours_lookup_k3'][1]:.3f} "
          + " ".join(f"{n}_tok_s={v[0]:.2f}" for n, v in result.items() if n.startswith("ours_mtp"))
          + f" head_step_cost={head_cost:.3f} " + " ".join(f"{k}_cost={v:.3f}" for k, v in profile.items())
          + f" decode_dtype={precision.decode_dtype} decode_max_rows={precision.decode_max_rows} "
          + machine_fields(precision.dtype))


def _spec(outcome):
    results, stats = outcome
    return len(results[0].token_ids), stats


if __name__ == "__main__":
    main()
