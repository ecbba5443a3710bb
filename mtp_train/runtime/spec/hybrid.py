"""The hybrid proposer: per step and sequence, a chain from the draft head or one copied from the context, verified
as a chain (k + 1 rows, not a tree's), chosen by what each has shown in this sequence and by the head's confidence.

The two drafters win on different text. Where the reply copies its prompt (extraction, summaries, answers over
documents, code edits) the context's continuation is right for many tokens at a time; where it does not, the head
is. A hybrid tree verifies both at once and pays for every extra row; this proposer picks one chain per step:

- the head's catch-up runs every step (one head forward: its cache must follow the committed tokens whichever
  drafter drafts) and gives the head's first draft d_1 and its probability p_1;
- the context draft: the tokens that followed the latest earlier occurrence of the context's longest suffix n-gram
  (n = `max_ngram` down to `min_ngram`), copied contiguously up to k tokens (vLLM's n-gram proposer's rule);
- the choice, per sequence: no match → the head; a match that starts with d_1 → the context's copy (the head agrees
  on its first token, and the copy goes on for free); otherwise the drafter whose first drafts were accepted more
  often in this sequence so far, the head's rate starting from p_1 (its confidence) and the context's from
  `context_prior`, each updated by its own verdicts (Laplace-smoothed counts);
- the head's chain is `head_tokens` (2) long at most (its acceptance falls with depth, a copy's does not), so at
  k = 4 the hybrid drafts 2 from the head or 4 copied.

The choice depends only on the context and the head's logits, never on a draw, and a context draft's distribution
is one-hot on its token: rejection sampling stays lossless, and greedy output equals plain decoding, as for every
proposer. A step reads the device twice: the head's first drafts with their probabilities, and the verdicts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mtp_train.errors import UserError
from mtp_train.runtime.host_sync import to_device
from mtp_train.runtime.sampler import SamplingParams
from mtp_train.runtime.spec.mtp_chain import MTPChainProposer, MTPChainState
from mtp_train.runtime.spec.prompt_lookup import ngram_match
from mtp_train.runtime.spec.proposer import DraftProposal, Proposer, Request

HEAD, CONTEXT = "head", "context"


@dataclass(frozen=True)
class HybridDraft:
    """The draft to pass to `speculative_generate` for the hybrid schedule: a draft head (or its HeadRunner) and the
    rules that choose between its chain and the context's copy."""

    head: object
    max_ngram: int = 3
    min_ngram: int = 2  # a one-token match copies too often where the text does not repeat
    # the head's chain at most this long (None: k); 2: its third draft is rarely accepted (0.02-0.09 on the demo's
    # head), while copies keep going (docs/benchmarks.md, "The hybrid drafter")
    head_tokens: int | None = 2
    context_prior: float = 0.5  # the context's first-draft acceptance before any verdict of this sequence

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise UserError(f"hybrid: need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")
        if self.head_tokens is not None and self.head_tokens < 1:
            raise UserError(f"hybrid: head_tokens must be >= 1 (or None for k), got {self.head_tokens}")
        if not 0 <= self.context_prior <= 1:
            raise UserError(f"hybrid: context_prior must be in [0, 1], got {self.context_prior}")


@dataclass
class HybridState(MTPChainState):
    source: str = ""  # who drafted this step's chain: HEAD or CONTEXT ("" before the first step)
    # per drafter: [first drafts verified, first drafts accepted] in this sequence
    tallies: dict[str, list[int]] = field(default_factory=lambda: {HEAD: [0, 0], CONTEXT: [0, 0]})


def context_continuation(tokens: list[int], length: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Up to `length` tokens that followed the latest earlier occurrence of the longest suffix n-gram of `tokens`
    (n from max_ngram down to min_ngram), copied contiguously; [] without a match."""
    match = ngram_match(tokens, max_ngram, min_ngram)
    if match is None or length < 1:
        return []
    return tokens[match : match + length]


class HybridProposer(MTPChainProposer):
    """An MTP chain proposer whose chain, per sequence and step, is the head's or the context's copy."""

    schedule = "hybrid"
    state_class = HybridState
    draft_description = "a HybridDraft(head) (hybrid: head or context chain)"

    @classmethod
    def accepts(cls, draft) -> bool:
        return isinstance(draft, HybridDraft)

    def __init__(self, target, hybrid: HybridDraft, allocator):
        super().__init__(target, hybrid.head, allocator)
        self.rules = hybrid

    def observe_verdict(self, state: HybridState, verdict) -> None:
        if state.source and verdict.drafted:
            tally = state.tallies[state.source]
            tally[0] += 1
            tally[1] += int(verdict.accepted_len > 0)

    def _choose(self, req: Request, head_first: int, head_confidence: float, count: int) -> list[int]:
        """This step's context draft for `req` ([] to let the head draft), and the source recorded."""
        rules, state = self.rules, req.draft
        copied = context_continuation(req.token_ids, count, rules.max_ngram, rules.min_ngram)
        if copied and copied[0] != head_first:
            head_seen, head_accepted = state.tallies[HEAD]
            context_seen, context_accepted = state.tallies[CONTEXT]
            head_rate = (head_accepted + head_confidence) / (head_seen + 1)
            context_rate = (context_accepted + rules.context_prior) / (context_seen + 1)
            if context_rate <= head_rate:
                copied = []
        state.source = CONTEXT if copied else HEAD
        self.steps_by_source[state.source] = self.steps_by_source.get(state.source, 0) + 1
        return copied

    def propose(self, requests: list[Request], num_drafts: list[int], sampling: SamplingParams,
                generator: torch.Generator) -> list[DraftProposal]:
        self._run_catch_up(requests)
        drafting = [b for b, count in enumerate(num_drafts) if count > 0]
        copies: dict[int, list[int]] = {}
        if drafting:  # one read: the head's first draft and its probability, for every drafting request
            first_logits = torch.stack([requests[b].draft.next_logits for b in drafting]).float()  # [m, vocab]
            confidence, first = first_logits.softmax(-1).max(-1)  # [m] each
            first = self.draft_ids[first] if self.draft_ids is not None else first
            # both in one transfer (token ids are exact in fp64)
            read = torch.stack([first.double(), confidence.double()]).tolist()
            for b, head_first, head_confidence in zip(drafting, read[0], read[1]):
                copies[b] = self._choose(requests[b], int(head_first), head_confidence, num_drafts[b])
        head_limit = self.rules.head_tokens or max(num_drafts, default=0)
        head_counts = [0 if copies.get(b) else min(count, head_limit) for b, count in enumerate(num_drafts)]
        head_proposals = Proposer.propose(self, requests, head_counts, sampling, generator)
        proposals = []
        for b, proposal in enumerate(head_proposals):
            copied = copies.get(b)
            if not copied:
                proposals.append(proposal)
                continue
            draft_probs = None
            if not sampling.greedy:  # one-hot: the copy is what the context drafter "samples"
                vocab = self.target_vocab_size or requests[b].draft.next_logits.shape[-1]
                draft_probs = torch.zeros(len(copied), vocab, device=self.device)
                rows = torch.arange(len(copied), device=self.device)
                draft_probs[rows, to_device(copied, torch.long, self.device)] = 1.0
            proposals.append(DraftProposal(to_device(copied, torch.long, self.device), draft_probs))
        return proposals
