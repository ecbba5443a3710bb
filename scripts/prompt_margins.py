#!/usr/bin/env python
"""Is a prompt's greedy answer the same on every precision path? The top-1/top-2 logit margin of each step of its
greedy answer (transformers in fp32) against how far each of our precision paths moves those logits.

For each prompt (chat template applied, as `mtp-train generate` does): transformers' fp32 greedy answer (up to
`--max-new-tokens`, the stop token included), then its logits at every answer position (teacher-forced). For each
path, our runtime decodes that same answer as `generate` does (a paged prefill of the prompt, then one decode step per
token: the rows the decode kernels serve) and gives its logits at the same positions. Per step: the reference margin
(top-1 minus top-2 logit) and the path's error (largest |Δlogit| over the vocabulary). A step is *safe* on a path
when margin > 2 × error (no rounding of that size can swap the two); the figure per prompt and path is the smallest
margin / error over the steps (safe above 2), and each path's own greedy answer is decoded too.

The paths: `fp32` (weights, activations and K/V in fp32), `auto` (what `precision.compute: auto` and
`precision.decode: auto` pick on this machine), `bf16` (a bf16 model: what a native-bf16 CPU whose probe prefers
torch's bf16 matmuls runs, and a GPU), `int8` (int8 decode weights, `precision.decode: int8`). Run it again as an
AVX2-only CPU with `MTP_TRAIN_CPU_AS=avx2`. The last line is `RESULT key=value ...`.

    python scripts/prompt_margins.py --prompt "What is the capital of France?"
    python scripts/prompt_margins.py --prompts-file my_prompts.txt --max-new-tokens 32
    MTP_TRAIN_CPU_AS=avx2 python scripts/prompt_margins.py --prompt "..."
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PATHS = ("fp32", "auto", "bf16", "int8")


def path_precisions():
    from mtp_train.runtime.precision import resolve_precision

    return {
        "fp32": resolve_precision("float32", "float32", "cpu", kv_cache_dtype="float32"),
        "auto": resolve_precision("auto", "auto", "cpu"),
        "bf16": resolve_precision("bfloat16", "bfloat16", "cpu"),
        "int8": resolve_precision("auto", "int8", "cpu"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", action="append", default=None, help="a user message (repeatable)")
    parser.add_argument("--prompts-file", default=None, help="one user message per line")
    parser.add_argument("--model", default=str(REPO / "data" / "models" / "smollm2-135m-instruct"))
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of {', '.join(PATHS)}")
    parser.add_argument("--reference-only", action="store_true",
                        help="only transformers' fp32 answers and margins (fast: for screening many prompts)")
    args = parser.parse_args()
    prompts = list(args.prompt or [])
    if args.prompts_file:
        prompts += [line for line in Path(args.prompts_file).read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        parser.error("give --prompt TEXT (repeatable) or --prompts-file FILE")
    paths = [p for p in args.paths.split(",") if p]
    if unknown := set(paths) - set(PATHS):
        parser.error(f"--paths: unknown {sorted(unknown)}; expected some of {', '.join(PATHS)}")

    import torch
    from transformers import AutoModelForCausalLM

    from mtp_train.evaluate.margins import SAFETY_FACTOR, MarginCheck, decode_logits, reference_answer, top2_margins
    from mtp_train.runtime.chat import encode_chat, stop_token_ids
    from mtp_train.runtime.config import load_config
    from mtp_train.runtime.generate import generate
    from mtp_train.runtime.hardware import cpu_facts, machine_fields
    from mtp_train.runtime.loader import load_model, load_tokenizer

    tokenizer = load_tokenizer(args.model)
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    stops = stop_token_ids(tokenizer, load_config(args.model))
    precisions = {} if args.reference_only else {p: path_precisions()[p] for p in paths}
    print(f"machine: {cpu_facts().describe()}")
    for name, precision in precisions.items():
        print(f"  {name}: {precision.describe()}")
    models = {name: load_model(args.model, device="cpu", precision=precision) for name, precision in precisions.items()}

    worst: dict[str, float] = {name: float("inf") for name in models}
    smallest_margin, all_same = float("inf"), True
    for text in prompts:
        prompt_ids = encode_chat(tokenizer, [{"role": "user", "content": text}], args.model)
        answer_ids, reference = reference_answer(hf, prompt_ids, args.max_new_tokens, stops)
        margins = top2_margins(reference).tolist()
        low = min(range(len(margins)), key=margins.__getitem__)
        smallest_margin = min(smallest_margin, margins[low])
        answer = tokenizer.decode(answer_ids, skip_special_tokens=True)
        ended = "stop" if answer_ids[-1] in stops else "length"
        print(f"\n{text!r}\n  fp32 answer ({len(answer_ids)} tokens, {ended}): {answer!r}")
        print(f"  smallest margin {margins[low]:.3f} at step {low} (token {tokenizer.decode([answer_ids[low]])!r})")
        for name, model in models.items():
            logits = decode_logits(model, prompt_ids, answer_ids)  # [steps, vocab]
            check = MarginCheck.of(reference, logits)
            # the path's own margin for the reference's token at each step (negative: it picks another)
            chosen = torch.tensor(answer_ids)[:, None]
            own_margin = float((logits.gather(-1, chosen).squeeze(-1)
                                - logits.scatter(-1, chosen, float("-inf")).amax(-1)).min())
            results, _ = generate(model, [prompt_ids], args.max_new_tokens, stop_token_ids=stops)
            same = results[0].token_ids == answer_ids
            all_same &= same
            worst[name] = min(worst[name], check.smallest_ratio)
            safe = "safe" if check.smallest_ratio > SAFETY_FACTOR else "NOT SAFE"
            print(f"  {name:5} {check.describe()} ({safe}); its own smallest margin {own_margin:.3f}; greedy answer "
                  + ("the same" if same else
                     f"DIFFERS: {tokenizer.decode(results[0].token_ids, skip_special_tokens=True)!r}"))
    fields = {f"{name}_min_margin_over_error": f"{value:.2f}" for name, value in worst.items()}
    fields.update(prompts=str(len(prompts)), smallest_margin=f"{smallest_margin:.3f}")
    if models:
        fields["answers_same"] = str(all_same).lower()
    print("RESULT " + " ".join(f"{k}={v}" for k, v in fields.items()) + " " + machine_fields("auto"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
