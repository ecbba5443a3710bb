"""Checks for tests that assert a real model's greedy tokens: every step they compare must have a top-1/top-2 margin
above twice the path's measured error (mtp_train/evaluate/margins.py), so that a prompt too close to a tie fails by
saying so instead of flaking on another CPU's rounding."""

from __future__ import annotations

import torch

from mtp_train.evaluate.margins import MarginCheck, decode_logits


def assert_clear_margins(logits: torch.Tensor, error: float, what: str) -> None:
    """`logits` [steps, vocab]: those each compared greedy token was chosen from; `error`: the largest |Δlogit| the
    paths compared may differ by (measured, or the bound a parity test enforces)."""
    check = MarginCheck.of(logits, logits)
    check.errors = [error] * len(check.margins)
    assert not check.unsafe_steps(), (
        f"{what}: {check.describe()}: a near-tie where paths within {error:g} of each other may pick different "
        f"tokens; compare fewer tokens or pick another prompt (scripts/prompt_margins.py)")


def assert_clear_decode_margins(model, prompt_ids: list[int], answer_ids: list[int], error: float, what: str) -> None:
    """`assert_clear_margins` on `model`'s own decode path over its greedy answer."""
    assert_clear_margins(decode_logits(model, prompt_ids, answer_ids), error, what)
