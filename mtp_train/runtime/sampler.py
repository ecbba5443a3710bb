"""Token sampling: greedy, temperature, top-k, top-p, with a seeded generator; and the repetition penalty.

`processed_probs` gives the exact distribution `sample` draws from; the speculative rejection sampler needs the
same distributions for target and draft, so both go through this one function.

The repetition penalty (`SamplingParams.repetition_penalty`, transformers' and vLLM's `repetition_penalty`: 1 = off)
changes the target's logits before any of that, from the tokens the sequence holds so far (prompt and output):
`penalize_repeats` takes a [rows, vocab] mask of them. Plain decoding keeps one row per sequence; a speculative
verify gives each row its sequence's tokens plus the drafts on its path (`verify_rows_seen`), so every row is
penalized exactly as plain decoding would have penalized that position: greedy output stays identical and sampling
lossless. Drafts are proposed unpenalized; that moves only the acceptance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    repetition_penalty: float = 1.0  # 1 = off; > 1 discourages every token the prompt or the output holds

    def __post_init__(self):
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):  # NaN fails every comparison
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 = off), got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalizes(self) -> bool:
        return self.repetition_penalty != 1.0


def seen_tokens(token_ids: list[list[int]], vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """[len(token_ids), vocab] bool: which ids each sequence holds (for `penalize_repeats`)."""
    seen = torch.zeros(len(token_ids), vocab_size, dtype=torch.bool)
    rows = torch.tensor([i for i, ids in enumerate(token_ids) for _ in ids], dtype=torch.long)
    seen[rows, torch.tensor([t for ids in token_ids for t in ids], dtype=torch.long)] = True
    return seen.to(device)


def verify_rows_seen(seen: torch.Tensor, input_ids: torch.Tensor, visible: list[torch.Tensor]) -> torch.Tensor:
    """[sum(n_b), vocab] bool: what each row of a speculative verify has seen: its sequence's tokens (`seen` [B,
    vocab], the root included) and the verify tokens it attends to (`visible[b]`: [n_b, n_b] bool, row i sees node
    j; a chain's is lower-triangular, a tree's its ancestor mask). `input_ids` [sum(n_b)] the verify's tokens."""
    sizes = [int(v.shape[0]) for v in visible]
    rows_seen = seen.repeat_interleave(torch.tensor(sizes, device=seen.device), dim=0)  # [sum(n_b), vocab]
    offset = 0
    for size, mask in zip(sizes, visible):
        row, col = mask.nonzero(as_tuple=True)  # a host mask: no device read
        rows_seen[(row + offset).to(seen.device), input_ids[(col + offset).to(input_ids.device)]] = True
        offset += size
    return rows_seen


def penalize_repeats(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """[n, vocab] logits with transformers' / vLLM's repetition penalty applied where `seen` [n, vocab] is set: a
    positive logit divided by `penalty`, a negative one multiplied by it. A new tensor; `penalty` 1 returns `logits`."""
    if penalty == 1.0:
        return logits
    logits = logits.float()
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[n, vocab] logits -> [n, vocab] fp32 probabilities after temperature, top-k, then top-p (transformers'
    order). Greedy gives a one-hot distribution on the argmax."""
    logits = logits.float()
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=False)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        remove_sorted = cumulative <= (1 - params.top_p)
        remove_sorted[..., -1] = False  # always keep the most likely token
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits.softmax(-1)


def sample_from_probs(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """[n, vocab] -> [n] token ids."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """[n, vocab] logits -> [n] token ids."""
    if params.greedy:
        return logits.argmax(-1)
    return sample_from_probs(processed_probs(logits, params), generator)
