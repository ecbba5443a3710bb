"""Plain (non-speculative) batched generation through the paged runtime: one ragged prefill, then decode steps."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from mtp_train.errors import UserError
from mtp_train.runtime.attention import BatchInfo
from mtp_train.runtime.kv_cache import PageAllocator, Sequence
from mtp_train.runtime.model import CausalLM
from mtp_train.runtime.sampler import SamplingParams, penalize_repeats, sample, seen_tokens


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated tokens (the stop token included when one ended the sequence)
    finish_reason: str  # "stop" | "length"


@dataclass
class GenerationStats:
    target_forwards: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    new_tokens: int = 0

    @property
    def tokens_per_s(self) -> float:
        total = self.prefill_seconds + self.decode_seconds
        return self.new_tokens / total if total > 0 else 0.0


def per_sequence(max_new_tokens: int | list[int], num_prompts: int) -> list[int]:
    """`max_new_tokens` as one limit per prompt (a single int applies to all)."""
    if isinstance(max_new_tokens, int):
        return [max_new_tokens] * num_prompts
    if len(max_new_tokens) != num_prompts:
        raise UserError(f"max_new_tokens has {len(max_new_tokens)} limits for {num_prompts} prompts")
    return list(max_new_tokens)


def check_lengths(model: CausalLM, prompts: list[list[int]], max_new_tokens: int | list[int]) -> None:
    limit = model.config.max_position_embeddings
    for i, (prompt, new_tokens) in enumerate(zip(prompts, per_sequence(max_new_tokens, len(prompts)))):
        if not prompt:
            raise UserError(f"prompt {i} is empty")
        if new_tokens < 1:
            raise UserError(f"max_new_tokens of prompt {i} must be >= 1, got {new_tokens}")
        if len(prompt) + new_tokens > limit:
            raise UserError(
                f"prompt {i} has {len(prompt)} tokens; with max_new_tokens={new_tokens} it exceeds the model's "
                f"maximum of {limit} positions (max_position_embeddings)"
            )


def pages_for(prompts: list[list[int]], max_new_tokens: int | list[int], page_size: int, slack_tokens: int = 0) -> int:
    limits = per_sequence(max_new_tokens, len(prompts))
    return sum(-(-(len(p) + n + slack_tokens) // page_size) for p, n in zip(prompts, limits))


class Outputs:
    """The generated tokens of a batch (plain and speculative decoding alike): cut after a stop token and at
    max_new_tokens (one limit for all, or one per sequence), streamed to `on_tokens(seq_index, new_ids)` as they are
    committed."""

    def __init__(self, num_prompts: int, max_new_tokens: int | list[int], stop_token_ids: tuple[int, ...],
                 on_tokens: Callable[[int, list[int]], None] | None):
        self.token_ids: list[list[int]] = [[] for _ in range(num_prompts)]
        self.finish = ["length"] * num_prompts  # "stop" once a stop token was committed
        self.limits = per_sequence(max_new_tokens, num_prompts)
        self.stop, self.on_tokens = set(stop_token_ids), on_tokens

    def remaining(self, index: int) -> int:
        """Tokens sequence `index` may still emit."""
        return self.limits[index] - len(self.token_ids[index])

    def commit(self, index: int, new_tokens: list[int]) -> list[int]:
        """Append tokens to sequence `index`, cut after a stop token / at max_new_tokens; returns those kept."""
        new_tokens = new_tokens[: self.remaining(index)]
        for i, token in enumerate(new_tokens):
            if token in self.stop:
                new_tokens = new_tokens[: i + 1]
                self.finish[index] = "stop"
                break
        self.token_ids[index].extend(new_tokens)
        if self.on_tokens and new_tokens:
            self.on_tokens(index, new_tokens)
        return new_tokens

    def finished(self, index: int) -> bool:
        return self.finish[index] == "stop" or self.remaining(index) <= 0

    def results(self) -> list[GenerationResult]:
        return [GenerationResult(o, f) for o, f in zip(self.token_ids, self.finish)]


@torch.inference_mode()
def generate(
    model: CausalLM,
    prompts: list[list[int]],
    max_new_tokens: int | list[int],
    sampling: SamplingParams = SamplingParams(),
    stop_token_ids: tuple[int, ...] = (),
    seed: int = 0,
    page_size: int = 16,
    allocator: PageAllocator | None = None,
    on_tokens: Callable[[int, list[int]], None] | None = None,
) -> tuple[list[GenerationResult], GenerationStats]:
    """Generate for a batch of tokenized prompts, up to `max_new_tokens` each (an int, or one limit per prompt).
    `on_tokens(seq_index, new_ids)` streams tokens as they come. `allocator` (default: one sized for the batch):
    passed again, it brings the K/V cache built over it the first time (`PageAllocator.cache_for`)."""
    check_lengths(model, prompts, max_new_tokens)
    device = model.device
    allocator = allocator or PageAllocator(pages_for(prompts, max_new_tokens, page_size), page_size)
    kv_cache = allocator.cache_for(model, "target")
    generator = torch.Generator(device=device).manual_seed(seed)
    sequences = [Sequence(i) for i in range(len(prompts))]
    outputs = Outputs(len(prompts), max_new_tokens, stop_token_ids, on_tokens)
    stats = GenerationStats()

    # the repetition penalty's memory: [B, vocab] the ids each sequence holds (prompt and output)
    seen = seen_tokens(prompts, model.config.vocab_size, device) if sampling.penalizes else None

    def next_tokens(seq_indices: list[int], logits: torch.Tensor) -> torch.Tensor:
        if seen is not None:
            logits = penalize_repeats(logits, seen[seq_indices], sampling.repetition_penalty)
        return sample(logits, sampling, generator)

    def commit(seq_indices: list[int], next_ids: torch.Tensor) -> list[int]:
        """Record one sampled token per sequence; return those still running."""
        running = []
        if seen is not None:
            seen[seq_indices, next_ids] = True
        for i, token in zip(seq_indices, next_ids.tolist()):
            outputs.commit(i, [token])
            if outputs.finished(i):
                sequences[i].release(allocator)
            else:
                running.append(i)
        return running

    try:
        start = time.perf_counter()
        batch = BatchInfo.for_sequences(sequences, [len(p) for p in prompts], allocator, device)
        input_ids = torch.tensor([t for p in prompts for t in p], device=device)
        logits = model(input_ids, batch, kv_cache, logits_indices=batch.last_token_indices()).logits
        stats.target_forwards += 1
        active = commit(list(range(len(prompts))), next_tokens(list(range(len(prompts))), logits))
        stats.prefill_seconds = time.perf_counter() - start

        start = time.perf_counter()
        while active:
            batch = BatchInfo.for_sequences([sequences[i] for i in active], [1] * len(active), allocator, device)
            input_ids = torch.tensor([outputs.token_ids[i][-1] for i in active], device=device)
            logits = model(input_ids, batch, kv_cache).logits
            stats.target_forwards += 1
            active = commit(active, next_tokens(active, logits))
        stats.decode_seconds = time.perf_counter() - start
    finally:
        for seq in sequences:
            if seq.pages:
                seq.release(allocator)
    stats.new_tokens = sum(len(o) for o in outputs.token_ids)
    return outputs.results(), stats
