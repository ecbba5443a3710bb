"""The target–draft proposer: a smaller `CausalLM` with the target's vocabulary decodes k tokens; after the verify
its cache is cut back to the committed tokens it has already seen, and it is run on the ones it has not (the
corrected/bonus token, plus d_k when all drafts were accepted); those logits give the next d_1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mtp_train.errors import UserError
from mtp_train.runtime.attention import BatchInfo
from mtp_train.runtime.generate import check_lengths
from mtp_train.runtime.host_sync import to_device
from mtp_train.runtime.model import CausalLM
from mtp_train.runtime.spec.proposer import DraftState, Proposer, Request, rewind


@dataclass
class TargetDraftState(DraftState):
    synced: int = 0  # the draft cache's positions < synced hold committed tokens
    fed_drafts: int = 0  # drafts cached after them (fed to the draft), not yet verified
    unverified: list[int] = field(default_factory=list)  # their tokens, from the verify's verdict


class TargetDraftProposer(Proposer):
    """Drafts with a smaller `CausalLM` sharing the target's vocabulary."""

    schedule = "target_draft"
    state_class = TargetDraftState
    draft_description = "a CausalLM (target–draft)"

    @classmethod
    def accepts(cls, draft) -> bool:
        return isinstance(draft, CausalLM)

    def __init__(self, target: CausalLM, draft: CausalLM, allocator):
        if draft.config.vocab_size != target.config.vocab_size:
            raise UserError(
                f"the draft model's vocab_size={draft.config.vocab_size} differs from the target's "
                f"vocab_size={target.config.vocab_size}; a draft model must share the target's tokenizer and vocabulary"
            )
        super().__init__(target, allocator, allocator.cache_for(draft, "draft"))
        self.draft = draft

    def check_lengths(self, prompts: list[list[int]], max_new_tokens: int) -> None:
        check_lengths(self.draft, prompts, max_new_tokens)

    def catch_up(self, requests: list[Request]) -> None:
        """Cut the draft cache back to the committed tokens it has seen and run it on the rest (the prompt and first
        token after the prefill; the corrected/bonus token, plus d_k when all drafts were accepted, after a verify)."""
        new_token_ids, counts = [], []
        for req in requests:
            state = req.draft
            valid = state.synced
            for token in state.unverified:
                if valid >= len(req.token_ids) or req.token_ids[valid] != token:
                    break
                valid += 1
            rewind(state.view, valid)
            new_token_ids.extend(req.token_ids[valid:])
            counts.append(len(req.token_ids) - valid)
            state.synced, state.fed_drafts, state.unverified = len(req.token_ids), 0, []
        batch = BatchInfo.for_sequences([r.draft.view for r in requests], counts, self.allocator, self.device)
        input_ids = to_device(new_token_ids, torch.long, self.device)
        logits = self.draft(input_ids, batch, self.kv_cache, logits_indices=batch.last_token_indices()).logits
        self.forwards += 1
        for b, req in enumerate(requests):
            req.draft.next_logits = logits[b]

    def draft_step(self, requests, token_ids, carried):
        batch = BatchInfo.for_sequences([r.draft.view for r in requests], [1] * len(requests), self.allocator,
                                        self.device)
        logits = self.draft(token_ids, batch, self.kv_cache).logits  # [m, vocab]
        self.forwards += 1
        for req in requests:  # the tokens come back with the verdict (`observe_verdict`), not read here
            req.draft.fed_drafts += 1
        return logits, None

    def observe_verdict(self, state: TargetDraftState, verdict) -> None:
        """The drafts this request's cache holds after `synced` are the first `fed_drafts` of its proposal."""
        state.unverified = list(verdict.drafted[: state.fed_drafts])
