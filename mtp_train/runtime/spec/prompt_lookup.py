"""The prompt-lookup (n-gram) proposer (vLLM: ngram_proposer.py), a model-free baseline: the next draft is the token
that followed the most recent earlier occurrence of the context's last n tokens (n from `max_ngram` down to
`min_ngram`); with no match it guesses a repeat of the last token.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import torch

from mtp_train.runtime.host_sync import to_device
from mtp_train.runtime.sampler import SamplingParams
from mtp_train.runtime.spec.proposer import DraftProposal, DraftState, Proposer, Request


@dataclass(frozen=True)
class PromptLookup:
    """The draft to pass to `speculative_generate` for prompt lookup: its n-gram lengths."""

    max_ngram: int = 3
    min_ngram: int = 1


_ID_BYTES = 4  # a token id as a C int in the search buffer (ids are < 2**31)


def ngram_match(tokens: list[int], max_ngram: int = 3, min_ngram: int = 1) -> int | None:
    """Where the continuation of the latest earlier occurrence of the last n tokens starts (the index of the token
    that followed it), longest n first; None without a match.

    Searched as bytes (`bytes.rfind`, C speed) over the ids packed as C ints, keeping the matches that start on an id
    boundary: a Python scan over the slices costs more than the step it saves (figures in docs/benchmarks.md)."""
    haystack = array("i", tokens).tobytes()
    searched_end = (len(tokens) - 1) * _ID_BYTES  # a match must end before the last token (its successor exists)
    for n in range(max_ngram, min_ngram - 1, -1):
        if len(tokens) <= n:
            continue
        pattern = haystack[-n * _ID_BYTES:]
        end = searched_end
        while (found := haystack.rfind(pattern, 0, end)) != -1:
            if found % _ID_BYTES == 0:
                return found // _ID_BYTES + n
            end = found + len(pattern) - 1  # a misaligned match: look for one starting before it
    return None


def ngram_next_token(tokens: list[int], max_ngram: int = 3, min_ngram: int = 1) -> int | None:
    """The token after the latest earlier occurrence of the last n tokens, longest n first; None without a match
    (`ngram_match`)."""
    start = ngram_match(tokens, max_ngram, min_ngram)
    return None if start is None else tokens[start]


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

    def _next_token(self, context: list[int]) -> int:
        token = ngram_next_token(context, self.lookup.max_ngram, self.lookup.min_ngram)
        return context[-1] if token is None else token

    def _one_hot_logits(self, context: list[int]) -> torch.Tensor:
        logits = torch.full((self.vocab_size,), float("-inf"), device=self.device)
        logits[self._next_token(context)] = 0.0
        return logits  # [vocab]

    def catch_up(self, requests: list[Request]) -> None:
        for req in requests:
            req.draft.context = list(req.token_ids)
            req.draft.next_logits = None  # built by `propose` when sampling needs the distribution

    def propose(self, requests: list[Request], num_drafts: list[int], sampling: SamplingParams,
                generator: torch.Generator) -> list[DraftProposal]:
        """Greedy: the looked-up tokens themselves (building a one-hot [vocab] row per draft and arg-maxing it cost more
        than the lookup). Sampling: the shared draft loop over one-hot logits (the draft distribution rejection
        sampling needs)."""
        if not sampling.greedy:
            for req in requests:
                req.draft.next_logits = self._one_hot_logits(req.draft.context)
            return super().propose(requests, num_drafts, sampling, generator)
        proposals = []
        for req, count in zip(requests, num_drafts):
            for _ in range(count):
                req.draft.context.append(self._next_token(req.draft.context))
            drafted = req.draft.context[len(req.draft.context) - count:] if count else []
            proposals.append(DraftProposal(to_device(drafted, torch.long, self.device), None))
        return proposals

    def draft_step(self, requests, token_ids, carried):
        rows = []
        for req, token in zip(requests, token_ids.tolist()):
            req.draft.context.append(token)
            rows.append(self._one_hot_logits(req.draft.context))
        return torch.stack(rows), None  # [m, vocab]
