"""evaluate/margins.py: greedy margins against a path's error, and greedy divergences told apart as near-ties or
faults (what the tests and bench scripts that compare a real model's greedy tokens rely on)."""

from __future__ import annotations

import pytest
import torch

from mtp_train.evaluate.margins import (
    MarginCheck,
    clear_prefix_length,
    decode_logits,
    explain_divergence,
    first_divergence,
    reference_logits,
    top2_margins,
)
from mtp_train.runtime.generate import generate
from mtp_train.runtime.loader import load_model
from tests.margin_checks import assert_clear_margins
from tests.tiny_models import save_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp("margins") / "target", seed=0)
    return path, load_model(path, dtype="float32", device="cpu")


def test_margins_and_unsafe_steps():
    logits = torch.tensor([[3.0, 1.0, 0.0], [0.0, 0.9, 1.0], [5.0, 0.0, 4.0]])
    assert top2_margins(logits).tolist() == pytest.approx([2.0, 0.1, 1.0])
    check = MarginCheck.of(logits, logits + torch.tensor([[0.5, 0.0, 0.0], [0.0, 0.0, 0.04], [0.0, 0.6, 0.0]]))
    assert check.errors == pytest.approx([0.5, 0.04, 0.6])
    assert check.unsafe_steps() == [2]  # 1.0 <= 2 × 0.6; 0.1 > 2 × 0.04
    assert check.weakest_step == 2 and "at step 2" in check.describe()
    assert clear_prefix_length(logits, 0.04) == 3 and clear_prefix_length(logits, 0.06) == 1
    with pytest.raises(AssertionError, match="near-tie"):
        assert_clear_margins(logits, 0.06, "crafted")


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_decode_logits_are_what_generate_picks_from_and_match_transformers(tiny):
    from transformers import AutoModelForCausalLM

    path, model = tiny
    prompt = [5, 9, 14, 3, 7]
    (result,), _ = generate(model, [prompt], 12)
    logits = decode_logits(model, prompt, result.token_ids)
    assert logits.argmax(-1).tolist() == result.token_ids
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert (reference_logits(hf, prompt, result.token_ids) - logits).abs().max() < 1e-4


def test_a_divergence_is_a_tie_only_within_the_rounding(tiny):
    _, model = tiny
    prompt = [5, 9, 14, 3, 7]
    (result,), _ = generate(model, [prompt], 12)
    plain = result.token_ids
    assert explain_divergence(model, prompt, plain, list(plain)) is None
    logits = decode_logits(model, prompt, plain)
    step = int(top2_margins(logits)[1:].argmax()) + 1  # the clearest step after the prefill's
    runner_up = int(logits[step].topk(2).indices[1])
    other = plain[:step] + [runner_up] + plain[step + 1 :]
    divergence = explain_divergence(model, prompt, plain, other)
    assert divergence.step == step
    assert divergence.margin == pytest.approx(float(top2_margins(logits)[step]), abs=1e-6) and divergence.margin > 1e-2
    assert 0 <= divergence.rounding < 1e-4  # fp32: decode and verify differ by summation order only
    assert not divergence.is_tie and "NOT a near-tie" in divergence.describe()
    stopped_early = explain_divergence(model, prompt, plain, plain[:4])
    assert stopped_early.step == 4 and not stopped_early.is_tie
