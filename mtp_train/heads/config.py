"""`HeadConfig`: what a draft head is (kind, depth, init) and which target it belongs to. Stored as
`head_config.json` next to the head's weights; the layer shapes themselves come from the target's config."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from mtp_train.errors import UserError
from mtp_train.runtime.config import ModelConfig

HEAD_KINDS = ("mtp", "eagle1", "eagle3")
EAGLE3_NUM_AUX_LAYERS = 3  # EAGLE-3 fuses the target's low, middle and high layer outputs
HEAD_INITS = ("random", "last_layer", "from_checkpoint")
BLOCK_MLPS = ("dense", "moe")  # a DeepSeek target's MTP block: a dense MLP or the target's Mixture of Experts
DEEPSEEK_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")  # runtime.config's (not imported: this module stays torch-free)


def default_eagle3_aux_layers(num_hidden_layers: int) -> tuple[int, int, int]:
    """The layers an EAGLE-3 head reads by default for a target of `num_hidden_layers` layers, in our convention
    (output of decoder layer j, 0-based): vLLM and SGLang default to (2, L // 2, L - 3) counted as "the input of
    layer i" (vLLM's `get_eagle3_default_aux_hidden_state_layers`, captured before layer i runs), i.e. the outputs
    of layers (1, L // 2 - 1, L - 4); e.g. (1, 14, 26) for SmolLM2-135M's 30 layers."""
    L = num_hidden_layers
    return (1, L // 2 - 1, L - 4)


def eagle3_block_config(config: ModelConfig) -> ModelConfig:
    """The decoder block of an EAGLE-3 head's midlayer over a target `config`: the block the engines build for an
    EAGLE-3 draft, not a copy of the target's. vLLM 0.32 picks the draft class by the block's model_type: "qwen3"
    (Eagle3Qwen3ForCausalLM: per-head q/k norms, no biases) for a Qwen3 target, "llama" (Eagle3LlamaForCausalLM: no
    biases, no q/k norms, no sliding window, a SiLU MLP) for every other target, as SpecForge and speculators train
    them. Shapes, norm epsilon and rope are the target's."""
    style = "qwen3" if config.model_type == "qwen3" else "llama"
    return replace(config, model_type=style, attention_bias=False, o_proj_bias=False, mlp_bias=False,
                   qk_norm=style == "qwen3", sliding_window=None, hidden_act="silu", deepseek=None)


@dataclass(frozen=True)
class HeadConfig:
    """A draft head's architecture. `kind`: "mtp" (DeepSeek-style, restored enorm/hnorm/final norm), "eagle1"
    (fc with bias, no input norms, no final norm) or "eagle3" (heads/eagle3.py: fc fuses the outputs of the three
    target layers `aux_layers`, one midlayer whose attention reads cat(input_layernorm(embed), hidden_norm(h)), a
    final norm). `hidden_size`, `vocab_size`, `model_type` are the target's and are checked when the head is loaded
    against a target."""

    hidden_size: int
    vocab_size: int
    model_type: str
    kind: str = "mtp"
    num_layers: int = 1
    init: str = "random"  # "random": normal(0, init_range) (learned faster, docs/benchmarks.md); "last_layer": copy the
    # target's last decoder layer
    draft_vocab_size: int | None = None  # None = the full vocabulary; N = the head predicts N target tokens (d2t/t2d)
    target_fingerprint: str | None = None  # hash of the target it was trained for; checked on load when both known
    # eagle3 only: the target decoder layers (0-based; their outputs, before the final norm) whose states `fc` fuses,
    # low, middle, high: exactly 3. Empty for the other kinds.
    aux_layers: tuple[int, ...] = ()
    # eagle1 only: whether `fc` has a bias. vLLM's EAGLE-1 class builds fc without one (and drops a stored bias), so
    # a head meant for vLLM (`export --format eagle`) is trained with fc_bias=False; an mtp head's eh_proj never has one.
    fc_bias: bool = True
    # mtp on a DeepSeek target only: the decoder block's MLP. "dense" (intermediate_size, the smaller head) or "moe"
    # (the target's routed + shared experts, as DeepSeek-V3 ships its MTP module; needed by init from_checkpoint).
    block_mlp: str = "dense"

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
        if not self.fc_bias and self.kind == "mtp":
            raise UserError(
                "head fc_bias=false (recipe head.fc_bias) applies to eagle1 heads; an mtp head's eh_proj has no bias"
            )
        self._check_deepseek()
        if self.kind == "eagle3":
            self._check_eagle3()
        elif self.aux_layers:
            raise UserError(
                f"head aux_layers {list(self.aux_layers)} are the inputs of an eagle3 head; a {self.kind} head reads "
                "the target's final hidden state only (expected [])"
            )

    def _check_deepseek(self) -> None:
        """DeepSeek targets get the DeepSeek-V3 MTP module (an MLA block); block_mlp and from_checkpoint are theirs."""
        deepseek = self.model_type in DEEPSEEK_MODEL_TYPES
        if self.block_mlp not in BLOCK_MLPS:
            raise UserError(
                f"head block_mlp {self.block_mlp!r} is not supported; expected one of {', '.join(BLOCK_MLPS)}")
        if not deepseek:
            if self.block_mlp != "dense":
                raise UserError(f"head block_mlp {self.block_mlp!r} applies to DeepSeek targets (MoE blocks); a "
                                f"{self.model_type} head's block is the target's dense decoder layer (expected dense)")
            if self.init == "from_checkpoint":
                raise UserError(f"head init from_checkpoint loads the MTP module a DeepSeek-V3 checkpoint ships; a "
                                f"{self.model_type} target has none (use random or last_layer)")
            return
        if self.kind != "mtp":
            raise UserError(f"head kind {self.kind!r} is not available for a DeepSeek target ({self.model_type}); "
                            "use kind mtp (the DeepSeek-V3 MTP module with an MLA block)")
        if self.init == "from_checkpoint" and (self.num_layers != 1 or self.block_mlp != "moe"):
            raise UserError("head init from_checkpoint loads DeepSeek's MTP module: one MoE block (set head.num_layers "
                            f"1 and head.block_mlp moe; got num_layers {self.num_layers}, block_mlp {self.block_mlp})")

    def _check_eagle3(self) -> None:
        """What an EAGLE-3 head (vLLM's Eagle3LlamaForCausalLM layout) must be: 3 aux layers, one midlayer, random
        init."""
        layers = list(self.aux_layers)
        if len(layers) != EAGLE3_NUM_AUX_LAYERS or any(j < 0 for j in layers) or layers != sorted(set(layers)):
            raise UserError(
                f"an eagle3 head reads exactly {EAGLE3_NUM_AUX_LAYERS} distinct target layers in increasing order "
                f"(low, middle, high; precompute.aux_layers; engines concatenate them in layer order), got aux_layers "
                f"{layers}"
            )
        if self.num_layers != 1:
            raise UserError(f"an eagle3 head has one midlayer (head num_layers 1), got num_layers {self.num_layers}")
        if self.init != "random":
            raise UserError(
                f"head init {self.init!r} is not available for an eagle3 head (its midlayer reads 2d-wide inputs, no "
                "target layer has that shape); use init: random"
            )

    @staticmethod
    def for_target(config: ModelConfig, target_fingerprint: str | None = None, **options: Any) -> "HeadConfig":
        """A head config for the target `config`; `options` are kind, num_layers, init, ... `aux_layers` must name
        layers of this target."""
        head_config = HeadConfig(hidden_size=config.hidden_size, vocab_size=config.vocab_size,
                                 model_type=config.model_type, target_fingerprint=target_fingerprint, **options)
        if not config.runtime_implemented and head_config.kind != "eagle3":
            raise UserError(
                f"head kind {head_config.kind!r}: its decoder block is the target's own, and our runtime does not "
                f"implement a {config.model_type} block (vLLM runs this target for us); use head.kind: eagle3, whose "
                "draft block is the Llama-style block vLLM serves for any target")
        deepseek = getattr(config, "deepseek", None)
        if deepseek is not None and head_config.init == "last_layer":
            target_moe = config.num_hidden_layers > deepseek.first_k_dense_replace
            if target_moe != (head_config.block_mlp == "moe"):
                raise UserError(
                    f"head init last_layer copies the target's last decoder layer, which is "
                    f"{'an MoE' if target_moe else 'a dense'} block; set head.block_mlp "
                    f"{'moe' if target_moe else 'dense'} (or init random)")
        if deepseek is not None and head_config.init == "from_checkpoint" and deepseek.num_nextn_predict_layers < 1:
            raise UserError("head init from_checkpoint: the target's config.json declares no MTP module "
                            "(num_nextn_predict_layers is 0 or absent)")
        outside = [j for j in head_config.aux_layers if j >= config.num_hidden_layers]
        if outside:
            raise UserError(
                f"head aux_layers {list(head_config.aux_layers)}: {outside} out of range; the target has "
                f"{config.num_hidden_layers} decoder layers (0-based)"
            )
        return head_config

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["aux_layers"] = list(self.aux_layers)
        return data

    @staticmethod
    def from_dict(data: dict[str, Any], source: str = "head config") -> "HeadConfig":
        """Build from a dict written by `to_dict` (head_config.json, an export's head_config): every field present.
        Unknown or missing keys are UserErrors naming them and `source`."""
        if not isinstance(data, dict):
            raise UserError(f"{source}: expected a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(HeadConfig)}
        unknown = sorted(set(data) - known)
        if unknown:
            expected = ", ".join(sorted(known))
            raise UserError(f"{source}: unknown key(s) {', '.join(unknown)}; expected some of {expected}")
        missing = [f.name for f in fields(HeadConfig) if f.name not in data]
        if missing:
            older = not set(missing) & {"hidden_size", "vocab_size", "model_type"}  # keys added since the first head
            raise UserError(f"{source}: missing key(s) {', '.join(missing)}" + (
                " (written by an older mtp-train, before those keys existed): train the head again" if older else ""))
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
HEAD_DEFAULTS: dict[str, Any] = {
    f.name: f.default for f in fields(HeadConfig) if f.name in ("kind", "num_layers", "init", "fc_bias", "block_mlp")
}
