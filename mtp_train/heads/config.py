"""`HeadConfig`: what a draft head is (kind, depth, init) and which target it belongs to. Stored as
`head_config.json` next to the head's weights; the layer shapes themselves come from the target's config."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

from mtp_train.errors import UserError
from mtp_train.runtime.config import ModelConfig

HEAD_KINDS = ("mtp", "eagle1")
HEAD_INITS = ("random", "last_layer")


@dataclass(frozen=True)
class HeadConfig:
    """A draft head's architecture. `kind`: "mtp" (DeepSeek-style, restored enorm/hnorm/final norm) or "eagle1"
    (fc with bias, no input norms, no final norm). `hidden_size`, `vocab_size`, `model_type` are the target's and are
    checked when the head is loaded against a target."""

    hidden_size: int
    vocab_size: int
    model_type: str
    kind: str = "mtp"
    num_layers: int = 1
    init: str = "random"  # "random": normal(0, init_range) (learned faster, docs/tuning.md); "last_layer": copy the
    # target's last decoder layer
    draft_vocab_size: int | None = None  # None = the full vocabulary; N = the head predicts N target tokens (d2t/t2d)
    target_fingerprint: str | None = None  # hash of the target it was trained for; checked on load when both known
    aux_layers: tuple[int, ...] = ()  # target layers whose outputs the head reads (EAGLE-3, later); empty for now

    def __post_init__(self) -> None:
        object.__setattr__(self, "aux_layers", tuple(int(j) for j in self.aux_layers))
        if self.kind not in HEAD_KINDS:
            raise UserError(f"head kind {self.kind!r} is not supported; expected one of {', '.join(HEAD_KINDS)}")
        if self.init not in HEAD_INITS:
            raise UserError(f"head init {self.init!r} is not supported; expected one of {', '.join(HEAD_INITS)}")
        if self.num_layers < 1:
            raise UserError(f"head num_layers must be >= 1, got {self.num_layers}")
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise UserError(
                f"head draft_vocab_size must be between 1 and the target's vocab_size {self.vocab_size} (or null for "
                f"the full vocabulary), got {self.draft_vocab_size}"
            )
        if self.aux_layers:
            raise UserError(
                f"head aux_layers {list(self.aux_layers)} (EAGLE-3 inputs) are not supported yet; expected []"
            )

    @staticmethod
    def for_target(config: ModelConfig, target_fingerprint: str | None = None, **options: Any) -> "HeadConfig":
        """A head config for the target `config`; `options` are kind, num_layers, init, ..."""
        return HeadConfig(hidden_size=config.hidden_size, vocab_size=config.vocab_size, model_type=config.model_type,
                          target_fingerprint=target_fingerprint, **options)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["aux_layers"] = list(self.aux_layers)
        return data

    @staticmethod
    def from_dict(data: dict[str, Any], source: str = "head config") -> "HeadConfig":
        """Build from a dict (e.g. parsed JSON). Unknown or missing keys are UserErrors naming them and `source`."""
        if not isinstance(data, dict):
            raise UserError(f"{source}: expected a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(HeadConfig)}
        unknown = sorted(set(data) - known)
        if unknown:
            expected = ", ".join(sorted(known))
            raise UserError(f"{source}: unknown key(s) {', '.join(unknown)}; expected some of {expected}")
        required = ("hidden_size", "vocab_size", "model_type")
        missing = [key for key in required if key not in data]
        if missing:
            raise UserError(f"{source}: missing key(s) {', '.join(missing)}")
        try:
            return HeadConfig(**data)
        except (UserError, TypeError) as err:
            raise UserError(f"{source}: {err}") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @staticmethod
    def from_json(text: str, source: str = "head config") -> "HeadConfig":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise UserError(f"{source}: invalid JSON ({err})") from None
        return HeadConfig.from_dict(data, source)


# The defaults of the options a recipe's `head` section sets (recipe.HeadSection reads them from here).
HEAD_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(HeadConfig) if f.name in ("kind", "num_layers", "init")}
