#!/usr/bin/env python
"""Where a speculative step's time goes besides the target: plain decoding, the head's chain and prompt lookup.

The eval's cost curve predicts a speedup from three step costs (decode, verify, draft step) measured on their own;
the speculative loop also runs Python between the forwards, the proposer's catch-up, and every piece of it starts
with caches the target's weight stream has just emptied. This times, per method on the same prompts (MT-bench first
turns, greedy, batch 1, methods alternated prompt by prompt over `--rounds` rounds so machine noise hits all alike):

- the target's forwards (prefill, decode or verify), the proposer's `propose` and `catch_up` (wrapped timers), and
  the rest of the loop, each in ms per target forward;
- a head step (its forward, output projection and argmax) warm (right after another) and cold (right after a target
  decode step), and a handful of trivial torch ops likewise: the price of the emptied caches.

The head runs twice: `mtp` through its one-call forward (`HeadRunner.forward_with_logits`, the CPU decode path's
`mtp_head_forward`: what the eval runs), `mtp_per_op` with that switched off (the ~10 kernel calls of a head forward
made one by one from Python, as before it existed); the head step is timed both ways too.

Ends with a `RESULT` line: `<method>_ms_per_forward`, `<method>_overhead_ms` (everything but the target's forwards, per
forward), `<method>_tok_s`, per speculative method `<method>_tokens_per_forward` (τ, the prefill's forward counted),
`mtp_vs_per_op` (tokens/s ratio), `head_step_cold_ms`, `head_step_warm_ms`, `head_step_per_op_cold_ms`,
`head_step_per_op_warm_ms`, `tiny_ops_cold_ms`, `tiny_ops_warm_ms`. `--quick`: 2 prompts, 48 tokens,
2 rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


class StepTimers:
    """Wall time and call counts of wrapped methods (instance or class attributes), by key."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, owner, name: str, key: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - start
                self.calls[key] = self.calls.get(key, 0) + 1

        setattr(owner, name, timed)

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def cold_and_warm(fn, cool, repeats: int) -> tuple[float, float]:
    """Median seconds of `fn` right after another call of it (warm) and right after `cool()` (cold)."""
    warm, cold = [], []
    for _ in range(repeats):
        fn()
        start = time.perf_counter()
        fn()
        warm.append(time.perf_counter() - start)
        cool()
        start = time.perf_counter()
        fn()
        cold.append(time.perf_counter() - start)
    return statistics.median(cold), statistics.median(warm)


def without_fused_head(head, run):
    """`run()` with the head runner's one-call forward (`HeadRunner.fused`) switched off: its forwards then make the
    ~10 kernel calls one by one, as before that path existed."""
    fused = head.fused
    head.fused = None
    try:
        return run()
    finally:
        head.fused = fused


def main() -> None:
    from bench_spec import add_run_arguments, load_auto_run, mt_bench_chat_prompts

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser, new_tokens=96)
    parser.add_argument("--k", type=int, default=2, help="speculative tokens per step (both methods)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="2 prompts, 48 tokens, 2 rounds")
    args = parser.parse_args()
    if args.quick:
        args.num_prompts, args.new_tokens, args.rounds = 2, 48, 2
    if args.threads:
        torch.set_num_threads(args.threads)

    from mtp_train.runtime.attention import BatchInfo
    from mtp_train.runtime.generate import generate
    from mtp_train.runtime.hardware import machine_fields
    from mtp_train.runtime.kv_cache import PageAllocator, Sequence
    from mtp_train.runtime.spec import PromptLookup, speculative_generate
    from mtp_train.runtime.spec.mtp_chain import MTPChainProposer
    from mtp_train.runtime.spec.prompt_lookup import PromptLookupProposer

    run = load_auto_run(args)
    precision, target, head, head_weights = run.precision, run.target, run.head, run.head_weights
    tokenizer, stops = run.tokenizer, run.stop_token_ids
    prompts = mt_bench_chat_prompts(tokenizer, args.prompts, args.num_prompts)
    if not prompts:
        raise SystemExit(f"no prompts in {args.prompts}")

    timers = StepTimers()
    timers.wrap(target, "forward", "target")
    for proposer_class in (MTPChainProposer, PromptLookupProposer):  # on each class: a subclass may override
        timers.wrap(proposer_class, "propose", "propose")
        timers.wrap(proposer_class, "catch_up", "catch_up")
    methods = {
        "plain": lambda ids: generate(target, [ids], args.new_tokens, stop_token_ids=stops),
        "mtp": lambda ids: speculative_generate(target, head, [ids], args.new_tokens, args.k, stop_token_ids=stops),
        "mtp_per_op": lambda ids: without_fused_head(
            head, lambda: speculative_generate(target, head, [ids], args.new_tokens, args.k, stop_token_ids=stops)),
        "lookup": lambda ids: speculative_generate(target, PromptLookup(), [ids], args.new_tokens, args.k,
                                                   stop_token_ids=stops),
    }
    methods["plain"](prompts[0])  # first-call set-up (the prefill's packed weights) outside the timings
    totals = {name: {"wall": 0.0, "tokens": 0, "forwards": 0, "target": 0.0, "propose": 0.0, "catch_up": 0.0}
              for name in methods}
    for _ in range(args.rounds):
        for ids in prompts:
            for name, run in methods.items():
                timers.reset()
                start = time.perf_counter()
                out = run(ids)
                wall = time.perf_counter() - start
                results = out[0] if isinstance(out, tuple) else out
                total = totals[name]
                total["wall"] += wall
                total["tokens"] += len(results[0].token_ids)
                total["forwards"] += timers.calls.get("target", 0)
                for key in ("target", "propose", "catch_up"):
                    total[key] += timers.seconds.get(key, 0.0)

    fields = []
    print(f"\nms per target forward ({len(prompts)} prompts × {args.new_tokens} tokens × {args.rounds} rounds, k = "
          f"{args.k}; prefills included)")
    print(f"{'method':8s} {'tok/s':>7s} {'tok/fwd':>8s} {'target':>8s} {'propose':>8s} {'catch_up':>9s} "
          f"{'rest':>7s} {'all':>7s}")
    for name, total in totals.items():
        forwards = max(total["forwards"], 1)
        per = {key: total[key] / forwards * 1e3 for key in ("wall", "target", "propose", "catch_up")}
        rest = per["wall"] - per["target"] - per["propose"] - per["catch_up"]
        tokens_per_forward = total["tokens"] / forwards
        print(f"{name:8s} {total['tokens'] / total['wall']:7.1f} {tokens_per_forward:8.3f} {per['target']:8.2f} "
              f"{per['propose']:8.2f} {per['catch_up']:9.2f} {rest:7.2f} {per['wall']:7.2f}")
        fields += [f"{name}_ms_per_forward={per['wall']:.3f}", f"{name}_overhead_ms={per['wall'] - per['target']:.3f}",
                   f"{name}_tok_s={total['tokens'] / total['wall']:.2f}"]
        if name != "plain":
            fields.append(f"{name}_tokens_per_forward={tokens_per_forward:.3f}")

    per_op = totals["mtp_per_op"]
    fields.append(f"mtp_vs_per_op={(totals['mtp']['tokens'] / totals['mtp']['wall']) / (per_op['tokens'] / per_op['wall']):.3f}")

    # ---- a head step and a few trivial ops, warm and right after a target decode step --------------------------
    context = prompts[0]
    allocator = PageAllocator(len(context) // 16 + 4, 16)
    target_cache, head_cache = target.new_kv_cache(allocator), head.new_kv_cache(allocator)
    pages: list[int] = []
    target_view, head_view = Sequence(0, pages=pages), Sequence(0, pages=pages)
    with torch.inference_mode():
        out = target(torch.tensor(context), BatchInfo.for_sequences([target_view], [len(context)], allocator),
                     target_cache, return_hidden=True)
        head(torch.tensor(context[1:]), out.hidden[:-1],
             BatchInfo.for_sequences([head_view], [len(context) - 1], allocator), head_cache)
        last_hidden = out.hidden[-1:].clone()
        norm_weight = torch.ones(last_hidden.shape[-1])

        def target_step() -> None:
            target(torch.tensor([context[-1]]), BatchInfo.for_sequences([target_view], [1], allocator, advance=False),
                   target_cache)

        first_row = torch.tensor([0])

        def head_step() -> None:
            batch = BatchInfo.for_sequences([head_view], [1], allocator, advance=False)
            head.forward_with_logits(torch.tensor([context[-1]]), last_hidden, batch, head_cache, first_row)[2].tolist()

        def tiny_ops() -> None:  # a BatchInfo and five small ops: what the loop runs between forwards
            BatchInfo.for_sequences([head_view], [1], allocator, advance=False)
            x = torch.nn.functional.rms_norm(last_hidden, norm_weight.shape, norm_weight)
            (x * 2 + 1).float().argmax(-1).tolist()

        repeats = 10 if args.quick else 40
        head_cold, head_warm = cold_and_warm(head_step, target_step, repeats)
        per_op_cold, per_op_warm = without_fused_head(head, lambda: cold_and_warm(head_step, target_step, repeats))
        tiny_cold, tiny_warm = cold_and_warm(tiny_ops, target_step, repeats)
    print(f"\nhead step (forward, projection, argmax): warm {head_warm * 1e3:.3f} ms, right after a target decode step "
          f"{head_cold * 1e3:.3f} ms (per-op: warm {per_op_warm * 1e3:.3f}, cold {per_op_cold * 1e3:.3f}); five "
          f"small ops + a BatchInfo: warm {tiny_warm * 1e3:.3f} ms, cold {tiny_cold * 1e3:.3f} ms")
    fields += [f"head_step_cold_ms={head_cold * 1e3:.3f}", f"head_step_warm_ms={head_warm * 1e3:.3f}",
               f"head_step_per_op_cold_ms={per_op_cold * 1e3:.3f}", f"head_step_per_op_warm_ms={per_op_warm * 1e3:.3f}",
               f"tiny_ops_cold_ms={tiny_cold * 1e3:.3f}", f"tiny_ops_warm_ms={tiny_warm * 1e3:.3f}"]
    print(f"RESULT {' '.join(fields)} k={args.k} head_weights={head_weights} threads={torch.get_num_threads()} "
          f"{machine_fields(precision.dtype)}")


if __name__ == "__main__":
    main()
