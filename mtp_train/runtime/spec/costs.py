"""Per-step costs of speculative decoding, as `eval` and the bench scripts measure them: one target forward of n tokens
(n = 1 is a decode step, n = k + 1 a verify) and one draft step of a head (its layer over its KV cache plus the
vocabulary projection), each after a prefill of the same prompt, at batch 1. Times are the best of 3 rounds: the
machine is shared."""

from __future__ import annotations

import time

import torch

from mtp_train.runtime.attention import BatchInfo
from mtp_train.runtime.kv_cache import PageAllocator, Sequence


def _pages(prompt_ids: list[int], extra_tokens: int, page_size: int = 16) -> int:
    return -(-(len(prompt_ids) + extra_tokens) // page_size) + 1


def best_seconds(fn, repeats: int) -> float:
    """Seconds per call of `fn`: 3 warm-up calls, then the best of 3 rounds of `repeats` calls."""
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best


@torch.inference_mode()
def target_step_seconds(target, prompt_ids: list[int], n_tokens: list[int], repeats: int = 20) -> dict[int, float]:
    """{n: seconds of one target forward over n new tokens} after the prompt is in the cache."""
    allocator = PageAllocator(_pages(prompt_ids, max(n_tokens)), 16)
    cache, seq = target.new_kv_cache(allocator), Sequence(0)
    target(torch.tensor(prompt_ids), BatchInfo.for_sequences([seq], [len(prompt_ids)], allocator), cache)

    def step(n: int) -> None:
        target(torch.tensor(prompt_ids[:n]), BatchInfo.for_sequences([seq], [n], allocator, advance=False), cache)

    return {n: best_seconds(lambda n=n: step(n), repeats) for n in n_tokens}


@torch.inference_mode()
def head_step_seconds(target, head, prompt_ids: list[int], repeats: int = 50) -> float:
    """Seconds of one draft step of `head` (one token, vocabulary projection and argmax included)."""
    allocator = PageAllocator(2 * _pages(prompt_ids, 1), 16)
    cache, head_cache = target.new_kv_cache(allocator), head.new_kv_cache(allocator)
    seq, head_seq = Sequence(0), Sequence(1)
    out = target(torch.tensor(prompt_ids), BatchInfo.for_sequences([seq], [len(prompt_ids)], allocator), cache,
                 return_hidden=True)
    n = len(prompt_ids) - 1
    head(torch.tensor(prompt_ids[1:]), out.hidden[:-1], BatchInfo.for_sequences([head_seq], [n], allocator), head_cache)
    last_hidden, token = out.hidden[-1:], torch.tensor(prompt_ids[-1:])

    def step() -> None:
        batch = BatchInfo.for_sequences([head_seq], [1], allocator, advance=False)
        head.logits(head(token, last_hidden, batch, head_cache)).argmax(-1)

    return best_seconds(step, repeats)
