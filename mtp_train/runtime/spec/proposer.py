"""What every proposer shares (vLLM: one proposer per module under v1/spec_decode/): the request a proposer drafts
for, the base of its per-request state, the draft loop that samples up to k tokens from its logits, and
`make_proposer`, which picks the proposer for a draft.

A proposer is one module: a `Proposer` subclass (`schedule`, `accepts`, `catch_up`, `draft_step`) with its own
`DraftState` subclass. Subclasses register themselves when their module is imported (`spec/__init__.py` imports
them); `make_proposer` takes the one that accepts the draft (at most one does).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mtp_train.errors import UserError
from mtp_train.runtime.host_sync import to_device
from mtp_train.runtime.kv_cache import KVCache, PageAllocator, Sequence
from mtp_train.runtime.model import CausalLM
from mtp_train.runtime.sampler import SamplingParams, processed_probs, sample_from_probs


def rewind(view: Sequence, num_tokens: int) -> None:
    """Forget a view's cached positions >= num_tokens. Pages are not freed here: the request owns them."""
    if num_tokens > view.num_cached:
        raise ValueError(f"cannot rewind sequence {view.seq_id} to {num_tokens} > {view.num_cached} cached")
    view.num_cached = num_tokens


def compact_accepted_path(cache: KVCache, view: Sequence, start: int, path: list[int]) -> None:
    """Move the K/V of the accepted tree nodes (verify nodes `path`, written at slots start + node) to the positions
    start + 1, start + 2, ... right after the root (at `start`), in every layer of `cache`; the caller then rewinds the
    view to start + len(path) + 1. Node numbers grow along a path, so no source is overwritten before it is read."""
    moves = [(start + node, start + 1 + i) for i, node in enumerate(path) if node != i + 1]
    if not moves:
        return
    page_size = cache.page_size

    def slot(position: int) -> int:
        return view.pages[position // page_size] * page_size + position % page_size

    # A layer holds (K, V) pages (KVCache) or one latent tensor (runtime/deepseek.py's LatentCache, MLA).
    storages = [storage for layer in cache.layers
                for storage in (layer if isinstance(layer, (tuple, list)) else (layer,))]
    device = storages[0].device
    src = to_device([slot(s) for s, _ in moves], torch.long, device)
    dst = to_device([slot(d) for _, d in moves], torch.long, device)
    for storage in storages:
        flat = storage.view(-1, *storage.shape[2:])  # [num_pages * page_size, ...]
        flat.index_copy_(0, dst, flat.index_select(0, src))


def accepted_rows(hidden: torch.Tensor, path: list[int]) -> torch.Tensor:
    """The rows of a verify's target states [n + 1, d] the draft keeps after it: the root's (row 0) and the accepted
    nodes' `path`, in order (a chain's accepted drafts are rows 1..a already)."""
    if path == list(range(1, len(path) + 1)):
        return hidden[: len(path) + 1]
    return hidden.index_select(0, to_device([0, *path], torch.long, hidden.device))


@dataclass
class DraftState:
    """A proposer's state for one request; each proposer subclasses it with what it carries between steps."""

    view: Sequence | None = None  # the draft cache's view on the request's pages (None: the proposer has no cache)
    next_logits: torch.Tensor | None = None  # [vocab] fp32: the draft's prediction of the token after the committed

    @property
    def num_cached(self) -> int:
        return self.view.num_cached if self.view is not None else 0

    def clear(self) -> None:
        """Drop what a finished request holds (subclasses also drop their own tensors)."""
        if self.view is not None:
            self.view.num_cached = 0
        self.next_logits = None


@dataclass
class Request:
    """One sequence being generated: its tokens, its block table (one page list shared by target and draft), the
    target's cache view on it and the proposer's state."""

    index: int  # position in the caller's prompt list
    token_ids: list[int]  # prompt + committed generated tokens
    pages: list[int]  # the block table, shared by both views (same list object)
    draft: DraftState
    target_view: Sequence = field(init=False)  # positions whose K/V the target cache holds

    def __post_init__(self) -> None:
        self.target_view = Sequence(self.index, pages=self.pages)

    def trim_pages(self, allocator: PageAllocator) -> None:
        """Free the pages neither view needs any more."""
        needed = -(-max(self.target_view.num_cached, self.draft.num_cached) // allocator.page_size)
        if needed < len(self.pages):
            allocator.free(self.pages[needed:])
            del self.pages[needed:]

    def release(self, allocator: PageAllocator) -> None:
        allocator.free(self.pages)
        self.pages.clear()
        self.target_view.num_cached = 0
        self.draft.clear()


@dataclass
class DraftProposal:
    """One sequence's draft chain. What the speculative step asks of every proposal (a tree's is
    `spec/tree.py`'s `TreeProposal`): its draft tokens in verify order after the root (`tokens`, `size`), the depth of
    each (`depths`) and the verify mask (None: causal); the step verifies every proposal of the batch at once
    (`rejection.greedy_accept_chains` / `rejection_sample_chains`)."""

    draft_token_ids: torch.Tensor  # [k_b] int64
    draft_probs: torch.Tensor | None  # [k_b, vocab] fp32 distributions they were sampled from (None when greedy)

    @property
    def tokens(self) -> list[int]:
        return self.draft_token_ids.tolist()

    @property
    def size(self) -> int:
        return int(self.draft_token_ids.shape[0])

    @property
    def depths(self) -> range:
        return range(1, self.size + 1)

    def verify_mask(self) -> None:
        return None


_PROPOSERS: list[type[Proposer]] = []  # every Proposer subclass, in import order


class Proposer:
    """Drafts tokens for a batch of requests, from a draft whose KV cache (if any) lives on the shared allocator.

    Subclasses implement `accepts` (is `draft` mine?), `catch_up` (feed the draft what the target committed; set each
    request's `draft.next_logits`) and `draft_step` (one autoregressive draft token per request)."""

    schedule = ""
    state_class: type[DraftState] = DraftState
    draft_description = ""  # how make_proposer's error names the drafts this proposer takes ("" = not named)

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        _PROPOSERS.append(cls)

    def __init__(self, target: CausalLM, allocator: PageAllocator, kv_cache: KVCache | None = None):
        self.kv_cache = kv_cache
        self.allocator = allocator
        self.device = target.device
        self.forwards = 0
        self.steps_by_source: dict[str, int] = {}  # a proposer with several drafters: sequence steps each drafted
        # A draft with a reduced vocabulary: draft logits are [m, N] and draft id i is target id draft_ids[i].
        self.draft_ids: torch.Tensor | None = None  # [N] int64
        self.target_vocab_size: int | None = None
        # Target layers (0-based outputs) whose states the draft reads instead of the final hidden state (an EAGLE-3
        # head: three); the engine asks the target's prefill and verify forwards for them.
        self.aux_layers: tuple[int, ...] = ()

    @classmethod
    def accepts(cls, draft) -> bool:
        raise NotImplementedError

    def new_state(self, index: int, pages: list[int]) -> DraftState:
        """The state of request `index`: with a draft cache, a view on the request's page list."""
        return self.state_class(view=Sequence(index, pages=pages) if self.kv_cache is not None else None)

    def check_lengths(self, prompts: list[list[int]], max_new_tokens: int) -> None:
        """Raise UserError if the draft cannot hold prompt + max_new_tokens positions (a draft model's limit)."""

    def target_states(self, out) -> torch.Tensor:
        """The per-token target states this proposer drafts from, out of a target forward's `ForwardOutput` (run
        with `return_hidden=True, aux_layers=self.aux_layers`): the final hidden state H [n, d], or with aux layers
        their outputs concatenated in `aux_layers` order [n, len(aux_layers) * d]."""
        if not self.aux_layers:
            return out.hidden
        return torch.cat([out.aux_hidden[j] for j in self.aux_layers], dim=-1)

    def observe_target(self, state: DraftState, hidden: torch.Tensor, first_position: int) -> None:
        """The target's states (`target_states`: [n, d], or [n, 3d] for an EAGLE-3 head) at positions
        first_position.. of its last forward over this request (the committed ones only); a proposer that drafts from
        them keeps them for `catch_up`."""

    def observe_verdict(self, state: DraftState, verdict) -> None:
        """The verify's verdict on this request's proposal (`RejectionResult`, with every draft read back in
        `drafted`); a proposer whose cache holds drafts checks them against it in `catch_up`."""

    def catch_up(self, requests: list[Request]) -> None:
        raise NotImplementedError

    def draft_step(
        self, requests: list[Request], token_ids: torch.Tensor, carried: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed each request its last draft token (`token_ids` [m]) at its next position; returns the logits for the
        next draft [m, vocab] and the new carried state (MTP: head outputs [m, d]; else None)."""
        raise NotImplementedError

    def initial_carry(self, requests: list[Request]) -> torch.Tensor | None:
        return None

    def _to_target(self, drafted: torch.Tensor, step_probs: torch.Tensor | None):
        """Draft ids [m] -> target ids; draft-vocabulary probabilities [m, N] -> [m, V], zero outside the draft
        vocabulary (rejection sampling stays exact: q is the distribution the draft was sampled from)."""
        if self.draft_ids is None:
            return drafted, step_probs
        if step_probs is not None:
            full = step_probs.new_zeros(step_probs.shape[0], self.target_vocab_size)
            step_probs = full.index_copy_(1, self.draft_ids, step_probs)
        return self.draft_ids[drafted], step_probs

    def propose(
        self,
        requests: list[Request],
        num_drafts: list[int],
        sampling: SamplingParams,
        generator: torch.Generator,
    ) -> list[DraftProposal]:
        """Draft `num_drafts[b]` tokens for request b (0 allowed), starting from the carried `draft.next_logits`.
        The drafts stay on the device: nothing here waits for it (the verify reads them back with its verdicts)."""
        batch_size = len(requests)
        rows = [b for b in range(batch_size) if num_drafts[b] > 0]  # requests drafting at this position
        step_rows: list[list[int]] = []  # per draft position j: the requests that draft a j-th token
        step_drafts: list[torch.Tensor] = []  # per position j: their drafts [m_j] (target ids)
        step_probs: list[torch.Tensor | None] = []  # per position j: [m_j, V] what they were sampled from
        drafted = torch.empty(0, dtype=torch.long)  # [m] the last drafted ids, fed back in the next draft step
        if rows:
            logits = torch.stack([requests[b].draft.next_logits for b in rows])  # [m, vocab]
            carried = self.initial_carry([requests[b] for b in rows])
        for j in range(max(num_drafts, default=0)):
            if j > 0:
                keep = [i for i, b in enumerate(rows) if num_drafts[b] > j]
                if len(keep) < len(rows):  # some requests drafted their last token
                    rows = [rows[i] for i in keep]
                    keep_index = to_device(keep, torch.long, self.device)
                    carried = carried[keep_index] if carried is not None else None
                    drafted = drafted[keep_index]
                logits, carried = self.draft_step([requests[b] for b in rows], drafted, carried)
            if sampling.greedy:
                drafted = logits.argmax(-1)  # [m]
                probs = None
            else:
                probs = processed_probs(logits, sampling)  # [m, vocab]
                drafted = sample_from_probs(probs, generator)  # [m]
            drafted, probs = self._to_target(drafted, probs)  # target ids, [m, V] probabilities
            step_rows.append(rows)
            step_drafts.append(drafted)
            step_probs.append(probs)
        if step_rows and all(len(r) == batch_size for r in step_rows):  # every request drafts the same count
            tokens = torch.stack(step_drafts, dim=1).unbind(0)  # [k] each
            probs_per_request = (torch.stack(step_probs, dim=1).unbind(0) if not sampling.greedy
                                 else [None] * batch_size)  # [k, V] each
            return [DraftProposal(t, q) for t, q in zip(tokens, probs_per_request)]
        proposals = []
        for b in range(batch_size):
            # request b's j-th draft is entry step_rows[j].index(b) of step j (the rows keep their order)
            where = [(j, step_rows[j].index(b)) for j in range(num_drafts[b])]
            if where:
                draft_token_ids = torch.stack([step_drafts[j][i] for j, i in where])  # [k_b]
            else:
                draft_token_ids = torch.empty(0, dtype=torch.long, device=self.device)
            draft_probs = None
            if not sampling.greedy:
                vocab = self.target_vocab_size or requests[b].draft.next_logits.shape[-1]
                draft_probs = (torch.stack([step_probs[j][i] for j, i in where]) if where
                               else torch.zeros(0, vocab, device=self.device))
            proposals.append(DraftProposal(draft_token_ids, draft_probs))
        return proposals


def make_proposer(target: CausalLM, draft, allocator: PageAllocator) -> Proposer:
    """The proposer for `draft`: the registered proposer that accepts it (target–draft for a `CausalLM`, MTP chain
    for a head with forward/logits/new_kv_cache, n-gram lookup for `PromptLookup`)."""
    for proposer_class in _PROPOSERS:
        if proposer_class.accepts(draft):
            return proposer_class(target, draft, allocator)
    kinds = " or ".join(sorted(c.draft_description for c in _PROPOSERS if c.draft_description))
    raise UserError(f"draft must be {kinds}, got {type(draft).__name__}")
