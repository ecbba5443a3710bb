"""The MTP chain proposer (vLLM: eagle.py): a draft head (`forward(token_ids, hidden, batch, kv_cache)`,
`logits(out)`, `new_kv_cache(allocator)`, e.g. `mtp_train.heads.DraftHead`) whose row at position i reads
`(H_i, t_{i+1})` (docs/design.md). An EAGLE-3 head (heads/eagle3.py, `aux_layers`) reads the target's aux layer states
[3d] instead of H_i in its catch-up rows and fuses them itself; its draft steps read its own (pre-norm) outputs, as
vLLM's EAGLE-3 proposer feeds them back.

After the target has processed positions up to L-2 (L = committed tokens), the head runs over the rows
`(H_i, t_{i+1})` it has not seen yet, with the target's own hidden states; the last of them, `(H_{L-2}, t_{L-1})`,
gives draft d_1. Each further draft feeds the head its own output and its last draft at the next position. After the
verify, the head's cache is cut back to where the draft chain started and those positions are recomputed from the
verify's (exact) hidden states, in the same forward that yields the next d_1.

`catch_up` only records those rows; `propose` runs them, then drafts with the shared draft loop
(`Proposer.propose`). The head runs through a `decode_runner.HeadRunner` (a bare head gets a plain one): each head
forward and its logits is one call (`forward_with_logits`), and greedy, where the CPU decode path has it, the catch-up
and the k - 1 draft steps are one call (`greedy_chain`): after a target forward has emptied the caches, the Python
between a head's kernel calls costs about as much as the kernels (docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtp_train.errors import UserError
from mtp_train.runtime.attention import BatchInfo
from mtp_train.runtime.decode_runner import HeadRunner
from mtp_train.runtime.host_sync import to_device
from mtp_train.runtime.spec.proposer import DraftProposal, DraftState, Proposer, Request, rewind


@dataclass
class MTPChainState(DraftState):
    target_hidden: torch.Tensor | None = None  # [m, d] H (EAGLE-3: [m, 3d] aux states) at hidden_start .. L-2
    hidden_start: int = 0
    head_hidden: torch.Tensor | None = None  # [d]: the head's output of the row (H_{L-2}, t_{L-1})

    @property
    def pending(self) -> bool:
        """Catch-up rows recorded (`target_hidden`) and not run yet: `propose` runs them."""
        return self.target_hidden is not None

    def clear(self) -> None:
        super().clear()
        self.target_hidden = self.head_hidden = None


class MTPChainProposer(Proposer):
    """Drafts with a head reading `(hidden, token)` rows: the target's hidden states for committed positions, its
    own outputs for the draft chain."""

    schedule = "mtp_chain"
    state_class = MTPChainState
    draft_description = "a draft head (forward, logits, new_kv_cache) or its HeadRunner (MTP chain)"

    @classmethod
    def accepts(cls, draft) -> bool:
        return callable(draft) and all(callable(getattr(draft, name, None)) for name in ("logits", "new_kv_cache"))

    def __init__(self, target, head, allocator):
        head_config = getattr(head, "config", None)
        for key in ("vocab_size", "hidden_size"):
            head_value, target_value = getattr(head_config, key, None), getattr(target.config, key)
            if head_value is not None and head_value != target_value:
                raise UserError(f"the draft head's {key}={head_value} differs from the target's {key}={target_value}")
        super().__init__(target, allocator, allocator.cache_for(head, "draft"))
        self.head = head if isinstance(head, HeadRunner) else HeadRunner(head)
        self.aux_layers = tuple(getattr(head, "aux_layers", ()))  # an EAGLE-3 head reads these target layers
        draft_ids = getattr(head, "draft_ids", None)
        if draft_ids is not None:  # a reduced draft vocabulary
            self.draft_ids, self.target_vocab_size = draft_ids.to(self.device), head.config.vocab_size

    def observe_target(self, state: MTPChainState, hidden: torch.Tensor, first_position: int) -> None:
        state.target_hidden, state.hidden_start = hidden, first_position

    def catch_up(self, requests: list[Request]) -> None:
        """Rows (H_i, t_{i+1}) for i = hidden_start .. L-2: rebuilds the head's cache from where the draft chain
        started (or from 0 after the prefill); the last row's output gives the next first draft. Checked and recorded
        here, run by `propose`."""
        for req in requests:
            state = req.draft
            num_rows = state.target_hidden.shape[0]
            if state.hidden_start + num_rows != len(req.token_ids) - 1:
                raise RuntimeError(
                    f"sequence {req.index}: target hidden covers positions {state.hidden_start}..."
                    f"{state.hidden_start + num_rows - 1}, expected up to {len(req.token_ids) - 2}"
                )
            rewind(state.view, state.hidden_start)

    def _catch_up_rows(self, requests: list[Request]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """The pending rows of `requests`: token ids [T], target states [T, d (3d)], rows per request."""
        token_ids, row_counts = [], []
        for req in requests:
            state = req.draft
            num_rows = state.target_hidden.shape[0]
            token_ids.extend(req.token_ids[state.hidden_start + 1 : state.hidden_start + 1 + num_rows])
            row_counts.append(num_rows)
        hidden = (requests[0].draft.target_hidden if len(requests) == 1
                  else torch.cat([r.draft.target_hidden for r in requests]))  # [sum rows, d]
        return to_device(token_ids, torch.long, self.device), hidden, row_counts

    def _run_catch_up(self, requests: list[Request]) -> None:
        """The head's forward over the pending rows; sets each request's head state and next-token logits."""
        requests = [r for r in requests if r.draft.pending]
        if not requests:
            return
        token_ids, hidden, row_counts = self._catch_up_rows(requests)
        batch = BatchInfo.for_sequences([r.draft.view for r in requests], row_counts, self.allocator, self.device)
        newest_rows = batch.last_token_indices()  # [batch]: rows (H_{L-2}, t_{L-1})
        out, logits = self._forward(token_ids, hidden, batch, newest_rows)
        self.forwards += 1
        newest = out[newest_rows]  # [batch, d]
        for b, req in enumerate(requests):
            state = req.draft
            state.head_hidden, state.next_logits, state.target_hidden = newest[b], logits[b], None

    def initial_carry(self, requests: list[Request]) -> torch.Tensor:
        return torch.stack([r.draft.head_hidden for r in requests])  # [m, d]

    def draft_step(self, requests, token_ids, carried):
        """One draft step (each request's last draft `token_ids` [m] and the head's last output `carried` [m, d] at
        its next position): (logits [m, vocab], outputs [m, d])."""
        batch = BatchInfo.for_sequences([r.draft.view for r in requests], [1] * len(requests), self.allocator,
                                        self.device)
        self.forwards += 1
        out, logits = self._forward(token_ids, carried, batch, torch.arange(len(requests), device=self.device))
        return logits, out

    def propose(self, requests, num_drafts, sampling, generator):
        """The pending catch-up, then the shared draft loop; greedy, the whole chain in one call where the head has
        it."""
        if sampling.greedy:
            chained = self._greedy_chain(requests, num_drafts)
            if chained is not None:
                return chained
        self._run_catch_up(requests)
        return super().propose(requests, num_drafts, sampling, generator)

    def _greedy_chain(self, requests: list[Request], num_drafts: list[int]) -> list[DraftProposal] | None:
        """The pending catch-up and the whole greedy chain in one call (`HeadRunner.greedy_chain`), when every request
        has its catch-up pending and drafts the same number of tokens; None otherwise (or where the head has no such
        path), nothing done."""
        count = num_drafts[0] if num_drafts else 0
        if (not self.head.chains_in_one_call or count < 1 or any(n != count for n in num_drafts)
                or not all(r.draft.pending for r in requests)):
            return None
        token_ids, hidden, row_counts = self._catch_up_rows(requests)
        batch = BatchInfo.for_sequences([r.draft.view for r in requests], row_counts, self.allocator, self.device,
                                        reserve_ahead=count - 1)
        result = self.head.greedy_chain(token_ids, hidden, batch, self.kv_cache, count, self.draft_ids)
        if result is None:  # not served: undo the batch's advance, the step-by-step path runs the rows
            for req in requests:
                rewind(req.draft.view, req.draft.hidden_start)
            return None
        drafts = result[2]  # [B, count] target ids
        self.forwards += count
        for req in requests:
            state = req.draft
            # The next step's catch-up starts again from the target's states: no head state is read before it (the
            # head output and logits stay with the kernel call; sampling never takes this path).
            state.head_hidden = state.next_logits = state.target_hidden = None
            state.view.num_cached += count - 1  # the draft steps' positions, as the step-by-step chain leaves them
        return [DraftProposal(row, None) for row in drafts.unbind(0)]

    def _forward(self, token_ids: torch.Tensor, hidden: torch.Tensor, batch: BatchInfo,
                 logits_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over rows (hidden, token) [T]: (its output [T, d], the logits of `logits_rows` [R, vocab]), one
        kernel call where the CPU decode path has it (`HeadRunner.forward_with_logits`)."""
        out, logits, _ = self.head.forward_with_logits(token_ids, hidden, batch, self.kv_cache, logits_rows)
        return out, logits
