"""Helpers of the speculative-decoding tests (tests/test_speculative.py, tests/test_draft_vocab.py): prompts for the
tiny vocab-96 target, the greedy comparison against plain `generate()`, and the exact joint distribution behind the
end-to-end χ² tests on the vocab-8 target. The models themselves are the `models` and `small_vocab_target` fixtures
of tests/conftest.py."""

from __future__ import annotations

import torch

from mtp_train.runtime.attention import BatchInfo
from mtp_train.runtime.generate import generate
from mtp_train.runtime.kv_cache import PageAllocator
from mtp_train.runtime.sampler import SamplingParams, penalize_repeats, processed_probs, seen_tokens
from mtp_train.runtime.spec import speculative_generate

VOCAB = 96
PROMPT_LENGTHS = (5, 11, 3, 18)  # batch 4 with different prompt lengths; batch 1 uses the first

SMALL_VOCAB = 8
LOSSLESS_PROMPT = [0, 5, 3, 6, 2]
PENALTY_PROMPT = [0, 0, 0, 0, 0]  # one id: a repetition penalty's seen set grows with each new token
LOSSLESS_SAMPLES = 2000


def make_prompts(batch_size: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS[:batch_size]]


def run_and_compare(target, draft, prompts, max_new_tokens, k, page_size=4, **kwargs):
    """Speculative (chain or tree) vs plain greedy on the same prompts; asserts identical tokens, finish reasons, that
    every page is back and that the counters agree (a tree counts its nodes as drafted tokens and, per depth, the
    steps whose tree / accepted path reached it). Returns the speculative results and stats."""
    reference, _ = generate(target, prompts, max_new_tokens, page_size=page_size, **kwargs)
    allocator = PageAllocator(64, page_size=page_size)
    results, stats = speculative_generate(
        target, draft, prompts, max_new_tokens, k, page_size=page_size, allocator=allocator, **kwargs
    )
    for b, (spec, ref) in enumerate(zip(results, reference)):
        assert spec.token_ids == ref.token_ids, (b, k)
        assert spec.finish_reason == ref.finish_reason, (b, k)
    assert allocator.num_free == allocator.num_pages
    assert stats.new_tokens == sum(len(r.token_ids) for r in results)
    assert stats.target_sequence_forwards == len(prompts) + stats.verify_sequence_steps
    if not stats.schedule.startswith("tree"):  # a chain drafts one token per position per step
        assert sum(stats.drafted_per_position) == stats.drafted_tokens
    assert sum(stats.accepted_per_position) == stats.accepted_tokens
    assert stats.drafted_per_position[0] <= stats.verify_sequence_steps
    assert all(a <= d for a, d in zip(stats.accepted_per_position, stats.drafted_per_position))
    # The prefill commits one token per sequence, each verify the accepted drafts + one (fewer only after a stop).
    committed_by_steps = len(prompts) + stats.accepted_tokens + stats.verify_sequence_steps
    if kwargs.get("stop_token_ids"):
        assert stats.new_tokens <= committed_by_steps
    else:
        assert stats.new_tokens == committed_by_steps
    return results, stats


def exact_first_three_tokens(target, prompt: list[int], sampling: SamplingParams) -> torch.Tensor:
    """[V, V, V]: the exact joint probability of the first three tokens under plain sampling with `sampling` (its
    repetition penalty included), from one cache-free forward over every continuation prompt + [a, b]."""
    vocab, n = target.config.vocab_size, len(prompt)
    sequences = [prompt + [a, b] for a in range(vocab) for b in range(vocab)]
    logits = target(torch.tensor(sum(sequences, [])), BatchInfo.without_cache([n + 2] * len(sequences))).logits
    logits = logits.view(vocab, vocab, n + 2, vocab)
    # the repetition penalty's seen sets: the prompt, then prompt + [a], then prompt + [a, b]
    seen = seen_tokens(sequences, vocab, "cpu").view(vocab, vocab, vocab)  # [a, b, token]
    seen_first = seen_tokens([prompt], vocab, "cpu")  # [1, V]
    seen_second = seen_tokens([prompt + [a] for a in range(vocab)], vocab, "cpu")  # [V (t1), V]
    penalty = sampling.repetition_penalty
    first = processed_probs(penalize_repeats(logits[0, 0, n - 1][None], seen_first, penalty), sampling)[0]  # [V]: t1
    second = processed_probs(penalize_repeats(logits[:, 0, n], seen_second, penalty), sampling)  # [V (t1), V]: t2 | t1
    third = processed_probs(penalize_repeats(logits[:, :, n + 1].reshape(vocab * vocab, vocab),
                                             seen.reshape(vocab * vocab, vocab), penalty),
                            sampling).view(vocab, vocab, vocab)
    return first[:, None, None] * second[:, :, None] * third


def node_path(tokens: list[int], parents: list[int], node: int) -> list[int]:
    """The tokens from a draft tree's root to `node` (`parents[i]` < i, -1 for the root)."""
    path = []
    while node >= 0:
        path.insert(0, tokens[node])
        node = parents[node]
    return path
