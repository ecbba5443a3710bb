"""The MTP chain proposer (vLLM: eagle.py): a draft head (`forward(token_ids, hidden, batch, kv_cache)`,
`logits(out)`, `new_kv_cache(allocator)`, e.g. `mtp_train.heads.DraftHead`) whose row at position i reads
`(H_i, t_{i+1})` (DESIGN.md). An EAGLE-3 head (heads/eagle3.py, `aux_layers`) reads the target's aux layer states
[3d] instead of H_i in its catch-up rows and fuses them itself; its draft steps read its own (pre-norm) outputs, as
vLLM's EAGLE-3 proposer feeds them back.

After the target has processed positions up to L-2 (L = committed tokens), the head runs over the rows
`(H_i, t_{i+1})` it has not seen yet, with the target's own hidden states; the last of them, `(H_{L-2}, t_{L-1})`,
gives draft d_1. Each further draft feeds the head its own output and its last draft at the next position. After the
verify, the head's cache is cut back to where the draft chain started and those positions are recomputed from the
verify's (exact) hidden states, in the same forward that yields the next d_1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtp_train.errors import UserError
from mtp_train.runtime.attention import BatchInfo
from mtp_train.runtime.spec.proposer import DraftState, Proposer, Request, rewind


@dataclass
class MTPChainState(DraftState):
    target_hidden: torch.Tensor | None = None  # [m, d] H (EAGLE-3: [m, 3d] aux states) at hidden_start .. L-2
    hidden_start: int = 0
    head_hidden: torch.Tensor | None = None  # [d]: the head's output of the row (H_{L-2}, t_{L-1})

    def clear(self) -> None:
        super().clear()
        self.target_hidden = self.head_hidden = None


class MTPChainProposer(Proposer):
    """Drafts with a head reading `(hidden, token)` rows: the target's hidden states for committed positions, its
    own outputs for the draft chain."""

    schedule = "mtp_chain"
    state_class = MTPChainState
    draft_description = "a draft head with forward/logits/new_kv_cache (MTP chain)"

    @classmethod
    def accepts(cls, draft) -> bool:
        return all(callable(getattr(draft, name, None)) for name in ("forward", "logits", "new_kv_cache"))

    def __init__(self, target, head, allocator):
        head_config = getattr(head, "config", None)
        for key in ("vocab_size", "hidden_size"):
            head_value, target_value = getattr(head_config, key, None), getattr(target.config, key)
            if head_value is not None and head_value != target_value:
                raise UserError(f"the draft head's {key}={head_value} differs from the target's {key}={target_value}")
        super().__init__(target, allocator, head.new_kv_cache(allocator))
        self.head = head
        self.aux_layers = tuple(getattr(head, "aux_layers", ()))  # an EAGLE-3 head reads these target layers
        draft_ids = getattr(head, "draft_ids", None)
        if draft_ids is not None:  # a reduced draft vocabulary
            self.draft_ids, self.target_vocab_size = draft_ids.to(self.device), head.config.vocab_size

    def observe_target(self, state: MTPChainState, hidden: torch.Tensor, first_position: int) -> None:
        state.target_hidden, state.hidden_start = hidden, first_position

    def catch_up(self, requests: list[Request]) -> None:
        """Rows (H_i, t_{i+1}) for i = hidden_start .. L-2: rebuilds the head's cache from where the draft chain
        started (or from 0 after the prefill); the last row's output gives the next first draft."""
        token_ids, row_counts = [], []
        for req in requests:
            state = req.draft
            num_rows = state.target_hidden.shape[0]
            if state.hidden_start + num_rows != len(req.token_ids) - 1:
                raise RuntimeError(
                    f"sequence {req.index}: target hidden covers positions {state.hidden_start}..."
                    f"{state.hidden_start + num_rows - 1}, expected up to {len(req.token_ids) - 2}"
                )
            rewind(state.view, state.hidden_start)
            token_ids.extend(req.token_ids[state.hidden_start + 1 : state.hidden_start + 1 + num_rows])
            row_counts.append(num_rows)
        batch = BatchInfo.for_sequences([r.draft.view for r in requests], row_counts, self.allocator, self.device)
        hidden = torch.cat([r.draft.target_hidden for r in requests])  # [sum rows, d]
        out = self.head(torch.tensor(token_ids, device=self.device), hidden, batch, self.kv_cache)  # [sum rows, d]
        self.forwards += 1
        newest = out[batch.last_token_indices()]  # [batch, d]: rows (H_{L-2}, t_{L-1})
        logits = self.head.logits(newest)  # [batch, vocab]
        for b, req in enumerate(requests):
            req.draft.head_hidden, req.draft.next_logits = newest[b], logits[b]
            req.draft.target_hidden = None

    def initial_carry(self, requests: list[Request]) -> torch.Tensor:
        return torch.stack([r.draft.head_hidden for r in requests])  # [m, d]

    def draft_step(self, requests, token_ids, carried):
        batch = BatchInfo.for_sequences([r.draft.view for r in requests], [1] * len(requests), self.allocator,
                                        self.device)
        out = self.head(token_ids, carried, batch, self.kv_cache)  # [m, d]
        self.forwards += 1
        return self.head.logits(out), out
