#!/usr/bin/env python
"""Plain decode speed: our paged runtime vs transformers `generate`, same prompts, batch 1, greedy.

`--dtype auto` (default) runs ours as the pipeline does (`mtp-train env` shows the choice: on an AVX2-only CPU fp32
weights with bf16 copies for decode matmuls); transformers runs in the dtype our decode weights have.

Both decode exactly `--new-tokens` tokens per prompt (end-of-turn ignored) and are timed alternately, prompt by
prompt, in one process, so machine noise hits both alike. Prints a table and a final `RESULT` line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write a short story about a robot learning to paint.",
    "Explain the difference between TCP and UDP.",
    "Give me three tips for writing clean Python code.",
    "How do vaccines work?",
]


def load_prompts(path: Path | None, limit: int) -> list[str]:
    if path and path.is_file():
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [row["turns"][0] for row in rows if row.get("turns")][:limit]
    return DEFAULT_PROMPTS[:limit]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=None, help="model dir (default: fetched SmolLM2)")
    parser.add_argument("--prompts", type=Path, default=Path("../shared/data/eval/mt_bench.jsonl"))
    parser.add_argument("--num-prompts", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--quick", action="store_true", help="2 prompts, 32 tokens")
    args = parser.parse_args()
    if args.quick:
        args.num_prompts, args.new_tokens = 2, 32
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from mtp_train.assets import ensure_default_model
    from mtp_train.runtime.chat import encode_chat
    from mtp_train.runtime.generate import generate
    from mtp_train.runtime.loader import load_model, load_tokenizer

    target = Path(args.target) if args.target else ensure_default_model()
    from mtp_train.runtime.hardware import machine_fields
    from mtp_train.runtime.precision import resolve_precision

    precision = resolve_precision(args.dtype, "auto", "cpu")
    print(f"ours: {precision.describe()}")
    dtype = precision.decode_torch_dtype
    ours = load_model(target, device="cpu", precision=precision)
    tokenizer = load_tokenizer(target)
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=dtype).eval()
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": p}]) for p in load_prompts(args.prompts, args.num_prompts)]

    def run_ours(ids):
        start = time.perf_counter()
        results, _ = generate(ours, [ids], args.new_tokens)
        return len(results[0].token_ids), time.perf_counter() - start

    def run_hf(ids):
        start = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([ids]), max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False
            )
        return out.shape[1] - len(ids), time.perf_counter() - start

    run_ours(prompts[0][:8]), run_hf(prompts[0][:8])  # warm-up (allocator, oneDNN kernels)
    ours_tps, hf_tps = [], []
    print(f"{'prompt':>6} {'tokens':>6} {'ours tok/s':>10} {'HF tok/s':>9} {'ratio':>6}")
    for i, ids in enumerate(prompts):
        n_ours, t_ours = run_ours(ids)
        n_hf, t_hf = run_hf(ids)
        ours_tps.append(n_ours / t_ours)
        hf_tps.append(n_hf / t_hf)
        print(f"{i:>6} {n_ours:>6} {ours_tps[-1]:>10.1f} {hf_tps[-1]:>9.1f} {ours_tps[-1] / hf_tps[-1]:>6.2f}")
    ours_mean, hf_mean = statistics.mean(ours_tps), statistics.mean(hf_tps)
    ratio = statistics.median([o / h for o, h in zip(ours_tps, hf_tps)])
    print(f"mean: ours {ours_mean:.1f} tok/s, transformers {hf_mean:.1f} tok/s, median ratio {ratio:.2f}")
    print(
        f"RESULT ours_tok_s={ours_mean:.2f} hf_tok_s={hf_mean:.2f} ratio={ratio:.3f} "
        f"decode_dtype={precision.decode_dtype} hf_dtype={str(dtype).removeprefix('torch.')} new_tokens={args.new_tokens} "
        f"prompts={len(prompts)} threads={torch.get_num_threads()} {machine_fields(precision.dtype)}"
    )


if __name__ == "__main__":
    main()
