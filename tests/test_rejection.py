"""The rejection sampler alone (`runtime/rejection.py`, a batch of chains; trees: tests/test_tree.py): greedy
verification, the accept rule, the residual and bonus distributions, and a χ² test that it is lossless.

Statistical tests draw from a seeded generator, so they are deterministic; the χ² helper and the rationale of its
threshold are in tests/sampling_stats.py.
"""

from __future__ import annotations

import pytest
import torch

from mtp_train.runtime.rejection import greedy_accept_chains, rejection_sample_chains
from tests.sampling_stats import P_VALUE_THRESHOLD, chi2_p_value


def test_chi2_helper_accepts_a_fair_sample_and_rejects_a_biased_one():
    gen = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    fair = torch.bincount(torch.multinomial(probs, 4000, replacement=True, generator=gen), minlength=4)
    assert chi2_p_value(fair, probs) > P_VALUE_THRESHOLD
    biased = torch.bincount(
        torch.multinomial(torch.tensor([0.45, 0.35, 0.15, 0.05]), 4000, replacement=True, generator=gen), minlength=4
    )
    assert chi2_p_value(biased, probs) < P_VALUE_THRESHOLD
    assert chi2_p_value(torch.tensor([10, 0, 1]), torch.tensor([0.5, 0.5, 0.0])) == 0.0


# ---- greedy -------------------------------------------------------------------------------------------------------


def test_greedy_accepts_the_matching_prefix_then_emits_the_target_choice():
    """Four chains verified in one batch: a prefix accepted, the first draft wrong (later matches do not count),
    all accepted (the bonus is the target's last choice), and no drafts (a plain decode step)."""
    input_ids = torch.tensor([9, 3, 1, 2] * 3 + [9])  # each chain's root (9), then its drafts
    target_argmax = torch.tensor([3, 1, 0, 5] + [4, 1, 2, 5] + [3, 1, 2, 5] + [7])
    results = greedy_accept_chains(input_ids, target_argmax, [4, 4, 4, 1])
    assert [(r.accepted_len, r.token_ids) for r in results] == [(2, [3, 1, 0]), (0, [4]), (3, [3, 1, 2, 5]),
                                                                (0, [7])]
    assert results[0].drafted == (3, 1, 2) and results[3].drafted == ()


# ---- sampling: the accept rule, residual and bonus -----------------------------------------------------------------


def _draws(n: int, draft_token_ids, draft_probs, target_probs, seed: int = 0) -> list:
    """`n` copies of one chain (drafts [k], their q [k, vocab], the target's p [k + 1, vocab]) verified in one batch."""
    gen = torch.Generator().manual_seed(seed)
    k = int(draft_token_ids.shape[0])
    input_ids = torch.cat([torch.zeros(1, dtype=torch.long), draft_token_ids]).repeat(n)  # root 0, then the drafts
    return rejection_sample_chains(input_ids, [draft_probs] * n, target_probs.repeat(n, 1), [k + 1] * n, gen)


def test_sampling_accepts_when_target_gives_at_least_the_draft_probability():
    draft_probs = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.2, 0.6]])
    target_probs = torch.tensor([[0.6, 0.4, 0.0], [0.2, 0.2, 0.6], [0.0, 0.0, 1.0]])
    # p(d_1) = 0.6 >= q = 0.5 and p(d_2) = 0.6 >= 0.6: always accepted; the bonus comes from p[2] (token 2 surely).
    for result in _draws(50, torch.tensor([0, 2]), draft_probs, target_probs):
        assert (result.accepted_len, result.token_ids) == (2, [0, 2, 2])


def test_sampling_never_emits_a_token_the_target_rules_out():
    draft_probs = torch.tensor([[0.7, 0.3, 0.0]])
    target_probs = torch.tensor([[0.0, 0.25, 0.75], [1.0, 0.0, 0.0]])
    for result in _draws(200, torch.tensor([0]), draft_probs, target_probs):
        assert result.accepted_len == 0 and result.token_ids[0] in (1, 2)


def test_zero_draft_probability_is_handled():
    # q(d) = 0 (cannot happen when d was sampled from q, but must not divide by zero): accept iff p(d) > 0.
    target_probs = torch.tensor([[0.2, 0.8, 0.0], [0.0, 0.0, 1.0]])
    (result,) = _draws(1, torch.tensor([1]), torch.tensor([[1.0, 0.0, 0.0]]), target_probs)
    assert (result.accepted_len, result.token_ids) == (1, [1, 2])
    # q(d) = 0 and p(d) = 0: rejected; the residual max(0, p - q) = [0, 0.8, 0] -> token 1.
    (result,) = _draws(1, torch.tensor([2]), torch.tensor([[1.0, 0.0, 0.0]]), target_probs)
    assert (result.accepted_len, result.token_ids) == (0, [1])
    # p == q everywhere, the draft (q = p = 0) is rejected: residual max(0, p - q) has mass 0 -> falls back to p.
    same = torch.tensor([[0.0, 1.0, 0.0]])
    (result,) = _draws(1, torch.tensor([0]), same, torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))
    assert (result.accepted_len, result.token_ids) == (0, [1])


def test_shape_errors_name_the_expected_shape():
    with pytest.raises(ValueError, match=r"sequence 1: expected draft_probs of shape \[2, 4\]"):
        rejection_sample_chains(torch.tensor([0, 1, 2] * 2), [torch.full((2, 4), 0.25), torch.full((1, 4), 0.25)],
                                torch.full((6, 4), 0.25), [3, 3])


def test_rejection_emits_from_the_normalized_residual():
    # p(d) = 0.1 < q(d) = 0.6: accepted with probability 1/6; on rejection the token follows
    # norm(max(0, p - q)) = norm([0, 0.25, 0.15, 0.3, 0]) = [0, 5/14, 3/14, 6/14, 0].
    draft_probs = torch.tensor([[0.6, 0.1, 0.1, 0.0, 0.2]])
    target_probs = torch.tensor([[0.1, 0.35, 0.25, 0.3, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2]])
    results = _draws(6000, torch.tensor([0]), draft_probs, target_probs, seed=1)
    rejected = [r.token_ids[0] for r in results if r.accepted_len == 0]
    accept_rate = 1 - len(rejected) / len(results)
    p_d = float(target_probs[0, 0])
    assert abs(accept_rate - p_d / 0.6) < 0.03
    residual = (target_probs[0] - draft_probs[0]).clamp(min=0)
    counts = torch.bincount(torch.tensor(rejected), minlength=5)
    assert counts[0] == 0 and counts[4] == 0  # the draft token itself and a p = 0 token never come from the residual
    assert chi2_p_value(counts, residual / residual.sum()) > P_VALUE_THRESHOLD


def test_bonus_token_follows_the_last_target_distribution():
    draft_probs = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    target_probs = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4]])  # p == q: always accepted
    results = _draws(4000, torch.tensor([1]), draft_probs, target_probs, seed=2)
    assert all(r.accepted_len == 1 and r.token_ids[0] == 1 for r in results)
    counts = torch.bincount(torch.tensor([r.token_ids[1] for r in results]), minlength=4)
    assert chi2_p_value(counts, target_probs[1]) > P_VALUE_THRESHOLD


# ---- losslessness ----------------------------------------------------------------------------------------------------


def _random_distributions(rows: int, vocab: int, seed: int, sharpness: float = 2.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    probs = (torch.randn(rows, vocab, generator=gen) * sharpness).softmax(-1)
    probs[:, -1] = 0  # a token the distributions rule out (as top-k / top-p do)
    return probs / probs.sum(-1, keepdim=True)


@pytest.mark.parametrize("num_drafts", [1, 3])
def test_sampler_is_lossless_chi2(num_drafts):
    """Draft tokens sampled from q, then verified: the first emitted token follows p[0], and the second (when the
    first draft was accepted) follows p[1], whatever q is. 12,000 chains in one batch, χ² threshold 1e-3 (see module
    docstring)."""
    vocab, num_chains = 7, 12000
    target_probs = _random_distributions(num_drafts + 1, vocab, seed=11)  # [k + 1, vocab], last token ruled out
    # A draft that partly agrees with the target and also proposes the token the target rules out.
    other = (torch.randn(num_drafts, vocab, generator=torch.Generator().manual_seed(10)) * 2).softmax(-1)
    draft_probs = 0.4 * target_probs[:num_drafts] + 0.6 * other  # [k, vocab]
    gen = torch.Generator().manual_seed(num_drafts)
    drafts = torch.stack([torch.multinomial(draft_probs, 1, generator=gen)[:, 0] for _ in range(num_chains)])
    input_ids = torch.cat([torch.zeros(num_chains, 1, dtype=torch.long), drafts], 1).flatten()  # [N * (k + 1)]
    results = rejection_sample_chains(input_ids, [draft_probs] * num_chains, target_probs.repeat(num_chains, 1),
                                      [num_drafts + 1] * num_chains, gen)
    assert all(len(r.token_ids) == r.accepted_len + 1 for r in results)
    accepted_total = sum(r.accepted_len for r in results)
    first = [r.token_ids[0] for r in results]
    second = [r.token_ids[1] for r in results if len(r.token_ids) > 1]
    # Both paths are exercised: some drafts are accepted, many rejected.
    assert 0.1 < accepted_total / (num_chains * num_drafts) < 0.9
    assert chi2_p_value(torch.bincount(torch.tensor(first), minlength=vocab), target_probs[0]) > P_VALUE_THRESHOLD
    assert chi2_p_value(torch.bincount(torch.tensor(second), minlength=vocab), target_probs[1]) > P_VALUE_THRESHOLD
