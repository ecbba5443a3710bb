"""The hybrid proposer (runtime/spec/hybrid.py): per step and sequence the head's chain or the context's copy, verified
as a chain. Greedy output identical to plain decoding with both drafters in use, the choice rules, and the context
copy. Lossless sampling is tested end to end by tests/test_speculative.py's χ² cases."""

from __future__ import annotations

import pytest
import torch

from mtp_train.errors import UserError
from mtp_train.runtime.spec import HybridDraft, PromptLookup, speculative_generate
from mtp_train.runtime.spec.hybrid import CONTEXT, HEAD, HybridProposer, context_continuation
from tests.spec_helpers import VOCAB, make_prompts, run_and_compare
from tests.test_speculative import make_head


def repetitive_prompts(batch_size: int, seed: int = 0) -> list[list[int]]:
    """Prompts whose second half repeats a span of the first: the context drafter has something to copy."""
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for length in (12, 20, 9, 30)[:batch_size]:
        head = torch.randint(2, VOCAB, (length,), generator=gen).tolist()
        prompts.append(head + head[2 : 2 + length // 2])
    return prompts


def test_context_continuation_copies_after_the_longest_latest_match():
    tokens = [7, 1, 2, 3, 9, 9, 4, 1, 2, 3, 5, 6, 1, 2, 3]
    assert context_continuation(tokens, 3, 3, 2) == [5, 6, 1]  # the latest (1, 2, 3) is followed by 5, 6, 1
    assert context_continuation(tokens, 9, 3, 2) == [5, 6, 1, 2, 3]  # up to the end of the context
    assert context_continuation([4, 8, 2, 6], 3, 3, 2) == []  # no earlier (2, 6) nor (8, 2, 6)
    assert context_continuation([1, 2, 5, 2], 2, 3, 2) == [] and context_continuation([1, 2, 5, 2], 2, 3, 1) == [5, 2]


@pytest.mark.parametrize("init", ["random", "last_layer"])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_hybrid_matches_generate_and_uses_both_drafters(models, init, k):
    target = models["target"]
    hybrid = HybridDraft(make_head(target, init))
    used = {}
    for prompts in (repetitive_prompts(1), repetitive_prompts(4), make_prompts(4)):
        _, stats = run_and_compare(target, hybrid, prompts, 24, k)
        assert stats.schedule == HybridProposer.schedule
        assert sum(stats.steps_by_source.values()) == stats.drafted_per_position[0]  # every step that drafted
        for source, steps in stats.steps_by_source.items():
            used[source] = used.get(source, 0) + steps
    assert used.get(HEAD, 0) > 0 and used.get(CONTEXT, 0) > 0


def test_the_head_chain_is_capped_and_a_copy_is_not(models):
    target = models["target"]
    _, stats = run_and_compare(target, HybridDraft(make_head(target, "last_layer"), head_tokens=1),
                               repetitive_prompts(4), 24, 4)
    # steps with 2+ drafts are the context's copies (the head drafts one)
    assert stats.drafted_per_position[1] <= stats.steps_by_source.get(CONTEXT, 0)
    assert stats.drafted_per_position[0] == sum(stats.steps_by_source.values())


def test_copies_lift_a_weak_head_on_repetitive_prompts(models):
    """Where the replies repeat the context, the hybrid copies (a random head is rarely right): more tokens per step
    than the head alone."""
    target = models["target"]
    head = make_head(target, "random")
    prompts = repetitive_prompts(4, seed=3)
    _, alone = speculative_generate(target, head, prompts, 32, 3)
    _, hybrid = speculative_generate(target, HybridDraft(head), prompts, 32, 3)
    assert hybrid.tau > alone.tau + 0.2
    assert hybrid.steps_by_source[CONTEXT] > 0


def test_bad_rules_are_refused():
    with pytest.raises(UserError, match="min_ngram"):
        HybridDraft(None, max_ngram=2, min_ngram=3)
    with pytest.raises(UserError, match="head_tokens"):
        HybridDraft(None, head_tokens=0)
    with pytest.raises(UserError, match="context_prior"):
        HybridDraft(None, context_prior=1.5)
