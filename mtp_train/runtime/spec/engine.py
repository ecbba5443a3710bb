"""The speculative step loop: a proposer (`spec/proposer.py` and one module per schedule) drafts k tokens, the target
verifies them in one forward, the rejection sampler (`runtime/rejection.py`) decides how many to keep.

Per step and batch (k drafts): the proposer's catch-up over the tokens the draft has not seen (MTP: accepted+1 rows),
k-1 single-token draft steps, one target verify of k+1 tokens per sequence. The target's logits and hidden states
are carried over from the verify; there is no other target forward.

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
from mtp_train.runtime.kv_cache import PageAllocator
from mtp_train.runtime.model import CausalLM
from mtp_train.runtime.rejection import RejectionResult, greedy_accept, rejection_sample
from mtp_train.runtime.sampler import SamplingParams, processed_probs, sample
from mtp_train.runtime.spec.proposer import DraftProposal, Request, make_proposer, rewind
from mtp_train.runtime.spec.stats import SpecStats
from mtp_train.runtime.spec.tree import DraftTree, TreeProposer, compact_accepted_path

MAX_SPECULATIVE_TOKENS = 8


def verify(
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

    `draft`: a draft head (MTP chain), a `CausalLM` with the target's vocabulary (target–draft), `PromptLookup`, or
    `DraftTree(head, TreeShape(depth, topk, nodes)[, lookup])` (tree drafting, `spec/tree.py`: k is then ignored and
    the stats count per depth). `num_speculative_tokens` k in 1..8; the last step of a sequence drafts fewer when
    fewer tokens remain.
    `allocator`: the page allocator shared by target and draft (default: one sized for the batch); every page is
    back on its free list when this returns. `on_tokens(seq_index, new_ids)` streams committed tokens."""
    if not isinstance(num_speculative_tokens, int) or not 1 <= num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
        raise UserError(
            f"num_speculative_tokens must be an integer in 1..{MAX_SPECULATIVE_TOKENS}, got {num_speculative_tokens!r}"
        )
    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    check_lengths(target, prompts, max_new_tokens)
    device = target.device
    # Every position either model caches is < prompt_len + max_new_tokens (the last step drafts fewer), so the plain
    # generation budget is enough for both.
    # A tree writes its N + 1 nodes after the committed tokens (its slots run past the positions it drafts).
    slack = draft.shape.nodes + 1 if isinstance(draft, DraftTree) else 0
    allocator = allocator or PageAllocator(pages_for(prompts, max_new_tokens, page_size, slack), page_size)
    proposer = make_proposer(target, draft, allocator)
    proposer.check_lengths(prompts, max_new_tokens)
    target_cache = target.new_kv_cache(allocator)
    generator = torch.Generator(device=device).manual_seed(seed)
    k = num_speculative_tokens if not isinstance(proposer, TreeProposer) else proposer.shape.depth
    stats = SpecStats(schedule=proposer.schedule, num_speculative_tokens=k)
    requests = []
    for i, prompt in enumerate(prompts):
        pages: list[int] = []  # one block table, shared by the target's view and the proposer's
        requests.append(Request(i, list(prompt), pages, proposer.new_state(i, pages)))
    outputs = Outputs(len(prompts), max_new_tokens, stop_token_ids, on_tokens)

    def commit(req: Request, new_tokens: list[int]) -> bool:
        """Commit tokens (cut after a stop token / at max_new_tokens); free the request's pages and return True
        when it finished."""
        new_tokens = outputs.commit(req.index, new_tokens)
        req.token_ids.extend(new_tokens)
        stats.new_tokens += len(new_tokens)
        done = outputs.finished(req.index)
        if done:
            req.release(allocator)
        return done

    def tree_step(active: list[Request]) -> list[Request]:
        """One tree step: draft a tree per sequence (depth never more than can still be emitted), verify all its
        nodes in one target forward with the tree mask, commit the accepted path + one token, keep only the
        accepted path in the target's cache; returns the requests still running."""
        depths = [min(k, outputs.remaining(r.index) - 1) for r in active]
        trees = proposer.propose_tree(active, depths, sampling, generator)
        verify_starts = [r.target_view.num_cached for r in active]  # position of t_last (the root)
        positions = [[start, *(start + d for d in tree.depths)] for start, tree in zip(verify_starts, trees)]
        batch = BatchInfo.for_tree([r.target_view for r in active], positions, [t.verify_mask() for t in trees],
                                   allocator, device)
        input_ids = torch.tensor([t for r, tree in zip(active, trees) for t in (r.token_ids[-1], *tree.tokens)],
                                 device=device)
        out = target(input_ids, batch, target_cache, return_hidden=True, aux_layers=proposer.aux_layers)
        stats.target_forwards += 1
        stats.target_sequence_forwards += len(active)
        stats.verify_sequence_steps += len(active)
        verify_lens = [tree.size + 1 for tree in trees]
        logits_per_request = out.logits.split(verify_lens)  # [n_b + 1, vocab] each
        hidden_per_request = proposer.target_states(out).split(verify_lens)  # [n_b + 1, d (3d)] each
        still_active = []
        for req, tree, start, logits, hidden in zip(active, trees, verify_starts, logits_per_request,
                                                    hidden_per_request):
            verdict = tree.accept(logits, req.token_ids[-1], sampling, generator)
            accepted_len = len(verdict.path)
            stats.drafted_tokens += tree.size
            stats.accepted_tokens += accepted_len
            for j in range(max(tree.depths, default=0)):
                stats.drafted_per_position[j] += 1
                stats.accepted_per_position[j] += int(j < accepted_len)
            if commit(req, verdict.token_ids):
                continue
            # Keep the root and the accepted path (moved into place) in the target cache; the new last token is not
            # cached yet. Rows of the rejected nodes are cut off (their pages freed by trim_pages below).
            compact_accepted_path(target_cache, req.target_view, start, verdict.path)
            rewind(req.target_view, start + accepted_len + 1)
            proposer.observe_target(req.draft, hidden[[0, *verdict.path]], start)
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
        input_ids = torch.tensor([t for p in prompts for t in p], device=device)
        out = target(input_ids, batch, target_cache, logits_indices=batch.last_token_indices(), return_hidden=True,
                     aux_layers=proposer.aux_layers)
        stats.target_forwards += 1
        stats.target_sequence_forwards += len(requests)
        first_tokens = sample(out.logits, sampling, generator).tolist()
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
            if isinstance(proposer, TreeProposer):
                active = tree_step(active)
                continue
            # Draft: never more than can still be emitted (a step emits up to k_b + 1 tokens).
            num_drafts = [min(k, outputs.remaining(r.index) - 1) for r in active]
            proposals = proposer.propose(active, num_drafts, sampling, generator)

            # Verify: [t_last, d_1..d_k] per sequence in one target forward.
            verify_lens = [k_b + 1 for k_b in num_drafts]
            batch = BatchInfo.for_sequences([r.target_view for r in active], verify_lens, allocator, device)
            verify_ids = [[r.token_ids[-1], *p.draft_token_ids.tolist()] for r, p in zip(active, proposals)]
            input_ids = torch.tensor([t for ids in verify_ids for t in ids], device=device)  # [sum(k_b + 1)]
            out = target(input_ids, batch, target_cache, return_hidden=True,
                         aux_layers=proposer.aux_layers)  # logits [sum(k_b + 1), vocab]
            stats.target_forwards += 1
            stats.target_sequence_forwards += len(active)
            stats.verify_sequence_steps += len(active)
            verdicts = verify(proposals, list(out.logits.split(verify_lens)), sampling, generator)
            hidden_per_request = proposer.target_states(out).split(verify_lens)  # [k_b + 1, d (3d)] each

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
                rewind(req.target_view, verify_start + accepted_len + 1)
                proposer.observe_target(req.draft, hidden[: accepted_len + 1], verify_start)
                still_active.append(req)
            active = still_active
            if active:
                proposer.catch_up(active)
                for req in active:
                    req.trim_pages(allocator)
        stats.decode_seconds = time.perf_counter() - start
    finally:
        for req in requests:
            if req.pages:
                req.release(allocator)
    stats.draft_forwards = proposer.forwards
    return outputs.results(), stats
