"""Speculative decoding through the paged runtime: a proposer drafts k tokens, the target verifies them in one
forward, the rejection sampler (`runtime/rejection.py`) decides how many to keep.

Two schedules, picked by the type of `draft`:

- **MTP chain** (`draft` is a draft head: `forward(token_ids, hidden, batch, kv_cache)`, `logits(out)`,
  `new_kv_cache(allocator)`, e.g. `mtp_train.heads.DraftHead`). The head row at position i reads
  `(H_i, t_{i+1})` (DESIGN.md). After the target has processed positions up to L-2 (L = committed tokens), the
  head runs over the rows `(H_i, t_{i+1})` it has not seen yet, with the target's own hidden states; the last of
  them, `(H_{L-2}, t_{L-1})`, gives draft d_1. Each further draft feeds the head its own output and its last draft
  at the next position. After the verify, the head's cache is cut back to where the draft chain started and those
  positions are recomputed from the verify's (exact) hidden states, in the same forward that yields the next d_1.
- **Target–draft** (`draft` is a smaller `CausalLM` with the target's vocabulary): the draft decodes k tokens; after
  the verify its cache is cut back to the committed tokens it has already seen, and it is run on the ones it has not
  (the corrected/bonus token, plus d_k when all drafts were accepted); those logits give the next d_1.

Per step and batch (k drafts): one draft forward over the tokens the draft has not seen (MTP: accepted+1 rows),
k-1 single-token draft forwards, one target verify of k+1 tokens per sequence. The target's logits and hidden states
are carried over from the verify; there is no other target forward.

KV memory: target and draft share ONE `PageAllocator` and one page list (block table) per request; each model has
its own `KVCache` storage over those page ids and its own `Sequence` view (cached length) on the shared list.
Pages are reserved through either view, and freed only by the request (down to what the longer view needs), so no
page is allocated or freed twice. A finished sequence frees its pages at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from mtp_train.errors import UserError
from mtp_train.runtime.attention import BatchInfo
from mtp_train.runtime.generate import GenerationResult, check_lengths, pages_for
from mtp_train.runtime.kv_cache import KVCache, PageAllocator, Sequence
from mtp_train.runtime.model import CausalLM
from mtp_train.runtime.rejection import RejectionResult, greedy_accept, rejection_sample
from mtp_train.runtime.sampler import SamplingParams, processed_probs, sample, sample_from_probs

MAX_SPECULATIVE_TOKENS = 8
SCHEDULE_MTP_CHAIN = "mtp_chain"
SCHEDULE_TARGET_DRAFT = "target_draft"
SCHEDULE_PROMPT_LOOKUP = "prompt_lookup"


# ---- statistics ----------------------------------------------------------------------------------------------------


@dataclass
class SpecStats:
    """Counters of one `speculative_generate` call (all sequences together).

    τ (`tau`) = committed tokens per target forward, counted per sequence, including the bonus token and the prefill
    (which commits the first token). `committed_per_verify` leaves the prefill out (= k+1 when every draft is
    accepted). Per-position acceptance is unconditional: accepted at position j / steps that drafted a j-th token."""

    schedule: str
    num_speculative_tokens: int
    target_forwards: int = 0  # batched target calls: 1 prefill + 1 verify per step
    target_sequence_forwards: int = 0  # target forwards counted per sequence (τ's denominator)
    draft_forwards: int = 0  # batched draft calls
    verify_sequence_steps: int = 0  # verify forwards counted per sequence
    new_tokens: int = 0  # committed (emitted) tokens, after stop / max_new_tokens trimming
    prefill_tokens: int = 0  # committed by the prefill (one per sequence)
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    drafted_per_position: list[int] = field(default_factory=list)  # [k]: steps that drafted a j-th token
    accepted_per_position: list[int] = field(default_factory=list)  # [k]: steps that accepted the j-th draft
    prefill_seconds: float = 0.0  # target prefill + the draft's first catch-up
    decode_seconds: float = 0.0
    draft_seconds: float = 0.0  # part of decode_seconds spent in the proposer

    def __post_init__(self) -> None:
        if not self.drafted_per_position:
            self.drafted_per_position = [0] * self.num_speculative_tokens
            self.accepted_per_position = [0] * self.num_speculative_tokens

    @property
    def tau(self) -> float:
        return self.new_tokens / self.target_sequence_forwards if self.target_sequence_forwards else 0.0

    @property
    def committed_per_verify(self) -> float:
        verified = self.new_tokens - self.prefill_tokens
        return verified / self.verify_sequence_steps if self.verify_sequence_steps else 0.0

    @property
    def alpha(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @property
    def wall_seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "schedule": self.schedule,
            "num_speculative_tokens": self.num_speculative_tokens,
            "tau": round(self.tau, 4),
            "committed_per_verify": round(self.committed_per_verify, 4),
            "alpha": round(self.alpha, 4),
            "acceptance_per_position": [round(r, 4) for r in self.acceptance_per_position],
            "drafted_per_position": list(self.drafted_per_position),
            "accepted_per_position": list(self.accepted_per_position),
            "target_forwards": self.target_forwards,
            "target_sequence_forwards": self.target_sequence_forwards,
            "draft_forwards": self.draft_forwards,
            "new_tokens": self.new_tokens,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "wall_seconds": round(self.wall_seconds, 4),
            "tokens_per_s": round(self.tokens_per_s, 2),
        }


# ---- per-request state ---------------------------------------------------------------------------------------------


def _rewind(view: Sequence, num_tokens: int) -> None:
    """Forget a view's cached positions >= num_tokens. Pages are not freed here: the request owns them."""
    if num_tokens > view.num_cached:
        raise ValueError(f"cannot rewind sequence {view.seq_id} to {num_tokens} > {view.num_cached} cached")
    view.num_cached = num_tokens


@dataclass
class _Request:
    """One sequence being generated: its tokens, its shared block table and one cache view per model."""

    index: int  # position in the caller's prompt list
    token_ids: list[int]  # prompt + committed generated tokens
    prompt_len: int
    pages: list[int] = field(default_factory=list)  # the block table, shared by both views (same list object)
    target_view: Sequence = field(init=False)  # positions whose K/V the target cache holds
    draft_view: Sequence = field(init=False)  # positions whose K/V the draft cache holds
    # From the last target forward, for the MTP head: H at positions hidden_start .. L-2.
    target_hidden: torch.Tensor | None = None  # [m, d]
    hidden_start: int = 0
    # Carried draft state for the next step's first draft.
    draft_logits: torch.Tensor | None = None  # [vocab] fp32: the draft's prediction of token L
    draft_hidden: torch.Tensor | None = None  # [d]: MTP head output of the row (H_{L-2}, t_{L-1})
    # Target–draft: positions < draft_synced hold committed tokens; the next ones hold these (unverified) drafts.
    draft_synced: int = 0
    draft_unverified: list[int] = field(default_factory=list)
    # Prompt lookup: the committed tokens plus this step's drafts (the n-gram search space).
    draft_context: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.target_view = Sequence(self.index, pages=self.pages)
        self.draft_view = Sequence(self.index, pages=self.pages)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    def trim_pages(self, allocator: PageAllocator) -> None:
        """Free the pages neither view needs any more."""
        needed = -(-max(self.target_view.num_cached, self.draft_view.num_cached) // allocator.page_size)
        if needed < len(self.pages):
            allocator.free(self.pages[needed:])
            del self.pages[needed:]

    def release(self, allocator: PageAllocator) -> None:
        allocator.free(self.pages)
        self.pages.clear()
        self.target_view.num_cached = self.draft_view.num_cached = 0
        self.target_hidden = self.draft_logits = self.draft_hidden = None


# ---- proposers -----------------------------------------------------------------------------------------------------


@dataclass
class DraftProposal:
    draft_token_ids: torch.Tensor  # [k_b] int64
    draft_probs: torch.Tensor | None  # [k_b, vocab] fp32 distributions they were sampled from (None when greedy)


class Proposer:
    """Drafts tokens with one draft model whose KV cache lives on the shared allocator (through `draft_view`).

    Subclasses implement `catch_up` (feed the draft what the target committed; set each request's `draft_logits`)
    and `draft_step` (one autoregressive draft token per request)."""

    schedule = ""
    needs_target_hidden = False

    def __init__(self, kv_cache: KVCache, allocator: PageAllocator, device: torch.device):
        self.kv_cache = kv_cache
        self.allocator = allocator
        self.device = device
        self.forwards = 0
        # A draft with a reduced vocabulary: draft logits are [m, N] and draft id i is target id draft_ids[i].
        self.draft_ids: torch.Tensor | None = None  # [N] int64
        self.target_vocab_size: int | None = None

    def _to_target(self, drafted: torch.Tensor, step_probs: torch.Tensor | None):
        """Draft ids [m] -> target ids; draft-vocabulary probabilities [m, N] -> [m, V], zero outside the draft
        vocabulary (rejection sampling stays exact: q is the distribution the draft was sampled from)."""
        if self.draft_ids is None:
            return drafted, step_probs
        if step_probs is not None:
            full = step_probs.new_zeros(step_probs.shape[0], self.target_vocab_size)
            step_probs = full.index_copy_(1, self.draft_ids, step_probs)
        return self.draft_ids[drafted], step_probs

    def catch_up(self, requests: list[_Request]) -> None:
        raise NotImplementedError

    def draft_step(
        self, requests: list[_Request], token_ids: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed each request its last draft token (`token_ids` [m]) at its next position; returns the logits for the
        next draft [m, vocab] and the new carried state (MTP: head outputs [m, d]; else None)."""
        raise NotImplementedError

    def initial_state(self, requests: list[_Request]) -> torch.Tensor | None:
        return None

    def propose(
        self,
        requests: list[_Request],
        num_drafts: list[int],
        sampling: SamplingParams,
        generator: torch.Generator,
    ) -> list[DraftProposal]:
        """Draft `num_drafts[b]` tokens for request b (0 allowed), starting from the carried `draft_logits`."""
        batch_size = len(requests)
        tokens: list[list[int]] = [[] for _ in range(batch_size)]
        probs: list[list[torch.Tensor]] = [[] for _ in range(batch_size)]  # [vocab] rows
        rows = [b for b in range(batch_size) if num_drafts[b] > 0]  # requests drafting at this position
        if rows:
            logits = torch.stack([requests[b].draft_logits for b in rows])  # [m, vocab]
            state = self.initial_state([requests[b] for b in rows])
        for j in range(max(num_drafts, default=0)):
            if j > 0:
                keep = [i for i, b in enumerate(rows) if num_drafts[b] > j]
                rows = [rows[i] for i in keep]
                keep_index = torch.tensor(keep, device=self.device)
                state = state[keep_index] if state is not None else None
                logits, state = self.draft_step([requests[b] for b in rows], drafted[keep_index], state)
            if sampling.greedy:
                drafted = logits.argmax(-1)  # [m]
                step_probs = None
            else:
                step_probs = processed_probs(logits, sampling)  # [m, vocab]
                drafted = sample_from_probs(step_probs, generator)  # [m]
            drafted, step_probs = self._to_target(drafted, step_probs)  # target ids, [m, V] probabilities
            drafted_ids = drafted.tolist()
            prob_rows = step_probs.unbind(0) if step_probs is not None else None
            for i, b in enumerate(rows):
                tokens[b].append(drafted_ids[i])
                if prob_rows is not None:
                    probs[b].append(prob_rows[i])
        proposals = []
        for b in range(batch_size):
            draft_token_ids = torch.tensor(tokens[b], dtype=torch.long, device=self.device)
            draft_probs = None
            if not sampling.greedy:
                vocab = self.target_vocab_size or requests[b].draft_logits.shape[-1]
                draft_probs = torch.stack(probs[b]) if probs[b] else torch.zeros(0, vocab, device=self.device)
            proposals.append(DraftProposal(draft_token_ids, draft_probs))
        return proposals


class MTPChainProposer(Proposer):
    """Drafts with a head reading `(hidden, token)` rows: the target's hidden states for committed positions, its
    own outputs for the draft chain."""

    schedule = SCHEDULE_MTP_CHAIN
    needs_target_hidden = True

    def __init__(self, head, allocator: PageAllocator, device: torch.device):
        super().__init__(head.new_kv_cache(allocator), allocator, device)
        self.head = head
        draft_ids = getattr(head, "draft_ids", None)
        if draft_ids is not None:  # a reduced draft vocabulary
            self.draft_ids, self.target_vocab_size = draft_ids.to(device), head.config.vocab_size

    def catch_up(self, requests: list[_Request]) -> None:
        """Rows (H_i, t_{i+1}) for i = hidden_start .. L-2: rebuilds the head's cache from where the draft chain
        started (or from 0 after the prefill); the last row's output gives the next first draft."""
        token_ids, row_counts = [], []
        for req in requests:
            num_rows = req.target_hidden.shape[0]
            if req.hidden_start + num_rows != len(req.token_ids) - 1:
                raise RuntimeError(
                    f"sequence {req.index}: target hidden covers positions {req.hidden_start}..."
                    f"{req.hidden_start + num_rows - 1}, expected up to {len(req.token_ids) - 2}"
                )
            _rewind(req.draft_view, req.hidden_start)
            token_ids.extend(req.token_ids[req.hidden_start + 1 : req.hidden_start + 1 + num_rows])
            row_counts.append(num_rows)
        batch = BatchInfo.for_sequences([r.draft_view for r in requests], row_counts, self.allocator, self.device)
        hidden = torch.cat([r.target_hidden for r in requests])  # [sum rows, d]
        out = self.head(torch.tensor(token_ids, device=self.device), hidden, batch, self.kv_cache)  # [sum rows, d]
        self.forwards += 1
        newest = out[batch.last_token_indices()]  # [batch, d]: rows (H_{L-2}, t_{L-1})
        logits = self.head.logits(newest)  # [batch, vocab]
        for b, req in enumerate(requests):
            req.draft_hidden, req.draft_logits = newest[b], logits[b]
            req.target_hidden = None

    def initial_state(self, requests: list[_Request]) -> torch.Tensor:
        return torch.stack([r.draft_hidden for r in requests])  # [m, d]

    def draft_step(self, requests, token_ids, state):
        views = [r.draft_view for r in requests]
        batch = BatchInfo.for_sequences(views, [1] * len(requests), self.allocator, self.device)
        out = self.head(token_ids, state, batch, self.kv_cache)  # [m, d]
        self.forwards += 1
        return self.head.logits(out), out


class TargetDraftProposer(Proposer):
    """Drafts with a smaller `CausalLM` sharing the target's vocabulary."""

    schedule = SCHEDULE_TARGET_DRAFT

    def __init__(self, draft: CausalLM, allocator: PageAllocator, device: torch.device):
        super().__init__(draft.new_kv_cache(allocator), allocator, device)
        self.draft = draft

    def catch_up(self, requests: list[_Request]) -> None:
        """Cut the draft cache back to the committed tokens it has seen and run it on the rest (the prompt and first
        token after the prefill; the corrected/bonus token, plus d_k when all drafts were accepted, after a verify)."""
        new_token_ids, counts = [], []
        for req in requests:
            valid = req.draft_synced
            for token in req.draft_unverified:
                if valid >= len(req.token_ids) or req.token_ids[valid] != token:
                    break
                valid += 1
            _rewind(req.draft_view, valid)
            new_token_ids.extend(req.token_ids[valid:])
            counts.append(len(req.token_ids) - valid)
            req.draft_synced, req.draft_unverified = len(req.token_ids), []
        batch = BatchInfo.for_sequences([r.draft_view for r in requests], counts, self.allocator, self.device)
        input_ids = torch.tensor(new_token_ids, device=self.device)
        logits = self.draft(input_ids, batch, self.kv_cache, logits_indices=batch.last_token_indices()).logits
        self.forwards += 1
        for b, req in enumerate(requests):
            req.draft_logits = logits[b]

    def draft_step(self, requests, token_ids, state):
        views = [r.draft_view for r in requests]
        batch = BatchInfo.for_sequences(views, [1] * len(requests), self.allocator, self.device)
        logits = self.draft(token_ids, batch, self.kv_cache).logits  # [m, vocab]
        self.forwards += 1
        for req, token in zip(requests, token_ids.tolist()):
            req.draft_unverified.append(token)
        return logits, None


@dataclass(frozen=True)
class PromptLookup:
    """The prompt-lookup (n-gram) drafter, a model-free baseline: the next draft is the token that followed the most
    recent earlier occurrence of the context's last n tokens (n from `max_ngram` down to `min_ngram`); with no match
    it guesses a repeat of the last token."""

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


class PromptLookupProposer(Proposer):
    """Drafts by n-gram lookup in the sequence itself (no draft model, no KV cache). Its "distribution" is one-hot on
    the looked-up token, so rejection sampling stays exact."""

    schedule = SCHEDULE_PROMPT_LOOKUP

    def __init__(self, lookup: PromptLookup, vocab_size: int, allocator: PageAllocator, device: torch.device):
        super().__init__(None, allocator, device)
        self.lookup, self.vocab_size = lookup, vocab_size

    def _one_hot_logits(self, context: list[int]) -> torch.Tensor:
        token = ngram_next_token(context, self.lookup.max_ngram, self.lookup.min_ngram)
        logits = torch.full((self.vocab_size,), float("-inf"), device=self.device)
        logits[context[-1] if token is None else token] = 0.0
        return logits  # [vocab]

    def catch_up(self, requests: list[_Request]) -> None:
        for req in requests:
            req.draft_context = list(req.token_ids)
            req.draft_logits = self._one_hot_logits(req.draft_context)

    def draft_step(self, requests, token_ids, state):
        rows = []
        for req, token in zip(requests, token_ids.tolist()):
            req.draft_context.append(token)
            rows.append(self._one_hot_logits(req.draft_context))
        return torch.stack(rows), None  # [m, vocab]


def _is_draft_head(draft) -> bool:
    return all(callable(getattr(draft, name, None)) for name in ("forward", "logits", "new_kv_cache"))


def make_proposer(target: CausalLM, draft, allocator: PageAllocator) -> Proposer:
    """The proposer for `draft`: a `CausalLM` -> target–draft; a head (forward/logits/new_kv_cache) -> MTP chain;
    `PromptLookup` -> n-gram lookup."""
    target_vocab = target.config.vocab_size
    if isinstance(draft, PromptLookup):
        return PromptLookupProposer(draft, target_vocab, allocator, target.device)
    if isinstance(draft, CausalLM):
        if draft.config.vocab_size != target_vocab:
            raise UserError(
                f"the draft model's vocab_size={draft.config.vocab_size} differs from the target's "
                f"vocab_size={target_vocab}; a draft model must share the target's tokenizer and vocabulary"
            )
        return TargetDraftProposer(draft, allocator, target.device)
    if _is_draft_head(draft):
        head_config = getattr(draft, "config", None)
        for key in ("vocab_size", "hidden_size"):
            head_value, target_value = getattr(head_config, key, None), getattr(target.config, key)
            if head_value is not None and head_value != target_value:
                raise UserError(f"the draft head's {key}={head_value} differs from the target's {key}={target_value}")
        return MTPChainProposer(draft, allocator, target.device)
    raise UserError(
        f"draft must be a CausalLM (target–draft) or a draft head with forward/logits/new_kv_cache (MTP chain), "
        f"got {type(draft).__name__}"
    )


# ---- the engine ----------------------------------------------------------------------------------------------------


def _verify(
    proposals: list[DraftProposal], target_logits: list[torch.Tensor], sampling: SamplingParams, generator
) -> list[RejectionResult]:
    """Rejection-sample each sequence: `target_logits[b]` [k_b + 1, vocab] from the verify forward."""
    results = []
    for proposal, logits in zip(proposals, target_logits):
        if sampling.greedy:
            results.append(greedy_accept(proposal.draft_token_ids, logits.argmax(-1)))
        else:
            target_probs = processed_probs(logits, sampling)  # [k_b + 1, vocab]
            results.append(rejection_sample(proposal.draft_token_ids, proposal.draft_probs, target_probs, generator))
    return results


@torch.inference_mode()
def speculative_generate(
    target: CausalLM,
    draft,
    prompts: list[list[int]],
    max_new_tokens: int,
    num_speculative_tokens: int = 3,
    sampling: SamplingParams = SamplingParams(),
    stop_token_ids: tuple[int, ...] = (),
    seed: int = 0,
    page_size: int = 16,
    allocator: PageAllocator | None = None,
    on_tokens: Callable[[int, list[int]], None] | None = None,
) -> tuple[list[GenerationResult], SpecStats]:
    """Generate for a batch of tokenized prompts with speculative decoding; the output is distributed exactly as
    `generate(target, ...)` (token-identical in greedy mode, up to float ties).

    `draft`: a draft head (MTP chain schedule) or a `CausalLM` with the target's vocabulary (target–draft schedule).
    `num_speculative_tokens` k in 1..8; the last step of a sequence drafts fewer when fewer tokens remain.
    `allocator`: the page allocator shared by target and draft (default: one sized for the batch); every page is
    back on its free list when this returns. `on_tokens(seq_index, new_ids)` streams committed tokens."""
    if not isinstance(num_speculative_tokens, int) or not 1 <= num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
        raise UserError(
            f"num_speculative_tokens must be an integer in 1..{MAX_SPECULATIVE_TOKENS}, got {num_speculative_tokens!r}"
        )
    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    check_lengths(target, prompts, max_new_tokens)
    if isinstance(draft, CausalLM):
        check_lengths(draft, prompts, max_new_tokens)
    device = target.device
    # Every position either model caches is < prompt_len + max_new_tokens (the last step drafts fewer), so the plain
    # generation budget is enough for both.
    allocator = allocator or PageAllocator(pages_for(prompts, max_new_tokens, page_size), page_size)
    proposer = make_proposer(target, draft, allocator)
    target_cache = target.new_kv_cache(allocator)
    generator = torch.Generator(device=device).manual_seed(seed)
    stop = set(stop_token_ids)
    k = num_speculative_tokens
    stats = SpecStats(schedule=proposer.schedule, num_speculative_tokens=k)
    requests = [_Request(i, list(p), len(p)) for i, p in enumerate(prompts)]
    outputs: list[list[int]] = [[] for _ in prompts]
    finish = ["length"] * len(prompts)

    def commit(req: _Request, new_tokens: list[int]) -> bool:
        """Append tokens (cut after a stop token / at max_new_tokens); free the request's pages and return True
        when it finished."""
        new_tokens = new_tokens[: max_new_tokens - req.num_generated]
        for i, token in enumerate(new_tokens):
            if token in stop:
                new_tokens = new_tokens[: i + 1]
                finish[req.index] = "stop"
                break
        req.token_ids.extend(new_tokens)
        outputs[req.index].extend(new_tokens)
        stats.new_tokens += len(new_tokens)
        if on_tokens and new_tokens:
            on_tokens(req.index, new_tokens)
        done = finish[req.index] == "stop" or req.num_generated >= max_new_tokens
        if done:
            req.release(allocator)
        return done

    try:
        # ---- prefill: target over the prompts, first token, then the draft catches up -----------------------------
        start = time.perf_counter()
        batch = BatchInfo.for_sequences([r.target_view for r in requests], [len(p) for p in prompts], allocator, device)
        input_ids = torch.tensor([t for p in prompts for t in p], device=device)
        out = target(input_ids, batch, target_cache, logits_indices=batch.last_token_indices(), return_hidden=True)
        stats.target_forwards += 1
        stats.target_sequence_forwards += len(requests)
        first_tokens = sample(out.logits, sampling, generator).tolist()
        hidden_per_request = out.hidden.split([len(p) for p in prompts])  # [n_b, d] each
        active = []
        for req, token, hidden in zip(requests, first_tokens, hidden_per_request):
            stats.prefill_tokens += 1
            if not commit(req, [token]):
                if proposer.needs_target_hidden:
                    req.target_hidden, req.hidden_start = hidden, 0
                active.append(req)
        if active:
            proposer.catch_up(active)
        stats.prefill_seconds = time.perf_counter() - start

        # ---- speculative steps ---------------------------------------------------------------------------------
        start = time.perf_counter()
        while active:
            # Draft: never more than can still be emitted (a step emits up to k_b + 1 tokens).
            num_drafts = [min(k, max_new_tokens - r.num_generated - 1) for r in active]
            draft_start = time.perf_counter()
            proposals = proposer.propose(active, num_drafts, sampling, generator)
            stats.draft_seconds += time.perf_counter() - draft_start

            # Verify: [t_last, d_1..d_k] per sequence in one target forward.
            verify_lens = [k_b + 1 for k_b in num_drafts]
            batch = BatchInfo.for_sequences([r.target_view for r in active], verify_lens, allocator, device)
            verify_ids = [[r.token_ids[-1], *p.draft_token_ids.tolist()] for r, p in zip(active, proposals)]
            input_ids = torch.tensor([t for ids in verify_ids for t in ids], device=device)  # [sum(k_b + 1)]
            out = target(input_ids, batch, target_cache, return_hidden=True)  # logits [sum(k_b + 1), vocab]
            stats.target_forwards += 1
            stats.target_sequence_forwards += len(active)
            stats.verify_sequence_steps += len(active)
            verdicts = _verify(proposals, list(out.logits.split(verify_lens)), sampling, generator)
            hidden_per_request = out.hidden.split(verify_lens)  # [k_b + 1, d] each

            still_active = []
            for req, k_b, verdict, hidden in zip(active, num_drafts, verdicts, hidden_per_request):
                accepted_len = verdict.accepted_len
                stats.drafted_tokens += k_b
                stats.accepted_tokens += accepted_len
                for j in range(k_b):
                    stats.drafted_per_position[j] += 1
                    stats.accepted_per_position[j] += int(j < accepted_len)
                verify_start = len(req.token_ids) - 1  # position of t_last
                if commit(req, verdict.token_ids):
                    continue
                # Keep t_last and the accepted drafts in the target cache; the new last token is not cached yet.
                _rewind(req.target_view, verify_start + accepted_len + 1)
                if proposer.needs_target_hidden:
                    req.target_hidden, req.hidden_start = hidden[: accepted_len + 1], verify_start
                still_active.append(req)
            active = still_active
            if active:
                draft_start = time.perf_counter()
                proposer.catch_up(active)
                stats.draft_seconds += time.perf_counter() - draft_start
                for req in active:
                    req.trim_pages(allocator)
        stats.decode_seconds = time.perf_counter() - start
    finally:
        for req in requests:
            if req.pages:
                req.release(allocator)
    stats.draft_forwards = proposer.forwards
    return [GenerationResult(o, f) for o, f in zip(outputs, finish)], stats
