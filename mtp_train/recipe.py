"""Recipes: the typed schema of a training recipe, YAML loading, `--set a.b=c` overrides, hashing.

A recipe is one YAML file that drives every stage (prepare, precompute, train, evaluate, export). Every section is a
pydantic model with `extra="forbid"`, so a misspelt key is an error that names the key's full path
(`recipes/x.yaml: train.lrr: unknown key (did you mean 'lr'?)`) instead of being silently ignored.

Paths in a recipe are relative to the current directory (the repository root when run through the Makefile).
Output locations left null are derived from the recipe's `name` (`data/prepared/<name>`, `data/features/<name>`,
`runs/<name>`); `name` defaults to the YAML file's stem.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from mtp_train.errors import UserError
from mtp_train.fileio import atomic_write_text
from mtp_train.heads.config import EAGLE3_NUM_AUX_LAYERS, HEAD_DEFAULTS, HeadConfig

DEFAULT_RECIPE_PATH = "recipes/smollm2-135m-mtp.yaml"
RESOLVED_RECIPE_FILENAME = "recipe.resolved.yaml"

_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class _Section(BaseModel):
    """Base of every recipe section: unknown keys are rejected, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# --------------------------------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------------------------------


class TargetSection(_Section):
    """The target model whose draft heads we train."""

    path: str = Field(
        "data/models/smollm2-135m-instruct", description="HF model directory (config + weights + tokenizer)"
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="where the target runs: auto = cuda when a GPU is visible, else cpu")
    tensor_parallel: int = Field(
        1, ge=1, le=64,
        description="ranks one copy of the target is split over (attention heads and MLP columns; runtime/"
        "tensor_parallel.py) in precompute, eval and prepare's regeneration; under torchrun the world size must be "
        "a multiple of it: W/N data-parallel groups of N ranks each (`--tp N` sets it)",
    )
    attention: Literal["auto", "torch", "flashinfer"] = Field(
        "auto",
        description="attention kernels of the target's runtime in precompute, eval, generate and data regeneration: "
        "torch = SDPA (any device and dtype); flashinfer = FlashInfer's paged and ragged batch kernels (CUDA, "
        "bf16/fp16, head_dim 64, 128 or 256, the optional extra `pip install 'mtp_train[gpu]'`); auto = flashinfer "
        "on CUDA with bf16/fp16 weights and such a head_dim where it is installed, else torch. Training and DeepSeek "
        "(MLA) targets always attend with torch",
    )


class PrecisionSection(_Section):
    """Every dtype of the pipeline in one place: what the target computes in, what decode reads, what the K/V cache
    holds, what the feature cache stores, what a head's draft steps read. `auto` is resolved by each stage once, for
    the machine it runs on (runtime/precision.py), printed once on its first line, and written resolved into the
    stage's recipe.resolved.yaml."""

    compute: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", json_schema_extra={"flag": "--dtype"},
        description="dtype the target's weights are held in and its many-row matmuls run in (prefill, precompute, "
        "training); auto = bf16 on CUDA with bf16 and on CPUs with native bf16 matmul, else fp32 (the bf16 GEMMs "
        "of other CPUs fall back to slow kernels; `mtp-train env` shows the choice and why)",
    )
    decode: Literal["auto", "bfloat16", "float16", "float32", "int8"] = Field(
        "auto", json_schema_extra={"flag": "--decode-dtype"},
        description="weights of the few-row matmuls of decode, verify and draft steps, which stream every weight "
        "once per step and so are bound by memory, not compute: auto = `compute` when that is set, else timed on "
        "this machine (bf16 copies where they are faster: half the bytes); int8 = weight-only int8 with a scale per "
        "row through the CPU decode kernels (an fp32 model: a quantized serving target whose logits differ from "
        "bf16's by the quantization)",
    )
    kv_cache: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", json_schema_extra={"flag": "--kv-cache-dtype"},
        description="the target's paged K/V cache in decode, verify and generation, and the dtype precompute rounds "
        "keys and values to before attention, so that the stored states are those of the target as it is served "
        "(one key: features over another cache than the served one would train the head on other states); auto = "
        "bf16 where decode reads bf16 or int8 weights or the model is bf16, else the compute dtype. Decode and "
        "verify read the same cache, so greedy speculative output stays identical to plain greedy. With "
        "precompute.backend vllm the features attend over vLLM's cache (precompute.vllm.kv_cache_dtype), and this "
        "key must stay auto for precompute",
    )
    features: Literal["bfloat16", "float16", "float8_e4m3"] = Field(
        "bfloat16", json_schema_extra={"flag": "--features-dtype"},
        description="dtype the feature cache stores the target's hidden states in (float8_e4m3 with a scale per "
        "row: half of bf16's bytes on disk and in the readers, at the cost of rounding the states training sees)",
    )
    head_decode: Literal["auto", "target", "int8"] = Field(
        "auto", json_schema_extra={"flag": "--head-decode-dtype"},
        description="weights a head's draft steps read: target = the target's decode weights; int8 = weight-only, "
        "a scale per row, through the CPU decode kernels (half of bf16's bytes; the target's verify keeps the "
        "output exact, only the acceptance can move); auto = int8 where the CPU kernels serve the head, else target",
    )


# Keys that moved into `precision`: named in the error a recipe or `--set` that still uses them gets.
MOVED_KEYS = {
    "target.dtype": "precision.compute",
    "target.decode_dtype": "precision.decode",
    "target.kv_cache_dtype": "precision.kv_cache",
    "precompute.kv_dtype": "precision.kv_cache",
    "precompute.storage_dtype": "precision.features",
    "eval.head_decode_dtype": "precision.head_decode",
}


class DataSource(_Section):
    """One conversation file or dataset directory."""

    path: str = Field(description="a JSON / JSONL file, a parquet file or an HF datasets directory (save_to_disk)")
    format: Literal["auto", "sharegpt", "messages", "mt_bench", "hf"] = Field(
        "auto",
        description="row schema: sharegpt (`conversations`), messages (`messages`), mt_bench (`turns`); "
        "hf = an HF datasets directory or parquet file with any of those columns; auto = detect per file",
    )
    split: str | None = Field(None, description="split of an HF DatasetDict directory (default: train)")
    limit: int | None = Field(None, ge=1, description="read at most this many rows of this source")


class SystemPromptSection(_Section):
    """What to do with system messages before rendering.

    keep: leave conversations as they are (the chat template may add its own default system prompt);
    drop: remove system messages; default: add `text` as the system message where a conversation has none;
    override: replace every conversation's system message with `text`.
    """

    mode: Literal["keep", "drop", "default", "override"] = Field(
        "keep", description="keep | drop system messages | default: add `text` where a conversation has none | "
        "override: replace every system message by `text`")
    text: str | None = Field(None, description="the system message of modes default and override")

    @model_validator(mode="after")
    def _text_required_for_modes_that_insert_it(self) -> SystemPromptSection:
        if self.mode in ("default", "override") and not self.text:
            raise ValueError(f"mode {self.mode!r} needs a non-empty `text`")
        return self


class RegenerateSection(_Section):
    """Self-distillation: replace assistant turns by the target's own replies before tokenizing."""

    enabled: bool = Field(False, description="replace assistant turns by the target's own replies "
                          "(self-distillation)")
    max_new_tokens: int = Field(512, ge=1, description="tokens generated per assistant turn at most")
    temperature: float = Field(0.0, ge=0.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling of the replies when temperature > 0 "
                         "(1 = off)")
    batch_size: int = Field(8, ge=1, description="conversations generated together")
    max_turns: int | None = Field(
        None, ge=1, description="keep only the first N user turns of each conversation (null = all)"
    )


class DataSection(_Section):
    """Conversation sources and how `prepare` turns them into (input_ids, loss_mask) samples."""

    sources: list[DataSource] = Field(
        default_factory=lambda: [DataSource(path="data/datasets/sharegpt/sharegpt.jsonl")], min_length=1
    )
    chat_template: str | None = Field(
        None, description="Jinja file overriding (or supplying) the target tokenizer's chat template"
    )
    max_samples: int | None = Field(None, ge=1, description="stop after this many kept samples (null = all)")
    max_seq_len: int = Field(1024, ge=2, description="tokens per sample at most (the rendered conversation)")
    overlong: Literal["truncate", "drop"] = Field(
        "truncate", description="a sample longer than max_seq_len: keep its first max_seq_len tokens, or drop it")
    eval_fraction: float = Field(0.02, ge=0.0, lt=1.0, description="held-out share of the conversations, chosen by "
                                 "hashing each one's source_id with `seed`")
    seed: int = Field(0, description="seed of the held-out split and of sampled regeneration")
    system_prompt: SystemPromptSection = Field(default_factory=SystemPromptSection)
    output_dir: str | None = Field(None, description="null = data/prepared/<name>")
    regenerate: RegenerateSection = Field(default_factory=RegenerateSection)


class VllmEngineSection(_Section):
    """vLLM as the target engine (`precompute.backend: vllm`): where vLLM lives and how it spreads the target. Every
    key but `python` and `engine_args` is one of `vllm.LLM`'s own arguments, passed as named; null = vLLM's default."""

    python: str | None = Field(
        None, description="the interpreter that imports vllm; null = $MTP_TRAIN_VLLM_PYTHON, else "
        ".venv-vllm/bin/python (make .venv-vllm/.installed: vLLM's CPU build), else this interpreter when it imports "
        "vllm")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs the target's layers are split over")
    pipeline_parallel_size: int = Field(1, ge=1, description="stages the target's layers are cut into")
    quantization: str | None = Field(None, description="vLLM's quantization method (fp8, awq, gptq, ...); null = "
                                     "what the checkpoint's config says")
    kv_cache_dtype: str = Field("auto", description="vLLM's K/V cache dtype (auto = the compute dtype, fp8, ...)")
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1, description="share of each GPU's memory vLLM "
                                                 "may take")
    max_num_batched_tokens: int | None = Field(None, ge=1, description="tokens per engine step")
    max_model_len: int | None = Field(None, ge=2, description="null = the longest prepared sample + 1")
    enforce_eager: bool = Field(False, description="no CUDA graphs / torch.compile (faster start, slower steps)")
    engine_args: dict[str, Any] = Field(
        default_factory=dict, description="any other vllm.LLM argument, passed unchanged (e.g. "
        "{distributed_executor_backend: ray})")


class PrecomputeSection(_Section):
    """The feature cache: the target's hidden states for every prepared sample."""

    output_dir: str | None = Field(None, description="null = data/features/<name>")
    backend: Literal["runtime", "vllm"] = Field(
        "runtime", description="what runs the target: runtime = this package's (families it implements, torchrun "
        "ranks, target.tensor_parallel); vllm = vLLM (any family vLLM serves, its parallelism: precompute.vllm), the "
        "engine and numerics the head is served with")
    vllm: VllmEngineSection = Field(default_factory=VllmEngineSection)
    tokens_per_batch: int = Field(8192, ge=1, description="tokens per target forward")
    samples_per_shard: int = Field(512, ge=1, description="samples per feature shard file (a rank buffers one "
                                   "shard in host memory until it is written)")
    target_argmax: bool = Field(
        True, description="also store the target's argmax token per position (one lm_head pass; heads with a reduced "
        "draft vocabulary then train without full-vocabulary logits)"
    )
    aux_layers: list[int] = Field(
        default_factory=list, description="decoder layers (0-based outputs) also stored, for EAGLE-3 heads"
    )

    @field_validator("aux_layers")
    @classmethod
    def _aux_layers_are_non_negative(cls, layers: list[int]) -> list[int]:
        if any(layer < 0 for layer in layers):
            raise ValueError(f"expected layer indices >= 0, got {layers}")
        return layers


class HeadSection(_Section):
    """The draft head's architecture, as a recipe states it. Defaults are the head's own (`heads.config.HeadConfig`);
    `head_config()` is the one conversion into that config."""

    kind: Literal["mtp", "eagle1", "eagle3"] = Field(
        HEAD_DEFAULTS["kind"], description="mtp = restored norms; eagle1 = the EAGLE-1 ablation; eagle3 = EAGLE-3 "
        "(reads the target layers precompute.aux_layers)")
    num_layers: int = Field(HEAD_DEFAULTS["num_layers"], ge=1, description="decoder layers of the head")
    init: Literal["random", "last_layer", "from_checkpoint"] = Field(
        HEAD_DEFAULTS["init"], description="decoder layer init (random measured better than last_layer); "
        "from_checkpoint: the MTP module a DeepSeek-V3/R1 checkpoint ships (model.layers.{num_hidden_layers})")
    block_mlp: Literal["dense", "moe"] = Field(
        HEAD_DEFAULTS["block_mlp"], description="DeepSeek targets: the MTP block's MLP, dense (intermediate_size) or "
        "the target's MoE (as DeepSeek ships it; needed by init from_checkpoint)")
    draft_vocab_size: int | Literal["full"] = Field("full", description="'full' or a reduced draft vocabulary size")
    fc_bias: bool = Field(
        HEAD_DEFAULTS["fc_bias"],
        description="eagle1: fc with a bias; false for a head vLLM serves (export --format eagle: its fc has none)",
    )
    draft_vocab_source: Literal["target", "data"] = Field(
        "target", description="labels counted to pick the draft vocabulary: the target's argmax or the data's tokens"
    )

    @field_validator("draft_vocab_size", mode="before")
    @classmethod
    def _full_or_positive_int(cls, value: Any) -> int | str:
        if value == "full":
            return value
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"expected 'full' or a positive integer, got {value!r}")
        return value

    def head_config(self, target_config: Any, target_fingerprint: str | None = None,
                    aux_layers: list[int] | tuple[int, ...] = ()) -> HeadConfig:
        """The head architecture this section describes for a target (`runtime.config.ModelConfig`); the recipe's
        "full" draft vocabulary is the config's None. `aux_layers` (the recipe's precompute.aux_layers) are the layers
        an eagle3 head reads; the other kinds ignore them."""
        return HeadConfig.for_target(
            target_config, target_fingerprint=target_fingerprint, kind=self.kind, num_layers=self.num_layers,
            init=self.init, draft_vocab_size=None if self.draft_vocab_size == "full" else self.draft_vocab_size,
            fc_bias=self.fc_bias, aux_layers=tuple(aux_layers) if self.kind == "eagle3" else (),
            block_mlp=self.block_mlp,
        )


class TrainSection(_Section):
    """The DeepSpeed training loop."""

    run_dir: str | None = Field(None, description="null = runs/<name>")
    deepspeed_config: str | None = Field(
        None, description="DeepSpeed JSON merged under the settings below; null = generated from them"
    )
    zero_stage: int = Field(1, ge=0, le=3, description="DeepSpeed ZeRO stage; equal to zero_optimization.stage of "
                            "deepspeed_config when one is given")
    micro_batch_tokens: int = Field(4096, ge=1, description="tokens per micro batch per rank")
    grad_accum: int = Field(1, ge=1, description="micro batches per optimizer step")
    optimizer: Literal["adamw", "muon"] = Field(
        "adamw", description="adamw | muon: Muon (orthogonalized momentum) for the head's matrices at muon_lr, AdamW at "
        "lr for its norms and biases")
    lr: float = Field(5e-4, gt=0.0, description="peak learning rate (AdamW)")
    muon_lr: float = Field(0.02, gt=0.0, description="peak learning rate of the matrices under optimizer muon "
                           "(Muon's step is a unit-scale orthogonal matrix; 0.02 is Muon's usual value)")
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="final lr = lr * min_lr_ratio")
    warmup_steps: int = Field(50, ge=0, description="optimizer steps of linear warmup")
    schedule: Literal["cosine", "linear", "constant"] = Field(
        "cosine", description="learning-rate decay after the warmup, to lr * min_lr_ratio")
    max_steps: int | None = Field(None, ge=1, description="null = run `epochs` epochs")
    epochs: int = Field(2, ge=1, description="passes over the training split (when max_steps is null)")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay (one parameter group: norms "
                                "included)")
    clip: float = Field(1.0, ge=0.0, description="gradient-norm clip; 0 = off")
    unroll_steps: int = Field(2, ge=1, description="step k>1 feeds the head its own output")
    step_weight_decay: float = Field(0.8, gt=0.0, le=1.0, description="loss weight of step k = decay**(k-1)")
    feature_loss_weight: float = Field(0.1, ge=0.0, description="weight of the hidden-state regression loss "
                                       "(smooth-L1 to the target's next hidden state)")
    kl_loss_weight: float = Field(1.0, ge=0.0, description="weight of the KL to the target's next-token "
                                  "distribution")
    input_noise: float = Field(0.0, ge=0.0, description="Gaussian noise added to the target states step 1 reads, as a "
                               "share of each row's RMS (0 = off): the head learns to draft from states that differ a "
                               "little from the cached ones")
    loss_rows: Literal["assistant", "all"] = Field(
        "assistant", description="rows the losses count: those predicting an assistant token, or all (user and system "
        "turns too: more supervision from the same cached features; validation counts assistant rows either way)"
    )
    logits_chunk_size: int = Field(1024, ge=1, description="positions per chunk when computing vocab logits")
    eval_every: int = Field(200, ge=1, description="optimizer steps")
    save_every: int = Field(500, ge=1, description="optimizer steps")
    keep_last: int = Field(2, ge=1, description="checkpoints kept")
    seed: int = Field(0, description="seed of the head's initialization and the sample order")

    @model_validator(mode="after")
    def _muon_under_zero_is_not_clipped(self) -> TrainSection:
        if self.optimizer == "muon" and self.zero_stage >= 1 and self.clip > 0:
            raise ValueError(
                f"optimizer muon with zero_stage {self.zero_stage} needs clip 0: DeepSpeed's ZeRO optimizer "
                "orthogonalizes the gradient into Muon's update before it clips, so the global-norm clip shrinks a "
                "unit-scale update, not a gradient (SmolLM2 demo cache, 100 steps: held-out top-1 6.3% clipped at 1.0 "
                "against 30.8% unclipped, 2 ranks; docs/benchmarks.md); set train.clip=0, or train.zero_stage=0"
            )
        return self


MAX_EVAL_BATCH = 256
# The speculative engine's limit (runtime.spec.engine.MAX_SPECULATIVE_TOKENS; not imported, so that reading a recipe
# stays torch-free: tests/test_recipe.py pins the two equal).
MAX_SPECULATIVE_TOKENS = 8


class EvalSection(_Section):
    """Acceptance evaluation through the speculative inference path."""

    prompts: str | None = Field(
        None, description="a built-in prompt set (mt_bench, humaneval, gsm8k: shipped with the package) or the path "
        "of an MT-bench-style JSONL file (question_id, category, turns); null = the held-out split of `prepare`")
    engine: Literal["ours", "vllm", "both"] = Field(
        "ours", description="whose speculative decoding is measured: ours (this package's engine: chain, trees, "
        "lookup, cost curve), vllm (the head exported in the format vLLM loads and served by vLLM: τ, acceptance, "
        "speedup over vLLM's plain decoding; first turns; interpreter from precompute.vllm.python), or both")
    limit: int | None = Field(32, ge=1, description="prompts evaluated (null = all)")
    num_speculative_tokens: list[Annotated[int, Field(ge=1, le=MAX_SPECULATIVE_TOKENS)]] = Field(
        default_factory=lambda: [1, 2, 3], min_length=1,
        description="draft tokens per speculative step (k), each value measured in turn")
    max_new_tokens: int = Field(128, ge=1, description="tokens generated per prompt at most")
    temperature: float = Field(0.0, ge=0.0, description="sampling temperature of every method; 0 = greedy")
    cost_curve: bool = Field(False, description="also profile decode/verify/draft-step costs before and after the "
                             "runs (a few seconds each, averaged) and report the speedup they predict per k (best k by "
                             "cost curve) beside the measured one")
    batch_sizes: list[Annotated[int, Field(ge=1, le=MAX_EVAL_BATCH)]] = Field(
        default_factory=lambda: [1], min_length=1,
        description="answer the prompts this many at a time, each batch size in turn (e.g. [1, 4, 16]): τ, tokens/s "
                    "and speedup per batch size in the report and a speedup-against-batch-size plot; the first one "
                    "gives the main tables")

    @field_validator("batch_sizes")
    @classmethod
    def _distinct_batch_sizes(cls, sizes: list[int]) -> list[int]:
        if len(set(sizes)) != len(sizes):
            raise ValueError(f"expected distinct batch sizes, got {sizes}")
        return sizes


class WandbSection(_Section):
    """Weights & Biases run settings (metrics are always also written locally to metrics.jsonl)."""

    project: str = Field("mtp-train", description="W&B project")
    entity: str | None = Field(None, description="W&B team or user; null = your default entity")
    run_name: str | None = Field(None, description="null = the recipe name")
    group: str | None = Field(None, description="W&B run group (runs of one target side by side)")
    tags: list[str] = Field(default_factory=list, description="W&B run tags")
    mode: Literal["online", "offline", "disabled"] = Field(
        "offline", description="online (offline when no API key is configured) | offline (sync later with "
        "`wandb sync`) | disabled")


class TrackingSection(_Section):
    """Experiment tracking."""

    wandb: WandbSection = Field(default_factory=WandbSection)


class DistributedSection(_Section):
    """The process group the ranks of a torchrun launch share (precompute, train, eval)."""

    timeout_minutes: float = Field(
        60.0, gt=0,
        description="minutes a collective (a barrier, an all-reduce) waits for every rank before failing; longer "
        "than the slowest rank's lead: rank 0 verifying a large cache, a rank finishing a long shard (torch's "
        "default is 10)",
    )


class Recipe(_Section):
    """A whole recipe. Derived defaults (output directories, W&B run name) are filled in from `name`."""

    name: str = Field(description="names the output directories and the W&B run; default: the YAML file's stem")
    target: TargetSection = Field(default_factory=TargetSection)
    precision: PrecisionSection = Field(default_factory=PrecisionSection)
    data: DataSection = Field(default_factory=DataSection)
    precompute: PrecomputeSection = Field(default_factory=PrecomputeSection)
    head: HeadSection = Field(default_factory=HeadSection)
    train: TrainSection = Field(default_factory=TrainSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    tracking: TrackingSection = Field(default_factory=TrackingSection)
    distributed: DistributedSection = Field(default_factory=DistributedSection)

    @field_validator("name")
    @classmethod
    def _name_usable_in_paths(cls, name: str) -> str:
        if not _NAME_PATTERN.match(name):
            raise ValueError(f"expected letters, digits, '.', '_' or '-' (used in paths), got {name!r}")
        return name

    @model_validator(mode="after")
    def _eagle3_reads_three_stored_layers(self) -> Recipe:
        if self.head.kind == "eagle3" and len(self.precompute.aux_layers) != EAGLE3_NUM_AUX_LAYERS:
            raise ValueError(
                f"head.kind eagle3 reads the {EAGLE3_NUM_AUX_LAYERS} target layers (low, middle, high) that "
                f"precompute.aux_layers stores, got precompute.aux_layers={self.precompute.aux_layers}; the EAGLE-3 "
                "default for a target of L layers is [1, L // 2 - 1, L - 4] (0-based layer outputs; [1, 14, 26] for "
                "SmolLM2-135M), see recipes/smollm2-135m-eagle3.yaml"
            )
        return self

    @model_validator(mode="after")
    def _fill_name_derived_defaults(self) -> Recipe:
        if self.data.output_dir is None:
            self.data.output_dir = f"data/prepared/{self.name}"
        if self.precompute.output_dir is None:
            self.precompute.output_dir = f"data/features/{self.name}"
        if self.train.run_dir is None:
            self.train.run_dir = f"runs/{self.name}"
        if self.tracking.wandb.run_name is None:
            self.tracking.wandb.run_name = self.name
        return self

    # The output locations, filled in from `name` above where the recipe leaves them null: read them here only.
    @property
    def prepared_dir(self) -> Path:
        return Path(self.data.output_dir)

    @property
    def features_dir(self) -> Path:
        return Path(self.precompute.output_dir)

    @property
    def run_dir(self) -> Path:
        return Path(self.train.run_dir)


# --------------------------------------------------------------------------------------------------------------------
# YAML
# --------------------------------------------------------------------------------------------------------------------


class _RecipeYamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader plus YAML 1.2 floats without a dot (`3e-4` is a float, not the string '3e-4')."""


_RecipeYamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _parse_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_RecipeYamlLoader)  # noqa: S506 - a SafeLoader subclass


# --------------------------------------------------------------------------------------------------------------------
# Overrides
# --------------------------------------------------------------------------------------------------------------------


def parse_value(text: str) -> Any:
    """A value as `--set` and the generated options read it: a YAML scalar or flow value; empty = null. Raises
    yaml.YAMLError."""
    return _parse_yaml(text) if text.strip() else None


def _parse_override(override: str) -> tuple[list[str], Any]:
    """Split `a.b.c=value` into (["a", "b", "c"], value parsed as a YAML scalar / flow value; empty = null)."""
    key, sep, raw_value = override.partition("=")
    key = key.strip()
    if not sep or not key:
        raise UserError(f"--set expects KEY=VALUE (e.g. train.lr=3e-4), got {override!r}")
    path = key.split(".")
    if any(not part for part in path):
        raise UserError(f"--set {override}: empty key segment")
    try:
        value = parse_value(raw_value)
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise UserError(f"--set {override}: value is not valid YAML ({problem})") from None
    return path, value


def _apply_override(config: dict[str, Any], path: list[str], value: Any, origin: str) -> None:
    """Set `value` at `path` inside the raw (not yet validated) recipe mapping, creating sections as needed."""
    node: Any = config
    for depth, part in enumerate(path[:-1]):
        where = ".".join(path[: depth + 1])
        if isinstance(node, list):
            node = node[_list_index(node, part, where, origin)]
            continue
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, (dict, list)):
            raise UserError(f"{origin}: {where} is a value ({child!r}), not a section")
        node = child
    last = path[-1]
    if isinstance(node, list):
        node[_list_index(node, last, ".".join(path), origin)] = value
    else:
        node[last] = value


def _list_index(items: list[Any], part: str, where: str, origin: str) -> int:
    if not part.isdigit():
        raise UserError(f"{origin}: {where}: expected a list index (0, 1, ...), got {part!r}")
    index = int(part)
    if index >= len(items):
        raise UserError(f"{origin}: {where}: index {index} out of range (the list has {len(items)} items)")
    return index


# --------------------------------------------------------------------------------------------------------------------
# Validation errors
# --------------------------------------------------------------------------------------------------------------------


def _dotted(loc: Iterable[int | str]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _known_keys(loc: tuple[int | str, ...]) -> list[str]:
    """Field names of the section that contains `loc` (for 'did you mean' hints)."""
    model: Any = Recipe
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        annotation = field.annotation
        inner = getattr(annotation, "__args__", None)
        model = inner[0] if inner and isinstance(inner[0], type) else annotation
    return list(getattr(model, "model_fields", {}))


# pydantic error types -> what was expected.
_EXPECTED = {
    **dict.fromkeys(("int_parsing", "int_type", "int_from_float"), "an integer"),
    **dict.fromkeys(("float_parsing", "float_type"), "a number"),
    **dict.fromkeys(("bool_parsing", "bool_type"), "true or false"),
    "string_type": "a string",
    "list_type": "a list",
    **dict.fromkeys(("model_type", "model_attributes_type", "dict_type"), "a mapping of keys"),
}
_BOUNDS = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}


def _describe_error(error: dict[str, Any]) -> str:
    """One pydantic error → `path: what was expected, got what`."""
    loc = tuple(error["loc"])
    kind = error["type"]
    given = error.get("input")
    ctx = error.get("ctx") or {}
    if kind == "extra_forbidden" and _dotted(loc) in MOVED_KEYS:
        message = f"moved to {MOVED_KEYS[_dotted(loc)]}"
    elif kind == "extra_forbidden":
        hint = difflib.get_close_matches(str(loc[-1]), _known_keys(loc), n=1)
        message = "unknown key" + (f" (did you mean {hint[0]!r}?)" if hint else "")
    elif kind == "missing":
        message = "required key missing"
    elif kind in _EXPECTED:
        message = f"expected {_EXPECTED[kind]}, got {given!r}"
    elif kind == "literal_error":
        message = f"expected one of {ctx.get('expected')}, got {given!r}"
    elif kind in _BOUNDS:
        message = f"expected a value {_BOUNDS[kind]} {next(iter(ctx.values()), '?')}, got {given!r}"
    elif kind == "too_short":
        message = f"expected at least {ctx.get('min_length')} item(s), got {given!r}"
    elif kind == "value_error":
        message = str(error["msg"]).removeprefix("Value error, ")
    else:
        message = str(error["msg"])
    return f"{_dotted(loc) or '<recipe>'}: {message}"


def _origin_of(loc: tuple[int | str, ...], applied_overrides: list[Override], recipe_file: str) -> str:
    """Which input produced the value at `loc`: the override (`--set` or option) that wrote it (or a parent of it),
    else the file."""
    loc_parts = [str(part) for part in loc]
    for override in reversed(applied_overrides):
        path = list(override.path)
        if loc_parts[: len(path)] == path or path[: len(loc_parts)] == loc_parts:
            return override.origin
    return recipe_file


# --------------------------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Override:
    """One value set on top of the recipe file, by `--set KEY=VALUE` or by a command's option
    (`cli_options.add_recipe_options`); `origin` is how the user wrote it, named in a validation error."""

    path: tuple[str, ...]
    value: Any
    origin: str


def load_recipe(path: str | os.PathLike[str], overrides: Iterable[str | Override] = ()) -> Recipe:
    """Read a recipe YAML file, apply the overrides in order (`a.b=c` texts, values parsed as YAML, or `Override`s)
    and validate it.

    Raises UserError naming the file (or the `--set` / option that set the value) and the full key path on any problem.
    """
    recipe_path = Path(path)
    if not recipe_path.is_file():
        raise UserError(f"{recipe_path}: recipe file not found")
    try:
        raw = _parse_yaml(recipe_path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise UserError(f"{recipe_path}: not UTF-8 text (byte 0x{err.object[err.start]:02x} at offset {err.start}); "
                        "save the recipe as UTF-8") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise UserError(f"{recipe_path}: invalid YAML{where}: {problem}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise UserError(f"{recipe_path}: expected a mapping of sections at the top level, got {type(raw).__name__}")
    raw.setdefault("name", recipe_path.stem)
    return build_recipe(raw, overrides, str(recipe_path))


def build_recipe(raw: dict[str, Any], overrides: Iterable[str | Override] = (), source: str = "<recipe>") -> Recipe:
    """Apply the overrides in order to the raw recipe mapping `raw` (changed in place) and validate it; a problem is
    a UserError naming the override that set the value, else `source` (the file), and the full key path."""
    applied_overrides: list[Override] = []
    for override in overrides:
        if isinstance(override, str):
            key_path, value = _parse_override(override)
            override = Override(tuple(key_path), value, f"--set {override}")
        _apply_override(raw, list(override.path), override.value, override.origin)
        applied_overrides.append(override)

    try:
        return Recipe.model_validate(raw)
    except ValidationError as err:
        errors = err.errors()
        first = errors[0]
        origin = _origin_of(tuple(first["loc"]), applied_overrides, source)
        more = f" (+{len(errors) - 1} more error(s))" if len(errors) > 1 else ""
        raise UserError(f"{origin}: {_describe_error(first)}{more}") from None


def recipe_to_dict(recipe: Recipe) -> dict[str, Any]:
    """The recipe as plain JSON-compatible data (every default filled in)."""
    return recipe.model_dump(mode="json")


def flatten_recipe(value: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted keys of a resolved recipe; lists of mappings (data.sources) are indexed, other lists are values."""
    out: dict[str, Any] = {}
    if isinstance(value, dict):
        for key, sub in value.items():
            out.update(flatten_recipe(sub, f"{prefix}.{key}" if prefix else str(key)))
    elif isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
        for index, sub in enumerate(value):
            out.update(flatten_recipe(sub, f"{prefix}.{index}"))
        out[f"{prefix}.length"] = len(value)
    else:
        out[prefix] = value
    return out


def recipe_hash(recipe: Recipe, sections: Iterable[str] | None = None) -> str:
    """sha256 (hex) of the canonical JSON (sorted keys, compact) of the chosen sections; None = the whole recipe."""
    data = recipe_to_dict(recipe)
    if sections is not None:
        chosen = list(sections)
        unknown = [name for name in chosen if name not in data]
        if unknown:
            raise ValueError(f"unknown recipe section(s) {unknown}; expected some of {list(data)}")
        data = {name: data[name] for name in chosen}
    return canonical_hash(data)


def canonical_hash(data: dict[str, Any]) -> str:
    """sha256 (hex) of the canonical JSON (sorted keys, compact) of `data`."""
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def with_precision(recipe: Recipe, resolved: dict[str, str]) -> Recipe:
    """The recipe with the `precision` keys a stage resolved (`Precision.recipe_values()`: `auto` replaced by what
    ran) written in, so that `recipe.resolved.yaml` records the dtypes that really ran."""
    return recipe.model_copy(update={"precision": recipe.precision.model_copy(update=resolved)})


def save_resolved(recipe: Recipe, directory: str | os.PathLike[str]) -> Path:
    """Write the fully resolved recipe (every default spelled out) to `<directory>/recipe.resolved.yaml`."""
    header = f"# Resolved recipe {recipe.name!r}: every default filled in; written by mtp-train.\n"
    body = yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False, allow_unicode=True, width=120)
    return atomic_write_text(Path(directory) / RESOLVED_RECIPE_FILENAME, header + body)
