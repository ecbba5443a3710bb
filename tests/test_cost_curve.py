"""The cost curve of speculative decoding (profile/costs.py): the speedup it predicts per k, the best k, its
report form, and its measurement on tiny models for every kind of draft."""

from __future__ import annotations

import pytest
import torch

from mtp_train.runtime.spec import PromptLookup
from mtp_train.profile.costs import (
    CostCurve,
    draft_step_seconds,
    measure_cost_curves,
)

pytestmark = pytest.mark.cpu_paths  # its expectations depend on the CPU: rerun as other kinds (tests/test_cpu_kinds.py)

# verify of 2 / 3 / 4 tokens costs 1.1 / 1.2 / 1.5 decode steps, a draft step 0.1 of one.
CURVE = CostCurve(decode_s=0.05, verify_over_decode={2: 1.1, 3: 1.2, 4: 1.5}, draft_step_over_decode=0.1,
                  prompt_tokens=200)


def test_predicted_speedup_is_tau_over_verify_plus_k_draft_steps():
    assert CURVE.predicted_speedup(1.6, 1) == pytest.approx(1.6 / (1.1 + 0.1))  # 1.333
    assert CURVE.predicted_speedup(2.0, 2) == pytest.approx(2.0 / (1.2 + 0.2))  # 1.429
    assert CURVE.predicted_speedup(2.2, 3) == pytest.approx(2.2 / (1.5 + 0.3))  # 1.222
    free_drafts = CostCurve(0.05, {2: 1.1}, 0.0, 200)  # prompt lookup with its search counted as free
    assert free_drafts.predicted_speedup(1.3, 1) == pytest.approx(1.3 / 1.1)
    with pytest.raises(KeyError):  # k = 4 needs verify(5), not measured
        CURVE.predicted_speedup(2.5, 4)


def test_best_k_is_the_largest_prediction_not_the_largest_tau():
    assert CURVE.best_k({1: 1.6, 2: 2.0, 3: 2.2}) == 2  # 1.333, 1.429, 1.222: τ grows, verify(4) costs more
    assert CURVE.best_k({1: 1.9, 2: 2.0, 3: 2.2}) == 1  # 1.583 beats 1.429
    tie = CostCurve(0.05, {2: 1.0, 3: 1.0}, 0.0, 10)
    assert tie.best_k({2: 1.5, 1: 1.5}) == 1  # a tie goes to the smaller k


def test_report_form_keys_verify_by_tokens_verified():
    form = CostCurve(0.0123456, {2: 1.123456, 4: 1.5}, 0.0712345, 57, measure_s=3.456).as_dict()
    assert form == {"decode_ms": 12.3456, "verify_over_decode": {"2": 1.12346, "4": 1.5},
                    "draft_step_over_decode": 0.07123, "prompt_tokens": 57, "measure_s": 3.46}


def test_curves_from_two_moments_are_averaged():
    before = CostCurve(0.010, {2: 1.0, 4: 1.2}, 0.10, 57, measure_s=2.0)
    after = CostCurve(0.006, {2: 1.2, 4: 1.6}, 0.14, 57, measure_s=3.0)
    mean = CostCurve.averaged([before, after])
    assert mean.decode_s == pytest.approx(0.008) and mean.draft_step_over_decode == pytest.approx(0.12)
    assert mean.verify_over_decode == pytest.approx({2: 1.1, 4: 1.4})
    assert mean.prompt_tokens == 57 and mean.measure_s == pytest.approx(5.0)


def test_verify_ratios_are_taken_within_rounds(monkeypatch):
    """A machine whose speed changes between rounds (rounds 2 and 4 twice as fast; in round 5 only the decode step
    ran fast): each verify's ratio is taken within a round and the median kept, so the fast decode of one round is
    never divided into another round's verify."""
    import mtp_train.profile.costs as costs

    rounds = {1: [0.010, 0.005, 0.010, 0.005, 0.004], 2: [0.011, 0.0055, 0.011, 0.0055, 0.011]}
    monkeypatch.setattr(costs, "target_step_rounds", lambda *args, **kwargs: rounds)
    monkeypatch.setattr(costs, "draft_step_seconds", lambda *args, **kwargs: 0.001)
    curve = measure_cost_curves(object(), {"lookup": PromptLookup()}, [1, 2, 3], ks=[1])["lookup"]
    assert curve.decode_s == 0.004  # the best round
    assert curve.verify_over_decode[2] == pytest.approx(1.1)  # not 0.0055 / 0.004 = 1.375 (the best of each)
    assert curve.draft_step_over_decode == pytest.approx(0.25)


def test_measured_on_tiny_models_for_a_head_a_draft_model_and_prompt_lookup(models):
    from mtp_train.heads import DraftHead, HeadConfig

    target, draft_model = models["target"], models["other_seed"]
    torch.manual_seed(0)
    head = DraftHead.from_target(target, HeadConfig.for_target(target.config, target.fingerprint, kind="mtp"))
    prompt = [(7 * i) % 90 + 2 for i in range(40)]
    drafts = {"mtp": head, "draft": draft_model, "lookup": PromptLookup()}
    curves = measure_cost_curves(target, drafts, prompt, ks=[1, 3], repeats=2, draft_repeats=2)
    assert set(curves) == set(drafts)
    for curve in curves.values():
        assert curve.decode_s > 0 and curve.prompt_tokens == 40 and curve.measure_s > 0
        assert set(curve.verify_over_decode) == {2, 4} and all(v > 0 for v in curve.verify_over_decode.values())
        assert curve.draft_step_over_decode > 0
    # The target's steps are measured once and shared; the drafts' steps are their own.
    assert curves["mtp"].verify_over_decode == curves["lookup"].verify_over_decode
    assert curves["mtp"].decode_s == curves["draft"].decode_s
    assert draft_step_seconds(target, PromptLookup(), prompt, repeats=2) > 0


def test_a_head_chain_timed_whole_replaces_k_draft_steps():
    """A head drafting its greedy chain in one kernel call is priced by that chain timed whole (only its first step
    meets cold caches), where measured; other k keep k draft steps. The report form carries it, averaging keeps the
    k both curves have."""
    chained = CostCurve(0.05, {2: 1.1, 3: 1.2, 4: 1.5}, 0.1, 200, chain_over_decode={2: 0.15, 3: 0.2})
    assert chained.drafting_over_decode(2) == 0.15 and chained.drafting_over_decode(1) == pytest.approx(0.1)
    assert chained.predicted_speedup(2.0, 2) == pytest.approx(2.0 / (1.2 + 0.15))  # not 2.0 / (1.2 + 0.2)
    assert chained.predicted_speedup(1.6, 1) == CURVE.predicted_speedup(1.6, 1)
    assert chained.as_dict()["chain_over_decode"] == {"2": 0.15, "3": 0.2}
    other = CostCurve(0.05, {2: 1.1, 3: 1.2, 4: 1.5}, 0.1, 200, chain_over_decode={2: 0.25})
    assert CostCurve.averaged([chained, other]).chain_over_decode == pytest.approx({2: 0.2})


def test_a_head_chain_is_measured_where_the_head_drafts_it_in_one_call(models):
    """On the CPU decode path an MTP head's curve carries its chain per k, each timed as the loop runs it; a draft
    without the one-call chain (prompt lookup) carries none."""
    from mtp_train.heads import DraftHead, HeadConfig
    from mtp_train.runtime import kernels
    from mtp_train.runtime.cpu_decode import KERNEL_MAX_ROWS
    from mtp_train.runtime.decode_runner import HeadRunner

    assert kernels.cpu_kernels() is not None, f"the CPU decode kernels did not build: {kernels.unavailable_reason()}"
    target = models["target"]
    torch.manual_seed(0)
    head = DraftHead.from_target(target, HeadConfig.for_target(target.config, kind="mtp", init="last_layer"))
    head = HeadRunner(head, torch.float32, KERNEL_MAX_ROWS)
    assert head.chains_in_one_call
    prompt = [(7 * i) % 90 + 2 for i in range(40)]
    curves = measure_cost_curves(target, {"mtp": head, "lookup": PromptLookup()}, prompt, ks=[1, 3], repeats=2,
                                 draft_repeats=2)
    assert set(curves["mtp"].chain_over_decode) == {1, 3}
    assert all(r > 0 for r in curves["mtp"].chain_over_decode.values())
    assert curves["lookup"].chain_over_decode == {}
