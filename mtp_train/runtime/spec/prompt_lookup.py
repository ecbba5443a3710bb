"""The prompt-lookup (n-gram) proposer (vLLM: ngram_proposer.py), a model-free baseline: the next draft is the token
that followed the most recent earlier occurrence of the context's last n tokens (n from `max_ngram` down to
`min_ngram`); with no match it guesses a repeat of the last token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mtp_train.runtime.spec.proposer import DraftState, Proposer, Request


@dataclass(frozen=True)
class PromptLookup:
    """The draft to pass to `speculative_generate` for prompt lookup: its n-gram lengths."""

    max_ngram: int = 3
    min_ngram: int = 1


def ngram_next_token(tokens: list[int], max_ngram: int = 3, min_ngram: int = 1) -> int | None:
    """The token after the latest earlier occurrence of the last n tokens, longest n first; None without a match."""
    for n in range(max_ngram, min_ngram - 1, -1):
        if len(tokens) <= n:
            continue
        pattern = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == pattern:
                return tokens[start + n]
    return None


@dataclass
class PromptLookupState(DraftState):
    context: list[int] = field(default_factory=list)  # the committed tokens plus this step's drafts (searched)


class PromptLookupProposer(Proposer):
    """Drafts by n-gram lookup in the sequence itself (no draft model, no KV cache). Its "distribution" is one-hot on
    the looked-up token, so rejection sampling stays exact."""

    schedule = "prompt_lookup"
    state_class = PromptLookupState

    @classmethod
    def accepts(cls, draft) -> bool:
        return isinstance(draft, PromptLookup)

    def __init__(self, target, lookup: PromptLookup, allocator):
        super().__init__(target, allocator)
        self.lookup, self.vocab_size = lookup, target.config.vocab_size

    def _one_hot_logits(self, context: list[int]) -> torch.Tensor:
        token = ngram_next_token(context, self.lookup.max_ngram, self.lookup.min_ngram)
        logits = torch.full((self.vocab_size,), float("-inf"), device=self.device)
        logits[context[-1] if token is None else token] = 0.0
        return logits  # [vocab]

    def catch_up(self, requests: list[Request]) -> None:
        for req in requests:
            req.draft.context = list(req.token_ids)
            req.draft.next_logits = self._one_hot_logits(req.draft.context)

    def draft_step(self, requests, token_ids, carried):
        rows = []
        for req, token in zip(requests, token_ids.tolist()):
            req.draft.context.append(token)
            rows.append(self._one_hot_logits(req.draft.context))
        return torch.stack(rows), None  # [m, vocab]
