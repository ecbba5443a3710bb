"""Run plain and speculative decoding on the same prompts with the same settings and collect acceptance and speed.

Every method answers each prompt turn by turn with its own earlier answers. At batch 1 tokens/s is the latency a
single user sees; at batch B the prompts are taken B at a time, and each turn of the B conversations is one call of the
engine (sequences that finish leave the batch and free their pages), so tokens/s is a server's throughput and the
speedup what speculation buys it at that batch size. Greedy speculative outputs must equal plain greedy outputs at the
same batch size; `greedy_match` records whether they did.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm import tqdm

from mtp_train.evaluate.prompts import EvalPrompt
from mtp_train.runtime.attention import BatchInfo
from mtp_train.runtime.chat import encode_chat
from mtp_train.runtime.generate import generate
from mtp_train.runtime.kv_cache import PageAllocator
from mtp_train.runtime.sampler import SamplingParams
from mtp_train.runtime.spec import SpecStats, speculative_generate
from mtp_train.runtime.spec.engine import speculative_pages_for

PLAIN = "plain"


@dataclass
class PromptSpeed:
    """One method on one prompt (all its turns): tokens generated and the wall time they took."""

    tokens: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


@dataclass
class MethodTotals:
    """One method over a set of prompts (all categories, or one): the engine's own counters summed over the calls
    (`SpecStats`: τ, α, mean acceptance length, per-position acceptance), the wall time measured around each call
    (tokens/s and speedup, in total and per prompt) and the greedy comparison with plain decoding."""

    engine: SpecStats | None = None
    seconds: float = 0.0
    per_prompt: dict[int, PromptSpeed] = field(default_factory=dict)  # prompt (batch) index -> its turns together
    turns: int = 0
    matched_turns: int = 0  # greedy: turns whose output equals plain decoding's
    # Greedy turns that diverged: the target's logit gap between plain's and this method's token at the first
    # differing position (a near-zero gap is a floating-point tie flipped by a different batch shape, not a bug).
    divergence_gaps: list[float] = field(default_factory=list)
    # Later turns whose prompt already differs from plain's (an earlier turn parted): not comparable.
    context_diverged_turns: int = 0

    def add(self, prompt_index: int, engine: SpecStats, seconds: float, turns: int = 1, matched_turns: int = 0,
            gaps: tuple[float, ...] = (), context_diverged_turns: int = 0) -> None:
        """One call (one turn of the `turns` conversations of prompt, or batch, `prompt_index`) with the engine's
        counters, its wall time, and the greedy comparison of its `turns` outputs with plain decoding's."""
        if self.engine is None:
            self.engine = SpecStats(engine.schedule, engine.num_speculative_tokens)
        self.engine.add(engine)
        self.seconds += seconds
        speed = self.per_prompt.setdefault(prompt_index, PromptSpeed())
        speed.tokens += engine.new_tokens
        speed.seconds += seconds
        self.turns += turns
        self.matched_turns += matched_turns
        self.divergence_gaps.extend(gaps)
        self.context_diverged_turns += context_diverged_turns

    @property
    def tokens_per_s(self) -> float:
        return self.engine.new_tokens / self.seconds if self.seconds else 0.0

    def summary(self, plain: MethodTotals | None = None) -> dict:
        """The report's numbers; with `plain` (plain decoding on the same prompts), the speedup as the ratio of the
        totals' tokens/s and as the median and quartiles of the per-prompt ratios."""
        engine = self.engine
        out = {
            "new_tokens": engine.new_tokens,
            "seconds": round(self.seconds, 3),
            "tokens_per_s": round(self.tokens_per_s, 2),
            "tau": round(engine.tau, 4),
        }
        speculative = engine.num_speculative_tokens > 0
        if speculative:
            out["mean_acceptance_length"] = round(engine.committed_per_verify, 4)
        out["turns"] = self.turns
        if speculative:
            out["alpha"] = round(engine.alpha, 4)
            out["acceptance_per_position"] = [round(a, 4) for a in engine.acceptance_per_position]
            out["greedy_match"] = self.matched_turns == self.turns
            out["matched_turns"] = self.matched_turns
            out["context_diverged_turns"] = self.context_diverged_turns
            if self.divergence_gaps:
                out["max_divergence_logit_gap"] = round(max(self.divergence_gaps), 4)
        if plain is not None and plain.seconds and self.seconds:
            out["speedup"] = round(self.tokens_per_s / plain.tokens_per_s, 4)
            ratios = [speed.tokens_per_s / plain.per_prompt[i].tokens_per_s for i, speed in self.per_prompt.items()
                      if i in plain.per_prompt and plain.per_prompt[i].tokens_per_s > 0]
            if ratios:
                p25, median, p75 = np.percentile(ratios, [25, 50, 75])  # linear interpolation
                out.update(speedup_median=round(float(median), 4), speedup_p25=round(float(p25), 4),
                           speedup_p75=round(float(p75), 4))
        return out


def divergence_gap(target, prompt_ids: list[int], plain: list[int], other: list[int]) -> float | None:
    """|logit(plain token) - logit(other token)| of the target at the first position where two greedy outputs
    differ (None if one is a prefix of the other)."""
    j = next((i for i, (a, b) in enumerate(zip(plain, other)) if a != b), None)
    if j is None:
        return None
    context = torch.tensor(prompt_ids + plain[:j], device=target.device)
    logits = target(context, BatchInfo.without_cache([len(context)], target.device),
                    logits_indices=torch.tensor([len(context) - 1], device=target.device)).logits[0]
    return abs(float(logits[plain[j]] - logits[other[j]]))


def _turn_ids(tokenizer, prompt: EvalPrompt, answers: list[str], turn: int) -> list[int]:
    if prompt.prompt_ids is not None:
        return list(prompt.prompt_ids)
    messages = []
    for j in range(turn):
        messages += [{"role": "user", "content": prompt.turns[j]}, {"role": "assistant", "content": answers[j]}]
    messages.append({"role": "user", "content": prompt.turns[turn]})
    return encode_chat(tokenizer, messages)


def first_turn_ids(tokenizer, prompt: EvalPrompt) -> list[int]:
    """The token ids every method is given first for `prompt` (its first turn, or its fixed prompt ids)."""
    return _turn_ids(tokenizer, prompt, [], 0)


class PagePool:
    """One page allocator for all of an eval's calls, with the K/V caches the models build over it
    (`PageAllocator.cache_for`): allocated once, and again (1.5x what the call needs) only when a call needs more
    pages than the pool holds, instead of a fresh allocator and cache per call."""

    def __init__(self, page_size: int = 16):
        self.page_size = page_size
        self.allocator: PageAllocator | None = None

    def for_call(self, prompts: list[list[int]], max_new_tokens: int, draft=None) -> PageAllocator:
        needed = speculative_pages_for(prompts, max_new_tokens, self.page_size, draft)
        if self.allocator is None or self.allocator.num_pages < needed:
            self.allocator = PageAllocator(needed * 3 // 2 + 1, self.page_size)
        return self.allocator


def run_methods(
    target,
    tokenizer,
    prompts: list[EvalPrompt],
    drafts: dict[str, object],  # method name -> draft (head or CausalLM)
    ks: list[int],
    max_new_tokens: int,
    sampling: SamplingParams,
    stop_token_ids: tuple[int, ...],
    seed: int = 0,
    show_progress: bool = True,
    batch_size: int = 1,
    trees: dict[str, object] | None = None,
) -> dict[str, dict[str, MethodTotals]]:
    """Returns totals[method][category] (category "all" included); methods: "plain", "<name>@k=<k>" and the names of
    `trees` ({method name: a `DraftTree`}, e.g. "mtp@tree=4x2x8"). `batch_size` B: the prompts are answered B at a
    time (per-category figures only at batch 1, where a call holds one prompt)."""
    trees = trees or {}
    methods = [PLAIN] + [f"{name}@k={k}" for name in drafts for k in ks] + list(trees)
    totals: dict[str, dict[str, MethodTotals]] = {m: {} for m in methods}
    # Warm-up (kernel selection, allocator) outside the timings.
    warm = first_turn_ids(tokenizer, prompts[0])[:16]
    generate(target, [warm] * batch_size, 4, sampling, seed=seed)
    for draft in [*drafts.values(), *trees.values()]:
        speculative_generate(target, draft, [warm] * batch_size, 4, ks[0], sampling, seed=seed)

    def num_turns(prompt: EvalPrompt) -> int:
        return 1 if prompt.prompt_ids is not None else len(prompt.turns)

    pages = PagePool()  # every timed call reuses one allocator and its caches
    groups = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
    calls = sum(max(num_turns(p) for p in group) for group in groups)
    progress = tqdm(total=calls * len(methods), desc=f"eval (batch {batch_size})", unit="call",
                    disable=not show_progress)
    for group_index, group in enumerate(groups):
        plain_answers: dict[tuple[int, int], list[int]] = {}  # (prompt in group, turn) -> plain's output
        plain_prompts: dict[tuple[int, int], list[int]] = {}
        for method in methods:
            answers: list[list[str]] = [[] for _ in group]
            for turn in range(max(num_turns(p) for p in group)):
                members = [i for i, p in enumerate(group) if turn < num_turns(p)]
                batch_ids = [_turn_ids(tokenizer, group[i], answers[i], turn) for i in members]
                start = time.perf_counter()
                if method == PLAIN:
                    results, stats = generate(target, batch_ids, max_new_tokens, sampling, stop_token_ids, seed=seed,
                                              allocator=pages.for_call(batch_ids, max_new_tokens))
                    seconds = time.perf_counter() - start
                    # Plain decoding as engine counters (k = 0): one target forward per sequence and token.
                    record = dict(engine=SpecStats(PLAIN, 0, target_sequence_forwards=stats.new_tokens,
                                                   new_tokens=stats.new_tokens))
                    for i, ids, result in zip(members, batch_ids, results):
                        plain_answers[i, turn], plain_prompts[i, turn] = result.token_ids, ids
                else:
                    draft, k = (trees[method], ks[0]) if method in trees else (drafts[method.rsplit("@k=", 1)[0]],
                                                                               int(method.rsplit("@k=", 1)[1]))
                    results, stats = speculative_generate(
                        target, draft, batch_ids, max_new_tokens, k, sampling, stop_token_ids, seed=seed,
                        allocator=pages.for_call(batch_ids, max_new_tokens, draft),
                    )
                    seconds = time.perf_counter() - start
                    matched, gaps, diverged = 0, [], 0
                    for i, ids, result in zip(members, batch_ids, results):
                        if ids != plain_prompts[i, turn]:
                            diverged += 1
                        elif result.token_ids == plain_answers[i, turn]:
                            matched += 1
                        elif sampling.greedy:
                            gap = divergence_gap(target, ids, plain_answers[i, turn], result.token_ids)
                            if gap is not None:
                                gaps.append(gap)
                    record = dict(engine=stats, matched_turns=matched, gaps=tuple(gaps),
                                  context_diverged_turns=diverged)
                categories = ["all"] + ([group[0].category] if batch_size == 1 else [])
                for category in categories:
                    totals[method].setdefault(category, MethodTotals()).add(
                        group_index, seconds=seconds, turns=len(members), **record)
                for i, result in zip(members, results):
                    reply = [t for t in result.token_ids if t not in stop_token_ids]
                    answers[i].append(tokenizer.decode(reply, skip_special_tokens=True))
                progress.update(1)
    progress.close()
    return totals
