"""The χ² goodness-of-fit helper of the lossless-sampling tests (tests/test_rejection.py, tests/test_speculative.py,
tests/test_draft_vocab.py).

Statistical tests draw from a seeded generator, so they are deterministic. A χ² test fails when its p-value is below
`P_VALUE_THRESHOLD` = 1e-3: a correct sampler fails a given seed with probability 1e-3, while the sample sizes used
make real biases (e.g. sampling the correction from p instead of norm(max(0, p - q))) give p-values far below 1e-10.
"""

from __future__ import annotations

import torch

P_VALUE_THRESHOLD = 1e-3


def chi2_p_value(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson χ² goodness-of-fit p-value of observed `counts` [C] against cell probabilities `probs` [C].

    Cells expected to hold fewer than `min_expected` observations are pooled into one cell (the usual validity
    condition of the χ² approximation). An observation in a zero-probability cell gives p-value 0."""
    counts = counts.double().flatten()
    probs = probs.double().flatten()
    probs = probs / probs.sum()
    if counts[probs == 0].sum() > 0:
        return 0.0
    total = counts.sum()
    expected = probs * total
    small = expected < min_expected
    observed_cells = counts[~small]
    expected_cells = expected[~small]
    if small.any() and expected[small].sum() > 0:
        observed_cells = torch.cat([observed_cells, counts[small].sum()[None]])
        expected_cells = torch.cat([expected_cells, expected[small].sum()[None]])
    statistic = ((observed_cells - expected_cells) ** 2 / expected_cells).sum()
    dof = observed_cells.numel() - 1
    if dof < 1:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2))
