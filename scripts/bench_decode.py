#!/usr/bin/env python
"""Plain decode speed: our paged runtime vs transformers `generate`, same prompts, greedy, at batch 1 and batched.

`--dtype auto` (default) runs ours as the pipeline does (`mtp-train env` shows the choice: on an AVX2-only CPU fp32
weights with bf16 copies for the few-row decode matmuls, fp32 GEMMs above 16 rows); transformers runs in the dtype our
decode weights have (bf16 there), left-padded for batches.

Per batch size B (`--batch-sizes 1 8 32 64`): batch 1 times `--num-prompts` prompts one by one; B > 1 runs the first B
MT-bench first turns as one batch. Both decode exactly `--new-tokens` tokens per prompt (end-of-turn ignored); tokens/s
counts new tokens over the whole call (prefill included), ours and transformers timed alternately in one process, so
machine noise hits both alike. Ours also reports its decode-only tokens/s and the K/V bytes a decode step reads (our
attention reads each sequence's pages in place; nothing is gathered or copied). Prints a table and a final `RESULT`
line: `ratio_bB` = ours / transformers at batch B, `scaling_bB` = our tokens/s at B over ours at batch 1.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch


def load_prompts(name_or_path: str, limit: int) -> list[str]:
    """`limit` first turns of the prompt set (a built-in set's name or a JSONL path), cycled when it has fewer."""
    from mtp_train.evaluate.prompts import load_mt_bench

    texts = [prompt.turns[0] for prompt in load_mt_bench(name_or_path).prompts]
    return [texts[i % len(texts)] for i in range(limit)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=None, help="model dir (default: fetched SmolLM2)")
    parser.add_argument("--prompts", default="mt_bench",
                        help="built-in prompt set (mt_bench, humaneval, gsm8k) or MT-bench-format JSONL file")
    parser.add_argument("--num-prompts", type=int, default=5, help="prompts timed one by one at batch 1")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1], help="e.g. 1 8 32 64")
    parser.add_argument("--batch-new-tokens", type=int, default=None,
                        help="new tokens per prompt at batch > 1 (default: --new-tokens)")
    parser.add_argument("--no-hf", action="store_true", help="time ours only (no ratios)")
    parser.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--quick", action="store_true", help="2 prompts, 32 tokens (16 at batch > 1)")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_prompts, args.new_tokens = 2, 32
        args.batch_new_tokens = args.batch_new_tokens or 16
    return args


def main() -> None:
    args = parse_args()
    batch_new_tokens = args.batch_new_tokens or args.new_tokens
    user_messages = load_prompts(args.prompts, max(max(args.batch_sizes), args.num_prompts))
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from mtp_train.assets import ensure_default_model
    from mtp_train.runtime.chat import encode_chat
    from mtp_train.runtime.generate import generate
    from mtp_train.runtime.hardware import machine_fields
    from mtp_train.runtime.loader import load_model, load_tokenizer
    from mtp_train.runtime.precision import resolve_precision

    target = Path(args.target) if args.target else ensure_default_model()
    precision = resolve_precision(args.dtype, "auto", "cpu")
    print(f"ours: {precision.describe()}")
    dtype = precision.decode_torch_dtype
    ours = load_model(target, device="cpu", precision=precision)
    tokenizer = load_tokenizer(target)
    hf = None if args.no_hf else AutoModelForCausalLM.from_pretrained(target, dtype=dtype).eval()
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": text}]) for text in user_messages]
    c = ours.config
    kv_element = (ours.kv_cache_dtype or ours.dtype).itemsize
    kv_bytes_per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * kv_element

    def run_ours(batch: list[list[int]], new_tokens: int) -> tuple[int, float, float]:
        """(new tokens, seconds of the whole call, seconds of the decode steps)"""
        start = time.perf_counter()
        results, stats = generate(ours, batch, new_tokens)
        return sum(len(r.token_ids) for r in results), time.perf_counter() - start, stats.decode_seconds

    def run_hf(batch: list[list[int]], new_tokens: int) -> tuple[int, float]:
        width = max(len(ids) for ids in batch)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in batch])  # left-padded
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch])
        start = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(input_ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=pad)
        return (out.shape[1] - width) * len(batch), time.perf_counter() - start

    run_ours([prompts[0][:8]], 4)  # warm-up (allocator, kernels)
    if hf is not None:
        run_hf([prompts[0][:8]], 4)
    rows = []  # (batch, ours tok/s, ours decode tok/s, hf tok/s or None, K/V MB per decode step)
    print(f"{'batch':>5} {'tokens':>7} {'ours tok/s':>10} {'decode tok/s':>12} {'HF tok/s':>9} {'ratio':>6} "
          f"{'K/V MB/step':>11}")
    for batch_size in args.batch_sizes:
        if batch_size == 1:
            runs = [[ids] for ids in prompts[: args.num_prompts]]
            new_tokens = args.new_tokens
        else:
            runs = [prompts[:batch_size]]
            new_tokens = batch_new_tokens
        ours_tps, decode_tps, hf_tps = [], [], []
        for batch in runs:
            n_ours, t_ours, t_decode = run_ours(batch, new_tokens)
            ours_tps.append(n_ours / t_ours)
            decode_tps.append((n_ours - len(batch)) / t_decode if t_decode > 0 else 0.0)
            if hf is not None:
                n_hf, t_hf = run_hf(batch, new_tokens)
                hf_tps.append(n_hf / t_hf)
        # K/V read by the mid-generation decode step: every sequence's whole history, in place.
        mean_context = statistics.mean(len(ids) for batch in runs for ids in batch) + new_tokens / 2
        kv_mb = batch_size * mean_context * kv_bytes_per_token / 1e6
        row = (batch_size, statistics.mean(ours_tps), statistics.mean(decode_tps),
               statistics.mean(hf_tps) if hf_tps else None, kv_mb)
        rows.append(row)
        hf_text = f"{row[3]:>9.1f} {row[1] / row[3]:>6.2f}" if row[3] else f"{'-':>9} {'-':>6}"
        print(f"{batch_size:>5} {new_tokens:>7} {row[1]:>10.1f} {row[2]:>12.1f} {hf_text} {kv_mb:>11.1f}", flush=True)

    fields = []
    base = next((r for r in rows if r[0] == 1), None)
    for batch_size, tok_s, decode_tok_s, hf_tok_s, kv_mb in rows:
        suffix = "" if batch_size == 1 else f"_b{batch_size}"
        fields.append(f"ours_tok_s{suffix}={tok_s:.2f}")
        if batch_size != 1:
            fields.append(f"ours_decode_tok_s{suffix}={decode_tok_s:.2f}")
        if hf_tok_s:
            fields += [f"hf_tok_s{suffix}={hf_tok_s:.2f}", f"ratio{suffix}={tok_s / hf_tok_s:.3f}"]
        if base is not None and batch_size != 1:
            fields.append(f"scaling{suffix}={tok_s / base[1]:.2f}")
            fields.append(f"decode_scaling{suffix}={decode_tok_s / base[2]:.2f}")
        fields.append(f"kv_mb_step{suffix}={kv_mb:.1f}")
    print(
        f"RESULT {' '.join(fields)} decode_dtype={precision.decode_dtype} hf_dtype={str(dtype).removeprefix('torch.')} "
        f"new_tokens={args.new_tokens} batch_new_tokens={batch_new_tokens} prompts={args.num_prompts} "
        f"threads={torch.get_num_threads()} {machine_fields(precision.dtype)}"
    )


if __name__ == "__main__":
    main()
