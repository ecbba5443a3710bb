"""Per-step costs of speculative decoding, as `eval` and the bench scripts measure them: one target forward of n tokens
(n = 1 is a decode step, n = k + 1 a verify) and one draft step of a head (its layer over its KV cache plus the
vocabulary projection), of a draft model (one decode step) or of prompt lookup (one n-gram search), each after a
prefill of the same prompt, at batch 1. Times are the best of 3 rounds: the machine is shared. `eval` measures them
only when asked (`eval.cost_curve`); docs/benchmarks.md has what they measured and where they missed.

`CostCurve` holds them relative to one decode step, and predicts the speedup of k speculative tokens from the
acceptance measured at that k: τ(k) / (verify(k+1)/decode + drafting(k)/decode) (τ: tokens per target forward;
plain decoding makes one token per decode step), drafting(k) being k draft steps, or, for a head that drafts its greedy
chain in one kernel call, that chain of k drafts timed whole (`head_chain_seconds`: only its first step meets caches
the target's weight stream has emptied)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from mtp_train.runtime.attention import BatchInfo, ancestor_mask
from mtp_train.runtime.decode_runner import HeadRunner
from mtp_train.runtime.kv_cache import PageAllocator, Sequence
from mtp_train.runtime.model import CausalLM
from mtp_train.runtime.sampler import SamplingParams
from mtp_train.runtime.spec.hybrid import HybridDraft
from mtp_train.runtime.spec.mtp_chain import MTPChainProposer
from mtp_train.runtime.spec.prompt_lookup import (
    PromptLookup,
    PromptLookupProposer,
    PromptLookupState,
)
from mtp_train.runtime.spec.proposer import Request
from mtp_train.runtime.spec.tree import representative_tree


def _pages(prompt_ids: list[int], extra_tokens: int, page_size: int = 16) -> int:
    return -(-(len(prompt_ids) + extra_tokens) // page_size) + 1


def _synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously; CPU calls return when done)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_seconds(fn, repeats: int, between=None) -> float:
    """Seconds per call of `fn`: 3 warm-up calls, then the best of 3 rounds of `repeats` calls. With `between`, it
    runs (untimed) before each timed call: what runs there in real use (a target forward evicts a draft head's weights
    from the caches)."""
    return interleaved_best_seconds({0: fn}, repeats, rounds=3, between=between)[0]


def interleaved_best_seconds(fns: dict, repeats: int, rounds: int = 3, between=None) -> dict:
    """{key: seconds per call of fns[key]}: the best round of each (`interleaved_round_seconds`)."""
    return {key: min(times) for key, times in interleaved_round_seconds(fns, repeats, rounds, between).items()}


def interleaved_round_seconds(fns: dict, repeats: int, rounds: int = 3, between=None) -> dict:
    """{key: [seconds per call of fns[key] in each round]}: 3 warm-up calls each, then `rounds` rounds in which every
    fn runs `repeats` timed calls in turn. Contenders alternate, so a slow spell of a shared machine (its step times
    and its memory's read rate move within seconds: docs/benchmarks.md) falls on all of them, and the ratios between
    them within a round hold."""
    for fn in fns.values():
        for _ in range(3):
            fn()
    per_round: dict = {key: [] for key in fns}
    for _ in range(rounds):
        for key, fn in fns.items():
            seconds = 0.0
            if between is None:
                start = time.perf_counter()
                for _ in range(repeats):
                    fn()
                seconds = time.perf_counter() - start
            else:
                for _ in range(repeats):
                    between()
                    start = time.perf_counter()
                    fn()
                    seconds += time.perf_counter() - start
            per_round[key].append(seconds / repeats)
    return per_round


def target_step_seconds(target, prompt_ids: list[int], n_tokens: list[int], repeats: int = 20,
                        beside: dict | None = None) -> dict:
    """{n: seconds of one target forward over n new tokens} after the prompt is in the cache, the best of 5
    interleaved rounds. `beside`: {name: fn} timed in the same rounds (e.g. a read of a large buffer, so that a
    fraction of the machine's read bandwidth compares figures measured in the same moments), their seconds per call
    returned under their names."""
    rounds = target_step_rounds(target, prompt_ids, n_tokens, repeats, beside)
    return {key: min(times) for key, times in rounds.items()}


@torch.inference_mode()
def target_step_rounds(target, prompt_ids: list[int], n_tokens: list[int], repeats: int = 20,
                       beside: dict | None = None, rounds: int = 5) -> dict:
    """{n: [seconds of one target forward over n new tokens, per round]}: `target_step_seconds` before the best is
    taken, for ratios taken within each round."""
    allocator = PageAllocator(_pages(prompt_ids, max(n_tokens)), 16)
    cache, seq = target.new_kv_cache(allocator), Sequence(0)
    target(torch.tensor(prompt_ids), BatchInfo.for_sequences([seq], [len(prompt_ids)], allocator), cache)

    def step(n: int) -> None:
        target(torch.tensor(prompt_ids[:n]), BatchInfo.for_sequences([seq], [n], allocator, advance=False), cache)
        _synchronize(target.device)

    return interleaved_round_seconds({n: (lambda n=n: step(n)) for n in n_tokens} | (beside or {}), repeats, rounds)


@torch.inference_mode()
def head_step_seconds(target, head, prompt_ids: list[int], repeats: int = 50) -> float:
    """Seconds of one draft step of `head` (one token, vocabulary projection and argmax included), each after a target
    decode step, as in speculative decoding: the head's weights come from memory, not from a cache that repeated
    head steps keep warm (timed back to back, a head step reads about half its cost in the loop: docs/benchmarks.md)."""
    head = head if isinstance(head, HeadRunner) else HeadRunner(head)  # as the proposers draft through it
    allocator = PageAllocator(2 * _pages(prompt_ids, 1), 16)
    cache, head_cache = target.new_kv_cache(allocator), head.new_kv_cache(allocator)
    seq, head_seq = Sequence(0), Sequence(1)
    out = target(torch.tensor(prompt_ids), BatchInfo.for_sequences([seq], [len(prompt_ids)], allocator), cache,
                 return_hidden=True)
    n = len(prompt_ids) - 1
    head(torch.tensor(prompt_ids[1:]), out.hidden[:-1], BatchInfo.for_sequences([head_seq], [n], allocator), head_cache)
    last_hidden, token = out.hidden[-1:], torch.tensor(prompt_ids[-1:])
    first_row = torch.zeros(1, dtype=torch.long, device=target.device)

    def step() -> None:
        batch = BatchInfo.for_sequences([head_seq], [1], allocator, advance=False)
        head.forward_with_logits(token, last_hidden, batch, head_cache, first_row)  # one kernel call where fused
        _synchronize(target.device)

    def target_step() -> None:
        target(token, BatchInfo.for_sequences([seq], [1], allocator, advance=False), cache)
        _synchronize(target.device)

    return best_seconds(step, repeats, between=target_step)


def lookup_step_seconds(target, lookup: PromptLookup, prompt_ids: list[int], repeats: int = 50) -> float:
    """Seconds of one prompt-lookup draft step over `prompt_ids`: the proposer's catch-up and a greedy proposal of one
    token (the n-gram search), through the proposer's own code."""
    proposer = PromptLookupProposer(target, lookup, allocator=None)
    request = Request(0, list(prompt_ids), [], PromptLookupState())

    def step() -> None:
        proposer.catch_up([request])
        proposer.propose([request], [1], SamplingParams(), None)

    return best_seconds(step, repeats)


@torch.inference_mode()
def head_chain_seconds(target, head, prompt_ids: list[int], k: int, repeats: int = 20) -> float:
    """Seconds of a head's drafting in one greedy speculative step of k drafts, as the loop runs it (the MTP chain
    proposer's `catch_up` of one row and `propose`: one kernel call on the CPU decode path), each after an untimed
    target decode step."""
    allocator = PageAllocator(2 * _pages(prompt_ids, k + 1), 16)
    proposer = MTPChainProposer(target, head, allocator)
    cache, pages = target.new_kv_cache(allocator), []
    request = Request(0, list(prompt_ids), pages, proposer.new_state(0, pages))
    n = len(prompt_ids)
    out = target(torch.tensor(prompt_ids), BatchInfo.for_sequences([request.target_view], [n], allocator), cache,
                 return_hidden=True, aux_layers=proposer.aux_layers)
    states = proposer.target_states(out)  # [n, d (3d)]
    proposer.observe_target(request.draft, states[:-1], 0)  # the prefill's catch-up: rows 0 .. n-2
    proposer.catch_up([request])
    proposer.propose([request], [1], SamplingParams(), None)
    token = torch.tensor(prompt_ids[-1:])

    def step() -> None:
        proposer.observe_target(request.draft, states[n - 2 : n - 1], n - 2)  # one row, as after a verify
        proposer.catch_up([request])
        proposer.propose([request], [k], SamplingParams(), None)
        _synchronize(target.device)

    def target_step() -> None:
        target(token, BatchInfo.for_sequences([request.target_view], [1], allocator, advance=False), cache)
        _synchronize(target.device)

    return best_seconds(step, repeats, between=target_step)


def draft_step_seconds(target, draft, prompt_ids: list[int], repeats: int = 20) -> float:
    """Seconds of one draft step of any draft `speculative_generate` takes: prompt lookup, a draft model (one decode
    step of it) or a head; the hybrid's is its head's (an upper bound: a step that copies from the context runs the
    head's catch-up only)."""
    if isinstance(draft, HybridDraft):
        return head_step_seconds(target, draft.head, prompt_ids, repeats)
    if isinstance(draft, PromptLookup):
        return lookup_step_seconds(target, draft, prompt_ids, repeats)
    if isinstance(draft, CausalLM):
        return target_step_seconds(draft, prompt_ids, [1], repeats)[1]
    return head_step_seconds(target, draft, prompt_ids, repeats)


@dataclass(frozen=True)
class CostCurve:
    """What speculative decoding costs relative to plain decoding, for one target and one draft: the step times the
    speedup of each k follows from, given the acceptance measured at that k."""

    decode_s: float  # one target decode step (1 new token) after the prompt
    verify_over_decode: dict[int, float]  # n verified tokens (n = k + 1) -> one target forward over them ÷ decode_s
    draft_step_over_decode: float  # one draft step ÷ decode_s
    prompt_tokens: int  # the prompt the steps were measured after
    measure_s: float = 0.0  # wall time of the measurement (the target's steps, which drafts share, included)
    # k -> a head's greedy chain of k drafts in one kernel call, timed whole (`head_chain_seconds`), ÷ decode_s; empty
    # for drafts without it (their drafting is k draft steps)
    chain_over_decode: dict[int, float] = field(default_factory=dict)

    def drafting_over_decode(self, k: int) -> float:
        """What drafting k tokens costs per speculative step, in decode steps: the chain timed whole where measured,
        else k draft steps."""
        return self.chain_over_decode.get(k, k * self.draft_step_over_decode)

    def predicted_speedup(self, tau: float, k: int) -> float:
        """τ(k) / (verify(k+1)/decode + drafting(k)/decode): tokens per target forward over the cost of one
        speculative step (one verify of k + 1 tokens and the drafting of k) counted in decode steps."""
        return tau / (self.verify_over_decode[k + 1] + self.drafting_over_decode(k))

    def best_k(self, tau_by_k: dict[int, float]) -> int:
        """The k with the largest predicted speedup, from the τ measured at each k (the smaller k on a tie)."""
        return max(sorted(tau_by_k), key=lambda k: self.predicted_speedup(tau_by_k[k], k))

    @classmethod
    def averaged(cls, curves: list[CostCurve]) -> CostCurve:
        """The mean of curves measured at different moments of one run (e.g. before and after the eval's runs): the
        machine's state during the runs lies between them more often than at either end."""
        first, mean = curves[0], statistics.fmean
        chain_ks = set.intersection(*(set(c.chain_over_decode) for c in curves))
        return cls(mean(c.decode_s for c in curves),
                   {n: mean(c.verify_over_decode[n] for c in curves) for n in first.verify_over_decode},
                   mean(c.draft_step_over_decode for c in curves), first.prompt_tokens,
                   measure_s=sum(c.measure_s for c in curves),
                   chain_over_decode={k: mean(c.chain_over_decode[k] for c in curves) for k in sorted(chain_ks)})

    def as_dict(self) -> dict:
        """The report's form (JSON keys are strings: verify_over_decode is keyed by n = k + 1)."""
        form = {
            "decode_ms": round(self.decode_s * 1e3, 4),
            "verify_over_decode": {str(n): round(ratio, 5) for n, ratio in sorted(self.verify_over_decode.items())},
            "draft_step_over_decode": round(self.draft_step_over_decode, 5),
            "prompt_tokens": self.prompt_tokens,
            "measure_s": round(self.measure_s, 2),
        }
        if self.chain_over_decode:
            form["chain_over_decode"] = {str(k): round(r, 5) for k, r in sorted(self.chain_over_decode.items())}
        return form


def measure_cost_curves(target, drafts: dict[str, object], prompt_ids: list[int], ks: list[int], repeats: int = 5,
                        draft_repeats: int = 20) -> dict[str, CostCurve]:
    """{draft name: its CostCurve}: the target's decode and verify(k + 1) steps measured once (`repeats` calls per
    round, 5 interleaved rounds: the decode step's best round, each verify's ratio to the decode step the median of
    the ratios within each round, so a change of the machine's state between rounds cannot pair a fast decode with a
    slow verify), each draft's step (`draft_repeats` per round, a head's each after an untimed target decode step),
    all after `prompt_ids`."""
    started = time.perf_counter()
    rounds = target_step_rounds(target, prompt_ids, sorted({1, *(k + 1 for k in ks)}), repeats)
    target_s = time.perf_counter() - started
    decode = min(rounds[1])
    verify = {k + 1: statistics.median(n_s / one_s for n_s, one_s in zip(rounds[k + 1], rounds[1])) for k in ks}
    curves = {}
    for name, draft in drafts.items():
        started = time.perf_counter()
        draft_step = draft_step_seconds(target, draft, prompt_ids, draft_repeats) / decode
        chain = {}
        if getattr(draft, "chains_in_one_call", False):  # a head drafting its greedy chain in one kernel call
            chain = {k: head_chain_seconds(target, draft, prompt_ids, k, draft_repeats) / decode for k in ks}
        curves[name] = CostCurve(decode, verify, draft_step, len(prompt_ids),
                                 measure_s=target_s + time.perf_counter() - started, chain_over_decode=chain)
    return curves


@dataclass(frozen=True)
class TreeCost:
    """One target forward over a draft tree of N + 1 tokens (root + N nodes, the tree attention mask) and over N + 1
    causal tokens (a chain verify of the same size), both relative to one decode step: what a tree step costs, and
    what the mask itself adds (`mask_cost`)."""

    verify_over_decode: float
    causal_verify_over_decode: float

    @property
    def mask_cost(self) -> float:
        return self.verify_over_decode / self.causal_verify_over_decode

    def predicted_speedup(self, tau: float, depth: int, draft_step_over_decode: float) -> float:
        """τ / (tree verify/decode + depth · draft step/decode): a tree step runs the head `depth` times (its catch-up
        and depth - 1 tree steps of up to topk rows, each costed as one chain draft step), like a chain of k = depth."""
        return tau / (self.verify_over_decode + depth * draft_step_over_decode)

    def as_dict(self) -> dict:
        return {"verify_over_decode": round(self.verify_over_decode, 5),
                "causal_verify_over_decode": round(self.causal_verify_over_decode, 5),
                "mask_cost": round(self.mask_cost, 4)}


@torch.inference_mode()
def measure_tree_costs(target, prompt_ids: list[int], shapes: list, decode_s: float, repeats: int = 5
                       ) -> dict[str, TreeCost]:
    """{shape label: TreeCost} for each `TreeShape` (its representative tree, `tree.representative_tree`), after
    `prompt_ids`, relative to `decode_s` (one decode step measured on the same target)."""
    nodes = max(shape.nodes for shape in shapes) + 1
    allocator = PageAllocator(_pages(prompt_ids, nodes), 16)
    cache, seq = target.new_kv_cache(allocator), Sequence(0)
    target(torch.tensor(prompt_ids), BatchInfo.for_sequences([seq], [len(prompt_ids)], allocator), cache)
    start = seq.num_cached
    causal = target_step_seconds(target, prompt_ids, sorted({shape.nodes + 1 for shape in shapes}), repeats)
    costs = {}
    for shape in shapes:
        parents, depths = representative_tree(shape)
        mask = ancestor_mask([-1, *parents])
        positions = [start, *(start + d for d in depths)]
        ids = torch.tensor([prompt_ids[i % len(prompt_ids)] for i in range(len(positions))])

        def step() -> None:
            target(ids, BatchInfo.for_tree([seq], [positions], [mask], allocator), cache)
            seq.num_cached = start
            _synchronize(target.device)

        costs[shape.label] = TreeCost(best_seconds(step, repeats) / decode_s, causal[shape.nodes + 1] / decode_s)
    return costs
