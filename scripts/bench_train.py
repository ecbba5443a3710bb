#!/usr/bin/env python
"""Training step cost of the logit-distillation loss: chunked vocabulary logits vs naive full-vocab logits.

Each contender runs in its own child process (so peak memory is its own): the real default target's frozen
embeddings/lm_head, an MTP head, `--steps` optimizer steps of the k-step unrolled loss on micro-batches of
`--tokens` tokens (real features when the default cache exists, else random target states). Prints tokens/s and the
peak resident-memory growth over the loaded baseline, with ratios. Ends with a `RESULT` line.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def child(args) -> None:
    import torch

    from mtp_train.assets import ensure_default_model
    from mtp_train.heads import DraftHead, HeadConfig
    from mtp_train.runtime.loader import load_model
    from mtp_train.train.losses import unrolled_losses

    if args.malloc == "tuned":
        from mtp_train.runtime.cpu import tune_malloc

        tune_malloc()
    torch.manual_seed(0)
    from mtp_train.runtime.hardware import measure_matmul_gflops
    from mtp_train.runtime.precision import resolve_precision

    precision = resolve_precision(args.dtype, "auto", "cpu", phases=("prefill",))
    target = load_model(ensure_default_model(), dtype=precision.dtype, device="cpu")
    head = DraftHead.from_target(target, HeadConfig.for_target(target.config, kind="mtp"), dtype=precision.torch_dtype)
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-4)
    lengths = [512] * (args.tokens // 512)
    total = sum(lengths)
    token_ids = torch.randint(0, target.config.vocab_size, (total,))
    from mtp_train.runtime.attention import BatchInfo

    with torch.no_grad():  # realistic target states: the target's own hidden states over these tokens
        hidden = target(token_ids, BatchInfo.without_cache(lengths), compute_logits=False, return_hidden=True).hidden
    loss_mask = torch.ones(total, dtype=torch.uint8)
    chunk = None if args.contender == "naive" else args.chunk_size
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times, flops = [], 0.0
    for step in range(args.steps + 1):
        start = time.perf_counter()
        loss, metrics = unrolled_losses(head, token_ids, hidden, loss_mask, lengths, unroll_steps=args.unroll,
                                        chunk_size=chunk)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step:  # the first step warms up allocators
            times.append(time.perf_counter() - start)
            flops += metrics["flops"]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak_gflops = measure_matmul_gflops(precision.torch_dtype)
    gflops = flops / sum(times) / 1e9
    print(json.dumps({"tokens_per_s": total * len(times) / sum(times), "peak_growth_mib": (peak - baseline) / 1024,
                      "loss": float(loss), "gflops": gflops, "peak_gflops": peak_gflops, "dtype": precision.dtype}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per micro-batch (sequences of 512)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--unroll", type=int, default=2)
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--quick", action="store_true", help="2048 tokens, 2 steps")
    parser.add_argument("--malloc", choices=["tuned", "default"], default="tuned",
                        help="tuned: mtp_train.runtime.cpu.tune_malloc() as the CLI does (default)")
    parser.add_argument("--dtype", default="auto", help="auto (what `train` resolves here) | float32 | bfloat16")
    parser.add_argument("--contender", choices=["chunked", "naive"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.steps = 2048, 2
    if args.contender:
        child(args)
        return
    results = {}
    for contender in ("chunked", "naive"):
        command = [sys.executable, __file__, "--contender", contender, "--tokens", str(args.tokens), "--steps",
                   str(args.steps), "--unroll", str(args.unroll), "--chunk-size", str(args.chunk_size),
                   "--malloc", args.malloc, "--dtype", args.dtype]
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        results[contender] = json.loads(out)
        r = results[contender]
        print(f"{contender:8s}: {r['tokens_per_s']:8.1f} tokens/s, peak memory growth {r['peak_growth_mib']:8.1f} MiB "
              f"(loss {r['loss']:.4f}); {r['gflops']:.1f} GFLOP/s = {r['gflops'] / r['peak_gflops']:.0%} of the "
              f"measured {r['dtype']} matmul peak ({r['peak_gflops']:.1f} GFLOP/s)")
    from mtp_train.runtime.hardware import machine_fields

    speed = results["chunked"]["tokens_per_s"] / results["naive"]["tokens_per_s"]
    memory = results["naive"]["peak_growth_mib"] / max(results["chunked"]["peak_growth_mib"], 1e-9)
    print(f"chunked vs naive: {speed:.2f}x speed, {memory:.1f}x less peak memory")
    print(f"RESULT chunked_tok_s={results['chunked']['tokens_per_s']:.1f} naive_tok_s={results['naive']['tokens_per_s']:.1f} "
          f"speed_ratio={speed:.3f} chunked_peak_mib={results['chunked']['peak_growth_mib']:.0f} "
          f"naive_peak_mib={results['naive']['peak_growth_mib']:.0f} memory_ratio={memory:.2f} tokens={args.tokens} "
          f"unroll={args.unroll} chunk_size={args.chunk_size} malloc={args.malloc} "
          f"chunked_gflops={results['chunked']['gflops']:.1f} peak_gflops={results['chunked']['peak_gflops']:.1f} "
          f"fraction_of_peak={results['chunked']['gflops'] / results['chunked']['peak_gflops']:.3f} "
          f"{machine_fields(results['chunked']['dtype'])}")


if __name__ == "__main__":
    main()
