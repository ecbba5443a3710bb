"""Run plain and speculative decoding on the same prompts with the same settings and collect acceptance and speed.

Every method answers each prompt turn by turn with its own earlier answers (batch 1, so tokens/s is the latency a
single user sees). Greedy speculative outputs must equal plain greedy outputs; `greedy_match` records whether they did.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tqdm import tqdm

from mtp_train.evaluate.prompts import EvalPrompt
from mtp_train.runtime.chat import encode_chat
from mtp_train.runtime.generate import generate
from mtp_train.runtime.sampler import SamplingParams
from mtp_train.runtime.speculative import speculative_generate


@dataclass
class MethodTotals:
    """Counters of one method over a set of prompts (all categories, or one)."""

    new_tokens: int = 0
    seconds: float = 0.0
    target_forwards: int = 0  # per sequence, prefill included (τ's denominator)
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    turns: int = 0
    matched_turns: int = 0  # greedy: turns whose output equals plain decoding's
    # Greedy turns that diverged: the target's logit gap between plain's and this method's token at the first
    # differing position (a near-zero gap is a floating-point tie flipped by a different batch shape, not a bug).
    divergence_gaps: list[float] = field(default_factory=list)
    # Later turns whose prompt already differs from plain's (an earlier turn parted): not comparable.
    context_diverged_turns: int = 0

    def add(self, new_tokens, seconds, target_forwards, drafted=None, accepted=None, matched=None, gap=None,
            context_diverged=False):
        self.new_tokens += new_tokens
        self.seconds += seconds
        self.target_forwards += target_forwards
        if drafted is not None:
            if not self.drafted_per_position:
                self.drafted_per_position = [0] * len(drafted)
                self.accepted_per_position = [0] * len(drafted)
            self.drafted_per_position = [a + b for a, b in zip(self.drafted_per_position, drafted)]
            self.accepted_per_position = [a + b for a, b in zip(self.accepted_per_position, accepted)]
        self.turns += 1
        self.matched_turns += int(bool(matched))
        if gap is not None:
            self.divergence_gaps.append(gap)
        self.context_diverged_turns += int(context_diverged)

    def summary(self, plain: "MethodTotals | None" = None) -> dict:
        tokens_per_s = self.new_tokens / self.seconds if self.seconds else 0.0
        out = {
            "new_tokens": self.new_tokens,
            "seconds": round(self.seconds, 3),
            "tokens_per_s": round(tokens_per_s, 2),
            "tau": round(self.new_tokens / self.target_forwards, 4) if self.target_forwards else 0.0,
            "turns": self.turns,
        }
        if self.drafted_per_position:
            drafted, accepted = sum(self.drafted_per_position), sum(self.accepted_per_position)
            out["alpha"] = round(accepted / drafted, 4) if drafted else 0.0
            # Unconditional rate: accepted at position j / drafts at position j.
            out["acceptance_per_position"] = [
                round(a / d, 4) if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)
            ]
            out["greedy_match"] = self.matched_turns == self.turns
            out["matched_turns"] = self.matched_turns
            out["context_diverged_turns"] = self.context_diverged_turns
            if self.divergence_gaps:
                out["max_divergence_logit_gap"] = round(max(self.divergence_gaps), 4)
        if plain is not None and plain.seconds and self.seconds:
            out["speedup"] = round(tokens_per_s / (plain.new_tokens / plain.seconds), 4)
        return out


def divergence_gap(target, prompt_ids: list[int], plain: list[int], other: list[int]) -> float | None:
    """|logit(plain token) - logit(other token)| of the target at the first position where two greedy outputs
    differ (None if one is a prefix of the other)."""
    import torch

    from mtp_train.runtime.attention import BatchInfo

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
) -> dict[str, dict[str, MethodTotals]]:
    """Returns totals[method][category] (category "all" included); methods: "plain" and "<name>@k=<k>"."""
    methods = ["plain"] + [f"{name}@k={k}" for name in drafts for k in ks]
    totals: dict[str, dict[str, MethodTotals]] = {m: {} for m in methods}
    # Warm-up (kernel selection, allocator) outside the timings.
    warm = _turn_ids(tokenizer, prompts[0], [], 0)[:16]
    generate(target, [warm], 4, sampling, seed=seed)
    for draft in drafts.values():
        speculative_generate(target, draft, [warm], 4, ks[0], sampling, seed=seed)

    num_turns = sum(1 if p.prompt_ids is not None else len(p.turns) for p in prompts)
    progress = tqdm(total=num_turns * len(methods), desc="eval", unit="gen", disable=not show_progress)
    for prompt in prompts:
        plain_answers: list[list[int]] = []
        plain_prompts: list[list[int]] = []
        for method in methods:
            answers: list[str] = []
            turns = 1 if prompt.prompt_ids is not None else len(prompt.turns)
            for turn in range(turns):
                ids = _turn_ids(tokenizer, prompt, answers, turn)
                start = time.perf_counter()
                if method == "plain":
                    results, stats = generate(target, [ids], max_new_tokens, sampling, stop_token_ids, seed=seed)
                    seconds = time.perf_counter() - start
                    record = dict(target_forwards=stats.target_forwards)
                    plain_answers.append(results[0].token_ids)
                    plain_prompts.append(ids)
                else:
                    name, k = method.rsplit("@k=", 1)
                    results, stats = speculative_generate(
                        target, drafts[name], [ids], max_new_tokens, int(k), sampling, stop_token_ids, seed=seed
                    )
                    seconds = time.perf_counter() - start
                    same_context = ids == plain_prompts[turn]
                    matched = same_context and results[0].token_ids == plain_answers[turn]
                    record = dict(
                        target_forwards=stats.target_sequence_forwards,
                        drafted=stats.drafted_per_position,
                        accepted=stats.accepted_per_position,
                        matched=matched,
                        gap=None if matched or not same_context or not sampling.greedy else divergence_gap(
                            target, ids, plain_answers[turn], results[0].token_ids),
                        context_diverged=not same_context,
                    )
                output = results[0].token_ids
                for category in ("all", prompt.category):
                    totals[method].setdefault(category, MethodTotals()).add(len(output), seconds, **record)
                answers.append(tokenizer.decode([t for t in output if t not in stop_token_ids], skip_special_tokens=True))
                progress.update(1)
    progress.close()
    return totals
