"""Shared pieces of the export formats: the target summary, layer shapes from a config, reading a native head
against a target, atomic directory writes, and the config block every exported format carries.

Conventions (see docs/export.md):
- Every format is a directory holding `model.safetensors` and `config.json` (native also keeps `head_config.json`).
- Every `config.json` carries an `"mtp_train"` block: the exporting format, the full `HeadConfig`, the target's
  fingerprint, and the hidden-state convention the head was trained on (the target's last layer *after* its final
  norm, i.e. what the lm_head reads; the MTP head feeds its own post-norm output back, the EAGLE-1 head its raw
  layer output).
- Names inside a head's decoder layer are transformers' (`self_attn.q_proj.weight`, ...), the same in every format.
- A head with a reduced draft vocabulary (`HeadConfig.draft_vocab_size` = N) carries it as the EAGLE-3 pair
  `d2t` int64 [N] (target id = i + d2t[i]) and `t2d` bool [V] where the format stores tensors for it (native), as
  SGLang's `--speculative-token-map` file where that is how the engine reads it (eagle), and is refused by formats
  whose loaders have no draft vocabulary (deepseek-mtp, speculators). Full-vocabulary heads are written as before.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from mtp_train.errors import UserError
from mtp_train.heads.config import HeadConfig
from mtp_train.heads.io import check_state_shapes

FORMAT_VERSION = 1
WEIGHTS_FILENAME = "model.safetensors"
CONFIG_FILENAME = "config.json"
HEAD_CONFIG_FILENAME = "head_config.json"
BLOCK_KEY = "mtp_train"
# config.json fields every engine-format export carries: the layer shape engines build the draft block from, plus
# our own block (head config and the hidden state the head reads).
ENGINE_CONFIG_FIELDS = [
    "architectures", "model_type", "hidden_size", "intermediate_size", "num_attention_heads",
    "num_key_value_heads", "vocab_size", "rms_norm_eps", "num_hidden_layers",
    f"{BLOCK_KEY}.head_config", f"{BLOCK_KEY}.hidden_state_input",
]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
# safetensors dtype strings (as `get_dtype()` reports them) -> our names.
SAFETENSORS_DTYPES = {
    "F32": "float32", "BF16": "bfloat16", "F16": "float16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}
# The draft-vocabulary tensors (heads.vocab), under the names vLLM/SGLang/speculators read for EAGLE-3, and their dtypes.
DRAFT_VOCAB_TENSORS = {"d2t": "int64", "t2d": "bool"}
TENSOR_DTYPE_NAMES = {**DTYPE_NAMES, torch.int64: "int64", torch.bool: "bool"}

# What the head reads and feeds back, recorded in every exported config.
HIDDEN_STATE_INPUT = "final_norm_output"  # H_i: the target's last decoder layer after its final norm
FEEDBACK = {"mtp": "post_norm_output", "eagle1": "raw_layer_output"}

# Lost when an MTP head (restored norms) is written into a layout without them.
MTP_NORMS_LOST = (
    "enorm (RMSNorm on embed(t)), hnorm (RMSNorm on the hidden state), layers.0.input_layernorm and the final "
    "norm (norm.weight)"
)


def parse_dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    if name not in DTYPES:
        raise UserError(f"--dtype {name!r} is not supported; expected one of {', '.join(DTYPES)}")
    return DTYPES[name]


# ---- layer shapes ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerShape:
    """The shapes of one decoder layer of the target's architecture (what a head layer copies)."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    qkv_bias: bool = False  # Qwen2; Llama/Qwen3 with attention_bias
    o_proj_bias: bool = False  # Llama/Qwen3 with attention_bias
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3

    @staticmethod
    def from_hf_dict(config: dict[str, Any], source: str) -> "LayerShape":
        """From a HF-style config dict, with the same rules as `runtime.config.load_config`."""
        missing = [
            key
            for key in ("model_type", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
            if key not in config
        ]
        if missing:
            raise UserError(f"{source}: missing field(s) {', '.join(missing)}")
        model_type = config["model_type"]
        heads = int(config["num_attention_heads"])
        attention_bias = bool(config.get("attention_bias", False))
        return LayerShape(
            model_type=model_type,
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // heads),
            vocab_size=int(config["vocab_size"]),
            qkv_bias=model_type == "qwen2" or (model_type in ("llama", "qwen3") and attention_bias),
            o_proj_bias=model_type in ("llama", "qwen3") and attention_bias,
            mlp_bias=bool(config.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
        )

    def block_tensors(self, with_input_norm: bool) -> dict[str, tuple[int, ...]]:
        """Suffix (inside `layers.{j}.`) -> shape for one decoder layer."""
        d, inter = self.hidden_size, self.intermediate_size
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        out: dict[str, tuple[int, ...]] = {}
        if with_input_norm:
            out["input_layernorm.weight"] = (d,)
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            out[f"self_attn.{name}.weight"] = (rows, d)
            if self.qkv_bias:
                out[f"self_attn.{name}.bias"] = (rows,)
        out["self_attn.o_proj.weight"] = (d, q)
        if self.o_proj_bias:
            out["self_attn.o_proj.bias"] = (d,)
        if self.qk_norm:
            out["self_attn.q_norm.weight"] = (self.head_dim,)
            out["self_attn.k_norm.weight"] = (self.head_dim,)
        out["post_attention_layernorm.weight"] = (d,)
        out["mlp.gate_proj.weight"] = (inter, d)
        out["mlp.up_proj.weight"] = (inter, d)
        out["mlp.down_proj.weight"] = (d, inter)
        if self.mlp_bias:
            out["mlp.gate_proj.bias"] = (inter,)
            out["mlp.up_proj.bias"] = (inter,)
            out["mlp.down_proj.bias"] = (d,)
        return out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def native_tensors(
    kind: str, num_layers: int, shape: LayerShape, draft_vocab_size: int | None = None
) -> dict[str, tuple[int, ...]]:
    """Native (DraftHead state-dict) name -> shape for a head of `kind` with `num_layers` layers (plus `d2t` [N] and
    `t2d` [V] with a reduced draft vocabulary of N tokens)."""
    d = shape.hidden_size
    out: dict[str, tuple[int, ...]] = {}
    if kind == "mtp":
        out.update({"enorm.weight": (d,), "hnorm.weight": (d,), "eh_proj.weight": (d, 2 * d)})
    else:
        out.update({"fc.weight": (d, 2 * d), "fc.bias": (d,)})
    for j in range(num_layers):
        for suffix, dims in shape.block_tensors(with_input_norm=kind == "mtp" or j > 0).items():
            out[f"layers.{j}.{suffix}"] = dims
    if kind == "mtp":
        out["norm.weight"] = (d,)
    if draft_vocab_size is not None:
        out["d2t"] = (int(draft_vocab_size),)
        out["t2d"] = (shape.vocab_size,)
    return out


def cast_floating(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Floating-point tensors in `dtype`; integer/bool ones (d2t, t2d) unchanged."""
    return {name: t.to(dtype) if t.is_floating_point() else t for name, t in tensors.items()}


def draft_ids_of(state: dict[str, torch.Tensor]) -> torch.Tensor:
    """The [N] target ids of a native state dict's draft vocabulary (from its d2t)."""
    from mtp_train.heads.vocab import ids_from_d2t

    return ids_from_d2t(state["d2t"])


def draft_vocab_lost(head_config: HeadConfig, format_name: str, why: str, alternatives: str) -> str:
    """The refusal of a reduced-vocabulary head by a format whose loaders have no draft vocabulary."""
    return (
        f"a head with a reduced draft vocabulary ({head_config.draft_vocab_size} of the target's "
        f"{head_config.vocab_size} tokens, d2t/t2d) cannot be written as {format_name}: {why}, so the draft "
        f"vocabulary would be lost (the head would draft over all {head_config.vocab_size} tokens); use {alternatives}"
    )


def draft_vocab_tensor_problems(
    path: Path, header: dict[str, tuple[tuple[int, ...], str]], vocab_size: int, draft_vocab_size: int
) -> list[str]:
    """dtypes of `d2t`/`t2d` in a safetensors file (from its header) and, when both are readable, whether they describe
    the same `draft_vocab_size` strictly increasing target ids (shapes are checked by the caller)."""
    from mtp_train.heads.vocab import check_d2t_t2d

    problems = []
    for name, want in DRAFT_VOCAB_TENSORS.items():
        if name in header and header[name][1] != want:
            problems.append(f"{path}: tensor {name} is {header[name][1]}, expected {want}")
    shapes_ok = (
        header.get("d2t", ((),))[0] == (draft_vocab_size,) and header.get("t2d", ((),))[0] == (vocab_size,)
    )
    if problems or not shapes_ok:
        return problems
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    except Exception as err:
        return [f"{path}: could not read d2t/t2d ({err})"]
    try:
        check_d2t_t2d(d2t, t2d, str(path))
    except UserError as err:
        problems.append(str(err))
    return problems


# ---- the target -----------------------------------------------------------------------------------------------------


class TargetInfo:
    """What export needs from a target directory without loading the whole model: its parsed and raw config, its
    fingerprint, its layer shape, and (on request) its frozen embed_tokens / lm_head tensors."""

    def __init__(self, directory: str | os.PathLike[str]):
        from mtp_train.runtime.config import load_config

        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise UserError(f"{self.directory}: target model directory not found")
        self.config = load_config(self.directory)
        self.raw: dict[str, Any] = json.loads((self.directory / CONFIG_FILENAME).read_text())
        self.shape = LayerShape.from_hf_dict(self.raw, str(self.directory / CONFIG_FILENAME))
        self._fingerprint: str | None = None

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            from mtp_train.fingerprint import target_fingerprint

            self._fingerprint = target_fingerprint(self.directory)
        return self._fingerprint

    @property
    def architectures(self) -> list[str]:
        return list(self.raw.get("architectures") or [])

    def frozen_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(embed_tokens [V, d], lm_head [V, d]) as stored; lm_head = embed_tokens when the embeddings are tied."""
        from safetensors import safe_open

        from mtp_train.runtime.loader import _weight_files

        wanted = {"model.embed_tokens.weight": None, "lm_head.weight": None}
        for path in _weight_files(self.directory):
            with safe_open(str(path), framework="pt") as f:
                for key in wanted:
                    if wanted[key] is None and key in f.keys():
                        wanted[key] = f.get_tensor(key)
        embed, lm_head = wanted["model.embed_tokens.weight"], wanted["lm_head.weight"]
        if embed is None:
            raise UserError(f"{self.directory}: no model.embed_tokens.weight in the target's safetensors")
        if self.config.tie_word_embeddings or lm_head is None:
            if lm_head is None and not self.config.tie_word_embeddings:
                raise UserError(f"{self.directory}: no lm_head.weight in the target's safetensors")
            lm_head = embed
        return embed, lm_head


def engine_config_from_target(target: TargetInfo, dtype: torch.dtype) -> dict[str, Any]:
    """The target's config.json as a base for an engine config: volatile keys dropped, `torch_dtype`/`dtype` set to
    the export dtype, and `rope_theta`/`rope_scaling` spelled out next to transformers 5's `rope_parameters` (vLLM
    and SGLang read the former)."""
    raw = {k: v for k, v in target.raw.items() if k not in ("_name_or_path", "_model_name_or_path", "transformers_version")}
    params = raw.get("rope_parameters")
    if isinstance(params, dict):
        if "rope_theta" not in raw and "rope_theta" in params:
            raw["rope_theta"] = params["rope_theta"]
        if "rope_scaling" not in raw:
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
            rope_type = scaling.get("rope_type", scaling.get("type", "default"))
            raw["rope_scaling"] = None if rope_type == "default" else scaling
    raw["torch_dtype"] = raw["dtype"] = DTYPE_NAMES[dtype]
    return raw


# ---- reading a native head against a target -------------------------------------------------------------------------


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    if not path.is_file():
        raise UserError(f"{path}: not found")
    try:
        with safe_open(str(path), framework="pt") as f:
            return {key: f.get_tensor(key) for key in f.keys()}
    except Exception as err:
        raise UserError(f"{path}: could not read safetensors ({err})") from None


def read_safetensors_header(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype name) without reading the tensor data."""
    from safetensors import safe_open

    if not path.is_file():
        raise UserError(f"{path}: not found")
    try:
        with safe_open(str(path), framework="pt") as f:
            out = {}
            for key in f.keys():
                piece = f.get_slice(key)
                dtype = piece.get_dtype()
                out[key] = (tuple(int(n) for n in piece.get_shape()), SAFETENSORS_DTYPES.get(dtype, dtype))
            return out
    except UserError:
        raise
    except Exception as err:
        raise UserError(f"{path}: could not read safetensors ({err})") from None


def check_head_config_against_target(
    head_config: HeadConfig, target_config, target_fingerprint: str | None, source: str
) -> None:
    """hidden_size / vocab_size / model_type must match; the fingerprint too when both are known."""
    for key in ("hidden_size", "vocab_size", "model_type"):
        head_value, target_value = getattr(head_config, key), getattr(target_config, key)
        if head_value != target_value:
            raise UserError(
                f"{source}: the head has {key}={head_value!r} but the target has {key}={target_value!r} "
                "(the head belongs to a different target)"
            )
    if head_config.target_fingerprint and target_fingerprint and head_config.target_fingerprint != target_fingerprint:
        raise UserError(
            f"{source}: target_fingerprint {head_config.target_fingerprint!r} does not match the target's "
            f"{target_fingerprint!r} (the head was trained for a different target)"
        )


def check_native_state(
    state: dict[str, tuple[int, ...]], head_config: HeadConfig, shape: LayerShape, source: str
) -> None:
    """Names and shapes of a native state dict (name -> shape) against what `head_config` over `shape` implies."""
    expected = native_tensors(head_config.kind, head_config.num_layers, shape, head_config.draft_vocab_size)
    check_state_shapes(state, expected, head_config, source)


def read_native_head(head_dir: str | os.PathLike[str], target: TargetInfo) -> tuple[dict[str, torch.Tensor], HeadConfig]:
    """A head saved by `heads.save_head` (model.safetensors + head_config.json), checked against `target` the way
    `heads.load_head` checks it, without loading the target's weights. Tensors keep their stored dtype."""
    from mtp_train.heads.io import _is_frozen_key, read_head_config

    head_dir = Path(head_dir)
    if not head_dir.is_dir():
        raise UserError(f"{head_dir}: head directory not found")
    head_config = read_head_config(head_dir)
    check_head_config_against_target(head_config, target.config, target.fingerprint, str(head_dir / HEAD_CONFIG_FILENAME))
    weights = head_dir / WEIGHTS_FILENAME
    state = read_safetensors(weights)
    frozen = sorted(key for key in state if _is_frozen_key(key))
    if frozen:
        raise UserError(f"{weights}: holds the target's frozen tensor(s) {', '.join(frozen)}; not a head file")
    check_native_state({k: tuple(v.shape) for k, v in state.items()}, head_config, target.shape, str(weights))
    if head_config.draft_vocab_size is not None:
        from mtp_train.heads.vocab import check_d2t_t2d

        for name, want in DRAFT_VOCAB_TENSORS.items():
            if TENSOR_DTYPE_NAMES.get(state[name].dtype) != want:
                raise UserError(f"{weights}: tensor {name} is {state[name].dtype}, expected {want}")
        check_d2t_t2d(state["d2t"], state["t2d"], str(weights))
    return state, head_config


# ---- the config block and writing -----------------------------------------------------------------------------------


def mtp_train_block(format_name: str, head_config: HeadConfig, **extra: Any) -> dict[str, Any]:
    block = {
        "format": format_name,
        "format_version": FORMAT_VERSION,
        "head_config": head_config.to_dict(),
        "target_fingerprint": head_config.target_fingerprint,
        "hidden_state_input": HIDDEN_STATE_INPUT,
        "draft_feedback": FEEDBACK[head_config.kind],
    }
    block.update(extra)
    return block


def check_out_dir(out: Path, overwrite: bool, protected: list[Path]) -> None:
    """Refuse a non-empty output directory unless `overwrite`, a file in its place, and any directory that holds one
    of `protected` (the head and target directories would be deleted by the replacement)."""
    resolved = out.resolve()
    for path in protected:
        path = path.resolve()
        if resolved == path or resolved in path.parents:
            raise UserError(f"--out {out}: is (or contains) the input directory {path}; choose another output directory")
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UserError(f"--out {out}: directory is not empty (pass --overwrite to replace it)")


def write_directory(out: Path, files: dict[str, bytes], overwrite: bool) -> Path:
    """Write `files` (name -> bytes) into a temporary sibling directory, then rename it to `out` (replacing an empty
    directory, or a non-empty one when `overwrite`)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    temp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temp, 0o777 & ~umask)  # mkdtemp makes it 0700; the export is an ordinary directory
        for name, data in files.items():
            with open(temp / name, "wb") as stream:
                stream.write(data)
                stream.flush()
                os.fsync(stream.fileno())
        old = None
        if out.exists():
            if any(out.iterdir()) and not overwrite:
                raise UserError(f"--out {out}: directory is not empty (pass --overwrite to replace it)")
            old = out.parent / f".{out.name}.old.{os.getpid()}"
            os.replace(out, old)
        os.replace(temp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return out


def json_bytes(data: dict[str, Any]) -> bytes:
    return (json.dumps(data, indent=2) + "\n").encode("utf-8")


def safetensors_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    from safetensors.torch import save

    # Tied embeddings give the same storage twice; safetensors refuses shared storage.
    seen: set[int] = set()
    clean = {}
    for name, tensor in tensors.items():
        tensor = tensor.detach().to("cpu").contiguous()
        if tensor.data_ptr() in seen:
            tensor = tensor.clone()
        seen.add(tensor.data_ptr())
        clean[name] = tensor
    return save(clean, metadata={"format": "pt", **metadata})
