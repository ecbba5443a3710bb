"""The target's frozen parts a draft head reads, read straight from the safetensors files without building the target.

Training a head needs, of the target: `embed_tokens` [V, d] and `lm_head` [V, d] (the same tensor with tied
embeddings), its config, an attention backend and the fingerprint that ties the run to the feature cache; with
`head.init: last_layer` also the last decoder layer's tensors and the final norm [d]. An eagle3 head reads the same
two matrices (its aux-layer inputs come from the feature cache) and a reduced draft vocabulary is a row subset of
`lm_head`, so nothing else is needed. `load_frozen_parts` opens only the files that hold those keys (a sharded
checkpoint's `model.safetensors.index.json` says which) and reads only those keys, so a training rank holds
2·V·d (untied) or V·d (tied) target values instead of the whole model: for Llama-3.3-70B 4.2 GB in bf16 instead of
141 GB.

`FrozenParts.of_model` wraps an already-loaded `CausalLM` by reference (tests, scripts, eval-time heads), so a head is
built the same way from either source."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from mtp_train.errors import UserError
from mtp_train.fingerprint import target_fingerprint
from mtp_train.runtime.attention import AttentionBackend, get_backend
from mtp_train.runtime.config import ModelConfig, load_config
from mtp_train.runtime.deepseek import DeepseekDecoderLayer
from mtp_train.runtime.model import CausalLM, DecoderLayer

INDEX_FILENAME = "model.safetensors.index.json"
EMBED_KEY = "model.embed_tokens.weight"
LM_HEAD_KEY = "lm_head.weight"
FINAL_NORM_KEY = "model.norm.weight"


@dataclass
class FrozenParts:
    """What a draft head reads from its target, frozen (requires_grad False) and used by reference."""

    config: ModelConfig
    embed_tokens: nn.Embedding  # weight [V, d]
    lm_head: nn.Linear  # weight [V, d]; with tied embeddings its weight *is* embed_tokens.weight
    backend: AttentionBackend
    fingerprint: str | None  # the target fingerprint (mtp_train.fingerprint); None when unknown
    last_layer: dict[str, torch.Tensor] | None = None  # decoder layer L-1 under DecoderLayer's names; None: not read
    final_norm: torch.Tensor | None = None  # [d] the final RMSNorm's weight; None: not read
    source_dir: str | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @classmethod
    def of_model(cls, model: CausalLM, fingerprint: str | None = None) -> "FrozenParts":
        """The frozen parts of a loaded target, by reference (no copy): its embedding, lm_head, backend, last decoder
        layer's state and final norm. `fingerprint` is recorded as given (building a head needs none; the model's own
        `fingerprint` property hashes its files on demand)."""
        return cls(model.config, model.model.embed_tokens, model.lm_head, model.backend, fingerprint,
                   dict(model.model.layers[-1].state_dict()), model.model.norm.weight, model.source_dir)


def frozen_parts_of(target: "CausalLM | FrozenParts") -> FrozenParts:
    """`target` itself when it already is a FrozenParts, else the parts of a loaded CausalLM (by reference)."""
    return target if isinstance(target, FrozenParts) else FrozenParts.of_model(target)


def last_layer_keys(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint key -> shape of the last decoder layer's tensors (a DecoderLayer built on the meta device)."""
    with torch.device("meta"):
        if config.deepseek is not None:  # the DeepSeek family's block (runtime/deepseek.py): MLA, dense MLP or MoE
            layer = DeepseekDecoderLayer(config, moe=config.num_hidden_layers > config.deepseek.first_k_dense_replace)
        else:
            layer = DecoderLayer(config)
    prefix = f"model.layers.{config.num_hidden_layers - 1}."
    return {prefix + key: tuple(value.shape) for key, value in layer.state_dict().items()}


def _key_locations(model_dir: Path) -> tuple[dict[str, Path], str]:
    """Checkpoint key -> the safetensors file holding it, and how to name where keys were looked up (the index file,
    or the directory's *.safetensors files). Reads the sharded index or, without one, only the files' headers."""
    index = model_dir / INDEX_FILENAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
        except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as err:
            raise UserError(f"{index}: not a safetensors index ({err})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise UserError(f"{index}: expected a 'weight_map' object of tensor name -> shard file name")
        return {key: model_dir / name for key, name in weight_map.items()}, str(index)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise UserError(f"{model_dir}: no *.safetensors weights found (expected model.safetensors or a sharded index)")
    locations: dict[str, Path] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:  # the header only
                locations.update(dict.fromkeys(f.keys(), path))
        except Exception as err:
            raise UserError(f"{path}: could not read safetensors ({err})") from None
    where = str(files[0]) if len(files) == 1 else f"{model_dir}/*.safetensors ({len(files)} files)"
    return locations, where


def read_tensors(model_dir: str | Path, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype,
                 device: torch.device) -> dict[str, torch.Tensor]:
    """The tensors `shapes` names (checkpoint key -> expected shape) from `model_dir`'s safetensors, each converted to
    `dtype` on `device`; only the files holding them are opened and only those keys read. UserErrors name the file
    and key of a missing tensor, a missing shard or a shape that differs from the config's."""
    model_dir = Path(model_dir)
    locations, where = _key_locations(model_dir)
    missing = [key for key in shapes if key not in locations]
    if missing:
        raise UserError(f"{where}: no tensor {missing[0]}" + (f" (nor {', '.join(missing[1:])})" if missing[1:] else "")
                        + "; the target's config.json implies it")
    by_file: dict[Path, list[str]] = {}
    for key in shapes:
        by_file.setdefault(locations[key], []).append(key)
    tensors: dict[str, torch.Tensor] = {}
    for path, keys in by_file.items():
        if not path.is_file():
            raise UserError(f"{where}: shard {path.name} (holding {keys[0]}) is missing from {model_dir}")
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in keys:
                    if key not in f.keys():
                        raise UserError(f"{path}: no tensor {key} (but {where} says this file holds it)")
                    shape = tuple(f.get_slice(key).get_shape())
                    if shape != shapes[key]:
                        raise UserError(f"{path}: tensor {key} has shape {shape}, the target's config implies "
                                        f"{shapes[key]}")
                    tensors[key] = f.get_tensor(key).to(device=device, dtype=dtype)
        except UserError:
            raise
        except Exception as err:
            raise UserError(f"{path}: could not read safetensors ({err})") from None
    return tensors


def read_lm_head(model_dir: str | Path, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """The target's lm_head weight [V, d] (its embedding with tied embeddings) in `dtype` on `device`, read alone
    from the file that holds it: what scoring hidden states against the target's vocabulary needs, without the rest
    of the target."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise UserError(f"{model_dir}: model directory not found (run `mtp-train fetch-assets` for the default model)")
    config = load_config(model_dir)
    key = EMBED_KEY if config.tie_word_embeddings else LM_HEAD_KEY
    return read_tensors(model_dir, {key: (config.vocab_size, config.hidden_size)}, dtype, torch.device(device))[key]


def _frozen(weight: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(weight, requires_grad=False)


def load_frozen_parts(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    last_layer: bool = False,
    fingerprint: str | None = None,
    backend: str = "auto",
) -> FrozenParts:
    """Read the target's frozen parts from `model_dir` (config.json + safetensors, single file or sharded) in `dtype`
    on `device`, without building the target: embed_tokens, lm_head (or the embedding itself when
    `tie_word_embeddings`), and with `last_layer` the last decoder layer and the final norm. `fingerprint`: the
    target fingerprint if already known (else computed, `mtp_train.fingerprint.target_fingerprint`)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise UserError(f"{model_dir}: model directory not found (run `mtp-train fetch-assets` for the default model)")
    config = load_config(model_dir)
    device = torch.device(device)
    vocab_by_d = (config.vocab_size, config.hidden_size)
    shapes = {EMBED_KEY: vocab_by_d}
    if not config.tie_word_embeddings:
        shapes[LM_HEAD_KEY] = vocab_by_d
    layer_shapes = last_layer_keys(config) if last_layer else {}
    if last_layer:
        shapes.update(layer_shapes)
        shapes[FINAL_NORM_KEY] = (config.hidden_size,)
    tensors = read_tensors(model_dir, shapes, dtype, device)
    with torch.device("meta"):
        embed_tokens = nn.Embedding(*vocab_by_d)
        lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    embed_tokens.weight = _frozen(tensors[EMBED_KEY])
    lm_head.weight = embed_tokens.weight if config.tie_word_embeddings else _frozen(tensors[LM_HEAD_KEY])
    prefix = f"model.layers.{config.num_hidden_layers - 1}."
    layer_state = {key[len(prefix):]: tensors[key] for key in layer_shapes} if last_layer else None
    return FrozenParts(
        config=config, embed_tokens=embed_tokens, lm_head=lm_head,
        backend=get_backend(backend, device, head_dim=None if config.deepseek is not None else config.head_dim),
        fingerprint=fingerprint or target_fingerprint(model_dir), last_layer=layer_state,
        final_norm=tensors.get(FINAL_NORM_KEY), source_dir=str(model_dir),
    )
