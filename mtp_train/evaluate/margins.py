"""How close a greedy answer is to a tie, and how far a precision path moves it.

A greedy step picks the top-1 logit; a path that rounds differently (bf16 GEMMs, bf16 decode weights, a bf16 K/V
cache, int8 weights, another CPU's kernels) moves every logit by up to its *error*. Where a step's top-1/top-2
*margin* exceeds twice that error, no such rounding can swap the two: the step is safe on that path. Where it does
not, the path may pick another token there, and a greedy answer diverges from that step on (a 135M model then often
loops). Anything that asserts a real model's greedy text or argmax checks the margins first, so that a prompt too
close to a tie fails by saying so instead of flaking on another CPU (`scripts/prompt_margins.py` reports them).

Shapes: `logits` are [steps, vocab] fp32, row i the logits the i-th answer token was chosen from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SAFETY_FACTOR = 2.0  # a step is safe when margin > SAFETY_FACTOR × error (the top two moved in opposite directions)


def top2_margins(logits: torch.Tensor) -> torch.Tensor:
    """[steps, vocab] -> [steps]: top-1 minus top-2 logit."""
    top2 = logits.float().topk(2, dim=-1).values
    return top2[:, 0] - top2[:, 1]


@torch.no_grad()
def reference_answer(hf_model, prompt_ids: list[int], max_new_tokens: int,
                     stop_token_ids: tuple[int, ...]) -> tuple[list[int], torch.Tensor]:
    """Transformers' greedy answer to `prompt_ids` (the stop token included when one ended it) and the logits
    [len(answer), vocab] each answer token was chosen from (one teacher-forced forward)."""
    out = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                            eos_token_id=list(stop_token_ids), pad_token_id=stop_token_ids[0])
    answer = out[0, len(prompt_ids):].tolist()
    return answer, reference_logits(hf_model, prompt_ids, answer)


@torch.no_grad()
def reference_logits(hf_model, prompt_ids: list[int], answer_ids: list[int]) -> torch.Tensor:
    """[len(answer_ids), vocab] fp32: a transformers model's logits for each answer token (one forward)."""
    logits = hf_model(torch.tensor([prompt_ids + answer_ids])).logits[0].float()
    return logits[len(prompt_ids) - 1 : -1]


@torch.inference_mode()
def decode_logits(model, prompt_ids: list[int], answer_ids: list[int], page_size: int = 16) -> torch.Tensor:
    """[len(answer_ids), vocab] fp32: our runtime's logits for each answer token, computed as `generate` computes
    them (a paged prefill of the prompt, then one decode step per answer token but the last, over the path's K/V
    cache): the rows its decode kernels serve, not a prefill's."""
    from mtp_train.runtime.attention import BatchInfo
    from mtp_train.runtime.kv_cache import PageAllocator, Sequence

    allocator = PageAllocator(-(-(len(prompt_ids) + len(answer_ids)) // page_size) + 1, page_size=page_size)
    cache, sequence = model.new_kv_cache(allocator), Sequence(0)
    device = model.device
    try:
        batch = BatchInfo.for_sequences([sequence], [len(prompt_ids)], allocator, device)
        rows = [model(torch.tensor(prompt_ids, device=device), batch, cache,
                      logits_indices=batch.last_token_indices()).logits]
        for token in answer_ids[:-1]:
            batch = BatchInfo.for_sequences([sequence], [1], allocator, device)
            rows.append(model(torch.tensor([token], device=device), batch, cache).logits)
    finally:
        sequence.release(allocator)
    return torch.cat(rows).float().cpu()


@dataclass
class MarginCheck:
    """One answer's margins (the reference's) against one path's errors, step by step."""

    margins: list[float]  # reference top-1 minus top-2, per step
    errors: list[float]  # the path's largest |Δlogit| over the vocabulary, per step

    @classmethod
    def of(cls, reference: torch.Tensor, path: torch.Tensor) -> "MarginCheck":
        return cls(top2_margins(reference).tolist(), (path.float() - reference.float()).abs().amax(-1).tolist())

    @property
    def ratios(self) -> list[float]:
        return [m / e if e > 0 else float("inf") for m, e in zip(self.margins, self.errors)]

    @property
    def smallest_ratio(self) -> float:
        return min(self.ratios, default=float("inf"))

    @property
    def weakest_step(self) -> int:
        ratios = self.ratios
        return min(range(len(ratios)), key=ratios.__getitem__)

    def unsafe_steps(self, factor: float = SAFETY_FACTOR) -> list[int]:
        return [i for i, r in enumerate(self.ratios) if r <= factor]

    def describe(self, factor: float = SAFETY_FACTOR) -> str:
        step = self.weakest_step
        return (f"smallest margin/error {self.smallest_ratio:.2f} at step {step} (margin {self.margins[step]:.3f}, "
                f"error {self.errors[step]:.3f}; safe above {factor:g}); largest error {max(self.errors):.3f}")


def clear_prefix_length(logits: torch.Tensor, error: float) -> int:
    """How many leading steps of `logits` [steps, vocab] have a margin above SAFETY_FACTOR × `error`: the tokens two
    paths within `error` of each other must agree on before one of them may part at a near-tie."""
    for step, margin in enumerate(top2_margins(logits).tolist()):
        if margin <= SAFETY_FACTOR * error:
            return step
    return int(logits.shape[0])


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (one ending first counts), None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass
class Divergence:
    """Where two greedy decodings of one prompt on one model part, and whether rounding explains it: at that step
    the decode path's logits give `margin` between the plain token and the other (≥ 0 on a plain decode), and the
    same logits computed as a verify computes them (the last rows of the context in one forward over the cached
    rest) differ from the decode's by up to `rounding`. A tie when margin ≤ SAFETY_FACTOR × rounding."""

    step: int
    margin: float
    rounding: float

    @property
    def is_tie(self) -> bool:
        return self.margin <= SAFETY_FACTOR * self.rounding

    def describe(self) -> str:
        verdict = "a near-tie" if self.is_tie else "NOT a near-tie"
        return (f"parts at new token {self.step}: margin {self.margin:.4f} against a rounding of {self.rounding:.4f} "
                f"between the decode and verify paths ({verdict})")


@torch.inference_mode()
def verify_logits(model, context_ids: list[int], first_new: int, rows: int = 4, page_size: int = 16) -> torch.Tensor:
    """[vocab] fp32: the logits after `context_ids` computed as a speculative verify computes them: the context up
    to its last `rows` tokens (not before `first_new`, the first generated one) prefilled into the cache, then those
    tokens in one forward (k + 1 rows); the last row's logits."""
    from mtp_train.runtime.attention import BatchInfo
    from mtp_train.runtime.kv_cache import PageAllocator, Sequence

    split = max(first_new, len(context_ids) - rows)
    allocator = PageAllocator(-(-len(context_ids) // page_size) + 1, page_size=page_size)
    cache, sequence = model.new_kv_cache(allocator), Sequence(0)
    device = model.device
    try:
        batch = BatchInfo.for_sequences([sequence], [split], allocator, device)
        logits = model(torch.tensor(context_ids[:split], device=device), batch, cache,
                       logits_indices=batch.last_token_indices()).logits
        if split < len(context_ids):
            batch = BatchInfo.for_sequences([sequence], [len(context_ids) - split], allocator, device)
            logits = model(torch.tensor(context_ids[split:], device=device), batch, cache).logits
    finally:
        sequence.release(allocator)
    return logits[-1].float().cpu()


def explain_divergence(model, prompt_ids: list[int], plain_ids: list[int], other_ids: list[int]) -> Divergence | None:
    """None when `other_ids` equals `plain_ids` (a plain greedy decoding); else where they part and by how much:
    the plain decode path's logits at that step (teacher-forced over the shared tokens) give the margin between the
    plain token and the other's, and the same step computed as a verify (`verify_logits`) how far the verify's
    rounding moves those logits."""
    step = first_divergence(plain_ids, other_ids)
    if step is None:
        return None
    if step >= min(len(plain_ids), len(other_ids)):  # one stopped (or was cut) earlier: no token to compare
        return Divergence(step, float("inf"), 0.0)
    shared = plain_ids[:step]
    decode = decode_logits(model, prompt_ids, shared + [plain_ids[step]])[-1]  # [vocab]
    verify = verify_logits(model, prompt_ids + shared, len(prompt_ids))
    margin = float(decode[plain_ids[step]] - decode[other_ids[step]])
    return Divergence(step, margin, float((decode - verify).abs().max()))
