"""scripts/bench_acceptance.py's controlled drafts: a head's drafts set right or wrong at a chosen rate before the
verify. Its figures mean what they say only if a level of 1 is always accepted, 0 never, a level in between at
about that rate, and the output stays plain greedy's whatever the loop is fed."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from mtp_train.heads import DraftHead, HeadConfig
from mtp_train.runtime.generate import generate
from mtp_train.runtime.spec import speculative_generate
from mtp_train.runtime.spec.mtp_chain import MTPChainProposer
from tests.spec_helpers import make_prompts

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_acceptance.py"
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def bench():
    """scripts/bench_acceptance.py as a module (a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("bench_acceptance", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_acceptance"] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("bench_acceptance", None)


def controlled_run(bench, target, level: float, k: int, seed: int = 0):
    """Plain greedy, then the same prompt speculatively with the head's drafts set right at `level`; returns (plain
    tokens, speculative tokens, stats)."""
    torch.manual_seed(0)
    head = DraftHead.from_target(target, HeadConfig.for_target(target.config, kind="mtp"))  # untrained: ~never right
    prompt = make_prompts(1, seed=seed)[0]
    reference = generate(target, [prompt], NEW_TOKENS)[0][0].token_ids
    controlled = bench.ControlledDrafts(MTPChainProposer, target.config.vocab_size)
    try:
        controlled.start(reference, bench.position_draws(0, NEW_TOKENS, seed), len(prompt), level)
        results, stats = speculative_generate(target, head, [prompt], NEW_TOKENS, k)
    finally:
        controlled.close()
    return reference, results[0].token_ids, stats


@pytest.mark.parametrize("k", [1, 3])
def test_level_one_accepts_every_draft_and_zero_none(bench, models, k):
    own_propose = MTPChainProposer.propose
    for level, expected in ((1.0, 1.0), (0.0, 0.0)):
        reference, tokens, stats = controlled_run(bench, models["target"], level, k)
        assert tokens == reference
        assert stats.drafted_tokens > 0
        assert stats.accepted_tokens / stats.drafted_tokens == expected, (level, k)
    assert MTPChainProposer.propose is own_propose  # `close` put the class's own back


def test_level_in_between_accepts_at_about_that_rate_and_stays_lossless(bench, models):
    accepted = drafted = 0
    for seed in range(6):
        reference, tokens, stats = controlled_run(bench, models["target"], 0.5, 1, seed=seed)
        assert tokens == reference
        accepted += stats.accepted_per_position[0]
        drafted += stats.drafted_per_position[0]
    assert 0.35 < accepted / drafted < 0.65, (accepted, drafted)


def test_crossing_interpolates_between_measured_levels(bench):
    assert bench.crossing([0.3, 0.4, 0.6], [1.16, 1.25, 1.33], 1.2) == pytest.approx(0.3 + 0.04 / 0.09 * 0.1)
    assert bench.crossing([0.4, 0.3], [1.25, 1.16], 1.25) == pytest.approx(0.4)  # unsorted input, goal hit exactly
    assert math.isnan(bench.crossing([0.3, 0.4], [1.16, 1.25], 1.5))  # never reached
    assert bench.crossing([0.3, 0.4], [1.16, 1.25], 1.1) == 0.3  # every level reaches it: the lowest
