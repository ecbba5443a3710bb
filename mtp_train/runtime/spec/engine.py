"""The speculative step loop: a proposer (`spec/proposer.py` and one module per schedule) drafts k tokens (a chain,
or a tree whose paths are at most k deep: a chain is a tree of top-k 1), the target verifies them in one forward, the
proposal's rejection sampler (`runtime/rejection.py`) decides which to keep. Chains and trees share one step.

Per step and batch (k drafts): the proposer's catch-up over the tokens the draft has not seen (MTP: accepted+1 rows),
k-1 draft steps, one target verify of the root and every draft per sequence (a tree's under its ancestor mask). The
target's logits and hidden states are carried over from the verify; there is no other target forward.

KV memory: target and draft share ONE `PageAllocator` and one page list (block table) per request; each model has
its own `KVCache` storage over those page ids and its own `Sequence` view (cached length) on the shared list.
Pages are reserved through either view, and freed only by the request (down to what the longer view needs), so no
page is allocated or freed twice. A finished sequence frees its pages at once.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from mtp_train.errors import UserError
from mtp_train.runtime.attention import BatchInfo
from mtp_train.runtime.generate import GenerationResult, Outputs, check_lengths, pages_for
from mtp_train.runtime.host_sync import to_device
from mtp_train.runtime.kv_cache import PageAllocator
from mtp_train.runtime.model import CausalLM
from mtp_train.runtime.rejection import (
    greedy_accept_chains,
    greedy_accept_trees,
    rejection_sample_chains,
    rejection_sample_trees,
)
from mtp_train.runtime.sampler import (
    SamplingParams,
    penalize_repeats,
    processed_probs,
    sample,
    seen_tokens,
    verify_rows_seen,
)
from mtp_train.runtime.spec.proposer import (
    DraftProposal,
    Request,
    accepted_rows,
    compact_accepted_path,
    make_proposer,
    rewind,
)
from mtp_train.runtime.spec.stats import SpecStats
from mtp_train.runtime.spec.tree import DraftTree, TreeProposer

MAX_SPECULATIVE_TOKENS = 8


def chain_input_ids(roots: list[int], proposals: list[DraftProposal], device: torch.device | str) -> torch.Tensor:
    """The verify's input [sum(k_b + 1)]: each sequence's root (its last committed token, on the host) then its
    drafts (on the device), assembled on the device without reading the drafts back."""
    root_ids = to_device(roots, torch.long, device)  # [B]
    sizes = {p.size for p in proposals}
    if len(sizes) == 1:  # every sequence drafts the same count: [B, k + 1] flattened
        drafts = torch.stack([p.draft_token_ids.to(torch.long) for p in proposals])  # [B, k]
        return torch.cat([root_ids[:, None], drafts], dim=1).view(-1)
    return torch.cat([piece for b, p in enumerate(proposals) for piece in (root_ids[b : b + 1], p.draft_token_ids)])


def speculative_pages_for(prompts: list[list[int]], max_new_tokens: int, page_size: int, draft) -> int:
    """Pages a speculative call needs: plain generation's, and for a tree its N + 1 nodes written after the
    committed tokens (their slots run past the positions it drafts)."""
    slack = draft.shape.nodes + 1 if isinstance(draft, DraftTree) else 0
    return pages_for(prompts, max_new_tokens, page_size, slack)


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

    `draft`: a draft head (MTP chain), a `CausalLM` with the target's vocabulary (target–draft), `PromptLookup`, or
    `DraftTree(head, TreeShape(depth, topk, nodes)[, lookup])` (tree drafting, `spec/tree.py`: k is then ignored and
    the stats count per depth). `num_speculative_tokens` k in 1..8; the last step of a sequence drafts fewer when
    fewer tokens remain.
    `allocator`: the page allocator shared by target and draft (default: one sized for the batch); every page is
    back on its free list when this returns. Passed again, it brings the K/V caches built over it the first time
    (`PageAllocator.cache_for`): a caller decoding batch after batch allocates them once.
    `on_tokens(seq_index, new_ids)` streams committed tokens."""
    if not isinstance(num_speculative_tokens, int) or not 1 <= num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
        raise UserError(
            f"num_speculative_tokens must be an integer in 1..{MAX_SPECULATIVE_TOKENS}, got {num_speculative_tokens!r}"
        )
    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    check_lengths(target, prompts, max_new_tokens)
    device = target.device
    # Every position either model caches is < prompt_len + max_new_tokens (the last step drafts fewer), so the plain
    # generation budget is enough for both (a tree's nodes aside: speculative_pages_for).
    allocator = allocator or PageAllocator(speculative_pages_for(prompts, max_new_tokens, page_size, draft), page_size)
    proposer = make_proposer(target, draft, allocator)
    proposer.check_lengths(prompts, max_new_tokens)
    target_cache = allocator.cache_for(target, "target")
    generator = torch.Generator(device=device).manual_seed(seed)
    k = proposer.shape.depth if isinstance(proposer, TreeProposer) else num_speculative_tokens
    stats = SpecStats(schedule=proposer.schedule, num_speculative_tokens=k)
    requests = []
    for i, prompt in enumerate(prompts):
        pages: list[int] = []  # one block table, shared by the target's view and the proposer's
        requests.append(Request(i, list(prompt), pages, proposer.new_state(i, pages)))
    outputs = Outputs(len(prompts), max_new_tokens, stop_token_ids, on_tokens)
    # the repetition penalty's memory: [B, vocab] the ids each request holds (prompt and committed output)
    seen = seen_tokens(prompts, target.config.vocab_size, device) if sampling.penalizes else None

    def commit(req: Request, new_tokens: list[int]) -> bool:
        """Commit tokens (cut after a stop token / at max_new_tokens); free the request's pages and return True
        when it finished."""
        new_tokens = outputs.commit(req.index, new_tokens)
        req.token_ids.extend(new_tokens)
        if seen is not None and new_tokens:
            seen[req.index, new_tokens] = True
        stats.new_tokens += len(new_tokens)
        done = outputs.finished(req.index)
        if done:
            req.release(allocator)
        return done

    def step(active: list[Request]) -> list[Request]:
        """One speculative step for the running requests: draft (a chain of k_b tokens, or a tree whose deepest path
        has k_b), verify every drafted token in one target forward (a tree under its ancestor mask), accept, commit
        the accepted tokens + one, keep only the accepted ones in the target's cache, and let the draft catch up.
        Returns the requests still running."""
        depths = [min(k, outputs.remaining(r.index) - 1) for r in active]  # a step emits up to k_b + 1 tokens
        proposals = proposer.propose(active, depths, sampling, generator)
        verify_starts = [len(r.token_ids) - 1 for r in active]  # position of t_last (the root)
        verify_lens = [p.size + 1 for p in proposals]
        views = [r.target_view for r in active]
        masks = [p.verify_mask() for p in proposals]
        tree = any(mask is not None for mask in masks)
        if tree:  # a tree: node i sits at root position + its depth
            positions = [[start, *(start + d for d in p.depths)] for start, p in zip(verify_starts, proposals)]
            batch = BatchInfo.for_tree(views, positions, masks, allocator, device)
            input_ids = to_device([t for r, p in zip(active, proposals) for t in (r.token_ids[-1], *p.tokens)],
                                  torch.long, device)  # [sum(n_b + 1)]
        else:
            batch = BatchInfo.for_sequences(views, verify_lens, allocator, device)
            input_ids = chain_input_ids([r.token_ids[-1] for r in active], proposals, device)  # [sum(k_b + 1)]
        out = target(input_ids, batch, target_cache, return_hidden=True, aux_layers=proposer.aux_layers)
        stats.target_forwards += 1
        stats.target_sequence_forwards += len(active)
        stats.verify_sequence_steps += len(active)
        hidden_per_request = proposer.target_states(out).split(verify_lens)  # [n_b + 1, d (3d)] each
        target_logits = out.logits  # [sum(n_b + 1), vocab]
        if seen is not None:  # each row penalized for its sequence's tokens and the drafts on its path
            visible = [mask if mask is not None else torch.ones(n, n, dtype=torch.bool).tril()
                       for mask, n in zip(masks, verify_lens)]
            target_logits = penalize_repeats(target_logits, verify_rows_seen(seen[[r.index for r in active]],
                                                                             input_ids, visible),
                                             sampling.repetition_penalty)
        # every sequence's verdict on the device, read back in one transfer
        if tree and sampling.greedy:
            verdicts = greedy_accept_trees(input_ids, target_logits.argmax(-1), [p.parents for p in proposals])
        elif tree:
            verdicts = rejection_sample_trees(input_ids, [p.draft_probs for p in proposals],
                                              processed_probs(target_logits, sampling), [p.parents for p in proposals],
                                              generator)
        elif sampling.greedy:
            verdicts = greedy_accept_chains(input_ids, target_logits.argmax(-1), verify_lens)
        else:
            verdicts = rejection_sample_chains(input_ids, [p.draft_probs for p in proposals],
                                               processed_probs(target_logits, sampling), verify_lens, generator)
        still_active = []
        for req, proposal, start, verdict, hidden in zip(active, proposals, verify_starts, verdicts,
                                                         hidden_per_request):
            accepted_len = len(verdict.path)
            stats.drafted_tokens += proposal.size
            stats.accepted_tokens += accepted_len
            for j in range(max(proposal.depths, default=0)):
                stats.drafted_per_position[j] += 1
                stats.accepted_per_position[j] += int(j < accepted_len)
            if commit(req, verdict.token_ids):
                continue
            # Keep the root and the accepted drafts (a tree's moved into place after the root) in the target cache;
            # the new last token is not cached yet. Rejected rows are cut off (their pages freed by trim_pages).
            compact_accepted_path(target_cache, req.target_view, start, verdict.path)
            rewind(req.target_view, start + accepted_len + 1)
            proposer.observe_target(req.draft, accepted_rows(hidden, verdict.path), start)
            proposer.observe_verdict(req.draft, verdict)
            still_active.append(req)
        if still_active:
            proposer.catch_up(still_active)
            for req in still_active:
                req.trim_pages(allocator)
        return still_active

    try:
        # ---- prefill: target over the prompts, first token, then the draft catches up -----------------------------
        start = time.perf_counter()
        batch = BatchInfo.for_sequences([r.target_view for r in requests], [len(p) for p in prompts], allocator, device)
        input_ids = to_device([t for p in prompts for t in p], torch.long, device)
        out = target(input_ids, batch, target_cache, logits_indices=batch.last_token_indices(), return_hidden=True,
                     aux_layers=proposer.aux_layers)
        stats.target_forwards += 1
        stats.target_sequence_forwards += len(requests)
        first_logits = out.logits if seen is None else penalize_repeats(out.logits, seen, sampling.repetition_penalty)
        first_tokens = sample(first_logits, sampling, generator).tolist()
        hidden_per_request = proposer.target_states(out).split([len(p) for p in prompts])  # [n_b, d (3d)] each
        active = []
        for req, token, hidden in zip(requests, first_tokens, hidden_per_request):
            stats.prefill_tokens += 1
            if not commit(req, [token]):
                proposer.observe_target(req.draft, hidden, 0)
                active.append(req)
        if active:
            proposer.catch_up(active)
        stats.prefill_seconds = time.perf_counter() - start

        # ---- speculative steps ---------------------------------------------------------------------------------
        start = time.perf_counter()
        while active:
            active = step(active)
        stats.decode_seconds = time.perf_counter() - start
    finally:
        for req in requests:
            if req.pages:
                req.release(allocator)
    stats.draft_forwards = proposer.forwards
    stats.steps_by_source = dict(proposer.steps_by_source)
    return outputs.results(), stats
