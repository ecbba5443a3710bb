"""The speculative engine's counters (vLLM: spec_decode/metrics.py). τ, α, the mean acceptance length and the
per-position acceptance are defined here only; the evaluation sums these counters over its calls (`SpecStats.add`)."""

from __future__ import annotations

from copy import copy
from dataclasses import dataclass, field, fields


@dataclass
class SpecStats:
    """Counters of one `speculative_generate` call (all sequences together), or the sum of several calls.

    τ (`tau`) = committed tokens per target forward, counted per sequence, including the bonus token and the prefill
    (which commits the first token). `committed_per_verify` (vLLM's "mean acceptance length") leaves the prefill out
    (= k+1 when every draft is accepted). Per-position acceptance is unconditional: accepted at position j / steps
    that drafted a j-th token. Plain decoding counts as the schedule "plain" with k = 0 (τ = 1)."""

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
    # a proposer with several drafters (the hybrid): sequence steps each drafted, by drafter name
    steps_by_source: dict[str, int] = field(default_factory=dict)
    prefill_seconds: float = 0.0  # target prefill + the draft's first catch-up
    decode_seconds: float = 0.0

    def __post_init__(self) -> None:
        if not self.drafted_per_position:
            self.drafted_per_position = [0] * self.num_speculative_tokens
            self.accepted_per_position = [0] * self.num_speculative_tokens

    def add(self, other: SpecStats) -> None:
        """Sum another call's counters (same schedule and k) into these."""
        if (other.schedule, other.num_speculative_tokens) != (self.schedule, self.num_speculative_tokens):
            raise ValueError(f"cannot add {other.schedule} k={other.num_speculative_tokens} counters to "
                             f"{self.schedule} k={self.num_speculative_tokens}")
        for counter in fields(self):
            if counter.name in ("schedule", "num_speculative_tokens"):
                continue
            mine, theirs = getattr(self, counter.name), getattr(other, counter.name)
            if isinstance(mine, dict):
                total = {key: mine.get(key, 0) + theirs.get(key, 0) for key in {**mine, **theirs}}
            elif isinstance(mine, list):
                total = [a + b for a, b in zip(mine, theirs)]
            else:
                total = mine + theirs
            setattr(self, counter.name, total)

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
        counters = ("drafted_per_position", "accepted_per_position", "target_forwards", "target_sequence_forwards",
                    "draft_forwards", "new_tokens", "drafted_tokens", "accepted_tokens")
        return {
            "schedule": self.schedule,
            "num_speculative_tokens": self.num_speculative_tokens,
            **{rate: round(getattr(self, rate), 4) for rate in ("tau", "committed_per_verify", "alpha")},
            "acceptance_per_position": [round(r, 4) for r in self.acceptance_per_position],
            **{name: copy(getattr(self, name)) for name in counters},
            **({"steps_by_source": dict(self.steps_by_source)} if self.steps_by_source else {}),
            "wall_seconds": round(self.wall_seconds, 4),
            "tokens_per_s": round(self.tokens_per_s, 2),
        }
