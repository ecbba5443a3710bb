"""Shared pieces of the export formats: the target, a decoder layer's shapes, the native layout, safetensors reading
and writing, the draft-vocabulary helpers and the config block every exported format carries.

Conventions (see docs/export.md):
- Every format is a directory holding `model.safetensors` and `config.json` (native also keeps `head_config.json`).
- Every `config.json` carries an `"mtp_train"` block: the exporting format, the full `HeadConfig`, the target's
  fingerprint, and the hidden-state convention the head was trained on (the target's last layer *after* its final
  norm, i.e. what the lm_head reads; the MTP head feeds its own post-norm output back, the EAGLE-1 head its raw
  layer output).
- Every `config.json`'s `"mtp_train"` block also records `checksums`: the sha256 of each other file of the export,
  checked by `inspect` and `load_any_head` (engines ignore the block; no top-level key is added for them).
- Names inside a head's decoder layer are transformers' (`self_attn.q_proj.weight`, ...), the same in every format.
- A head with a reduced draft vocabulary (`HeadConfig.draft_vocab_size` = N) carries it as the EAGLE-3 pair
  `d2t` int64 [N] (target id = i + d2t[i]) and `t2d` bool [V] where the format stores tensors for it (native), as
  SGLang's `--speculative-token-map` file where that is how the engine reads it (eagle), and is refused by formats
  whose loaders have no draft vocabulary (deepseek-mtp, speculators). Full-vocabulary heads are written as before.
"""

from __future__ import annotations

import errno
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from mtp_train.errors import UserError
from mtp_train.fileio import (
    OUTPUT_MARKER,
    check_output_dir,
    output_marker_bytes,
    read_json_object,
    staged_directory,
)
from mtp_train.fingerprint import target_fingerprint
from mtp_train.heads.config import HeadConfig
from mtp_train.heads.io import check_finite
from mtp_train.heads.vocab import check_d2t_t2d
from mtp_train.runtime.config import ModelConfig, config_from_dict, load_config
from mtp_train.runtime.loader import _weight_files
from mtp_train.runtime.precision import TORCH_DTYPES

FORMAT_VERSION = 1
WEIGHTS_FILENAME = "model.safetensors"
CONFIG_FILENAME = "config.json"
HEAD_CONFIG_FILENAME = "head_config.json"
BLOCK_KEY = "mtp_train"
# config.json's mtp_train.checksums: {file name: hex sha256} of every other file of the export, written at export and
# checked by inspect and load_any_head (config.json itself is checked by its fields).
CHECKSUMS_KEY = "checksums"
# config.json fields every engine-format export carries: the layer shape engines build the draft block from, plus
# our own block (head config and the hidden state the head reads).
ENGINE_CONFIG_FIELDS = (
    "architectures", "model_type", "hidden_size", "intermediate_size", "num_attention_heads",
    "num_key_value_heads", "vocab_size", "rms_norm_eps", "num_hidden_layers",
    f"{BLOCK_KEY}.head_config", f"{BLOCK_KEY}.hidden_state_input",
)

DTYPE_NAMES = {dtype: name for name, dtype in TORCH_DTYPES.items()}  # torch dtype -> config.json's torch_dtype
# safetensors dtype strings (as `get_dtype()` reports them) -> our names.
SAFETENSORS_DTYPES = {
    "F32": "float32", "BF16": "bfloat16", "F16": "float16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}
# The draft-vocabulary tensors (heads.vocab), under the names vLLM/SGLang/speculators read for EAGLE-3, and their dtypes.
DRAFT_VOCAB_TENSORS = {"d2t": "int64", "t2d": "bool"}

# What the head reads and feeds back, recorded in every exported config.
HIDDEN_STATE_INPUT = "final_norm_output"  # H_i: the target's last decoder layer after its final norm
FEEDBACK = {"mtp": "post_norm_output", "eagle1": "raw_layer_output"}


def parse_dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    if name not in TORCH_DTYPES:
        raise UserError(f"--dtype {name!r} is not supported; expected one of {', '.join(TORCH_DTYPES)}")
    return TORCH_DTYPES[name]


# ---- layer shapes and the native layout -----------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerShape:
    """The shapes of one decoder layer of the target's architecture (what a head layer copies); native's config.json
    records it as `layer`."""

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
    def of(config: ModelConfig) -> "LayerShape":
        """From the runtime's parsed config (`runtime.config.load_config` / `config_from_dict`)."""
        return LayerShape(
            model_type=config.model_type,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            vocab_size=config.vocab_size,
            qkv_bias=config.attention_bias,
            o_proj_bias=config.o_proj_bias,
            mlp_bias=config.mlp_bias,
            qk_norm=config.qk_norm,
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


# The fields of an HF-style config that shape one decoder layer.
LAYER_FIELDS = (
    "model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "vocab_size", "attention_bias", "mlp_bias",
)


def layer_shape_from_config(config: dict[str, Any], source: str) -> LayerShape:
    """The layer shape of an HF-style config dict (an engine export's config.json), parsed by the runtime from the
    fields that shape a layer (the others, e.g. `layer_types` sized for the whole target, are not the head's)."""
    return LayerShape.of(config_from_dict({k: config[k] for k in LAYER_FIELDS if k in config}, source))


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


# ---- the target -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """The target a head is checked against and exported for: the runtime's parsed config and the fingerprint (what
    a loaded `CausalLM` also carries), plus, for a model directory, its config.json as stored (engine configs start
    from it) and the directory (frozen tensors, the speculators verifier path)."""

    config: ModelConfig
    fingerprint: str | None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)
    directory: Path | None = None

    @staticmethod
    def from_directory(directory: str | os.PathLike[str]) -> "Target":
        """A target model directory, without loading its weights."""
        directory = Path(directory)
        if not directory.is_dir():
            raise UserError(f"{directory}: target model directory not found")
        config = load_config(directory)
        raw = read_json_object(directory / CONFIG_FILENAME, "target config")
        return Target(config, target_fingerprint(directory), raw, directory)

    @staticmethod
    def of(target: Any) -> "Target":
        """A `Target` as is, or the one of a loaded `CausalLM`."""
        if isinstance(target, Target):
            return target
        hf = target.config.hf_config
        return Target(target.config, target.fingerprint, hf.to_dict() if hf is not None else {})

    @property
    def architectures(self) -> list[str]:
        return list(self.raw.get("architectures") or [])

    @property
    def shape(self) -> LayerShape:
        return LayerShape.of(self.config)

    def frozen_tensors(self) -> dict[str, torch.Tensor]:
        """{"embed_tokens": [V, d], "lm_head": [V, d]} as stored; lm_head = embed_tokens when the embeddings are tied."""
        wanted = {"model.embed_tokens.weight": None, "lm_head.weight": None}
        for path in _weight_files(self.directory):
            with safe_open(str(path), framework="pt") as f:
                for key in wanted:
                    if wanted[key] is None and key in f.keys():
                        wanted[key] = f.get_tensor(key)

        check_finite({k: v for k, v in wanted.items() if v is not None}, f"{self.directory} (target weights)",
                     "the target's weights are corrupted: restore the target model directory")
        embed, lm_head = wanted["model.embed_tokens.weight"], wanted["lm_head.weight"]
        if embed is None:
            raise UserError(f"{self.directory}: no model.embed_tokens.weight in the target's safetensors")
        if self.config.tie_word_embeddings or lm_head is None:
            if lm_head is None and not self.config.tie_word_embeddings:
                raise UserError(f"{self.directory}: no lm_head.weight in the target's safetensors")
            lm_head = embed
        return {"embed_tokens": embed, "lm_head": lm_head}

    def engine_config(self, dtype: torch.dtype) -> dict[str, Any]:
        """The target's config.json as a base for an engine config: volatile keys dropped, `torch_dtype`/`dtype` set to
        the export dtype, and `rope_theta`/`rope_scaling` spelled out next to transformers 5's `rope_parameters` (vLLM
        and SGLang read the former)."""
        raw = {k: v for k, v in self.raw.items() if k not in ("_name_or_path", "_model_name_or_path", "transformers_version")}
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


# ---- safetensors ----------------------------------------------------------------------------------------------------


def read_safetensors_header(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype name) without reading the tensor data."""
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
    except Exception as err:
        raise UserError(f"{path}: could not read safetensors ({err})") from None


# ---- the draft vocabulary -------------------------------------------------------------------------------------------


def declared_draft_vocab(config: dict[str, Any]) -> dict[str, Any]:
    """The draft vocabulary sizes an exported config.json declares: its top-level `draft_vocab_size` and its
    `mtp_train.head_config.draft_vocab_size`, each only when present and not null."""
    block = config.get(BLOCK_KEY) if isinstance(config.get(BLOCK_KEY), dict) else {}
    head = block.get("head_config") if isinstance(block.get("head_config"), dict) else {}
    found = {
        "draft_vocab_size": config.get("draft_vocab_size"),
        f"{BLOCK_KEY}.head_config.draft_vocab_size": head.get("draft_vocab_size"),
    }
    return {key: value for key, value in found.items() if value is not None}


def draft_vocab_size_of(config: dict[str, Any]) -> int | None:
    """N for a format that carries a draft vocabulary (None = the full vocabulary): the top-level `draft_vocab_size`,
    which must equal `mtp_train.head_config.draft_vocab_size` and lie in [1, vocab_size]; a UserError otherwise."""
    declared = declared_draft_vocab(config)
    top = declared.get("draft_vocab_size")
    recorded = declared.get(f"{BLOCK_KEY}.head_config.draft_vocab_size")
    if top != recorded:
        raise UserError(
            f"draft_vocab_size={top!r} but {BLOCK_KEY}.head_config.draft_vocab_size={recorded!r} (both must name the "
            "same draft vocabulary, or both be absent/null for the full vocabulary)"
        )
    if top is None:
        return None
    vocab = config.get("vocab_size")
    if not isinstance(top, int) or isinstance(top, bool) or not (isinstance(vocab, int) and 1 <= top <= vocab):
        raise UserError(f"draft_vocab_size={top!r}; expected an integer between 1 and vocab_size={vocab!r}")
    return top


def draft_vocab_tensor_problems(
    path: Path, header: dict[str, tuple[tuple[int, ...], str]], vocab_size: int, draft_vocab_size: int
) -> list[str]:
    """dtypes of `d2t`/`t2d` in a safetensors file (from its header) and, when both are readable, whether they describe
    the same `draft_vocab_size` strictly increasing target ids (shapes are checked by the caller)."""
    problems = []
    for name, want in DRAFT_VOCAB_TENSORS.items():
        if name in header and header[name][1] != want:
            problems.append(f"{path}: tensor {name} is {header[name][1]}, expected {want}")
    shapes_ok = (
        header.get("d2t", ((),))[0] == (draft_vocab_size,) and header.get("t2d", ((),))[0] == (vocab_size,)
    )
    if problems or not shapes_ok:
        return problems

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


# ---- the config block and the output directory ----------------------------------------------------------------------


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
    """Refuse a directory that is not empty and not an export of ours (`--overwrite` included), an export unless
    `overwrite`, a file in its place, and any directory that holds one of `protected` (the head and target
    directories would be deleted by the replacement)."""
    resolved = out.resolve()
    for path in protected:
        path = path.resolve()
        if resolved == path or resolved in path.parents:
            raise UserError(f"--out {out}: is (or contains) the input directory {path}; choose another output directory")
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: exists and is not a directory")
    if out.is_dir() and os.path.ismount(out):
        raise UserError(
            f"--out {out}: is a mount point; an export is built next to its directory and renamed into place, which "
            f"a mount point cannot be: export into a directory inside it (e.g. --out {out / 'head-export'})"
        )
    check_output_dir(out, "export", "--out")  # only an export of ours is ever replaced, --overwrite included
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UserError(f"--out {out}: holds an export (pass --overwrite to replace it)")


def _write_file(path: Path, data: bytes) -> None:
    """One file of a staged export, flushed to disk (the staging directory is what makes the export atomic)."""
    with path.open("wb") as stream:
        stream.write(data)
        stream.flush()
        os.fsync(stream.fileno())


# errno -> what the user should do, for a failed export write (the message also names --out and the OS error).
_WRITE_ERRORS = {
    errno.ENOSPC: "the disk is full: free space (the export needs about {size}) and rerun the same command",
    errno.EDQUOT: "the disk quota is exhausted: free space (the export needs about {size}) and rerun the same command",
    errno.EACCES: "no permission to write there: choose a directory you can write to (--out), or fix its permissions",
    errno.EPERM: "no permission to write there: choose a directory you can write to (--out), or fix its permissions",
    errno.EROFS: "the file system is read-only: choose a directory on a writable file system (--out)",
    errno.EBUSY: "the directory is in use or a mount point, so it cannot be replaced: export into a new directory "
    "inside it, or choose another --out",
    errno.EXDEV: "the directory is a mount point or on another file system than its parent, so it cannot be "
    "replaced: export into a new directory inside it, or choose another --out",
}


def write_directory(out: Path, files: dict[str, bytes], overwrite: bool) -> Path:
    """Write `files` (name -> bytes) and our export marker into a staged sibling directory that then replaces `out` (an
    empty directory, or an export of ours when `overwrite`). A failed write (disk full, no permission, read-only file system, a mount point)
    is a UserError naming `out` and what to do; the staging directory is removed and `out` is left as it was, so no
    half-written export is ever left under its name."""
    try:
        with staged_directory(out) as staging:
            for name, data in {**files, OUTPUT_MARKER: output_marker_bytes("export")}.items():
                _write_file(staging / name, data)
            check_output_dir(out, "export", "--out")  # filled while we wrote
            if out.is_dir() and any(out.iterdir()) and not overwrite:
                raise UserError(f"--out {out}: holds an export (pass --overwrite to replace it)")
    except OSError as err:
        advice = _WRITE_ERRORS.get(err.errno)
        if advice is None:
            raise
        size = f"{sum(len(data) for data in files.values()) / 2**20:.1f} MiB"
        where = f" ({err.filename})" if getattr(err, "filename", None) else ""
        raise UserError(
            f"--out {out}: export not written: {os.strerror(err.errno)}{where}; {advice.format(size=size)}. Nothing "
            "was left under that name (an existing export there is unchanged)"
        ) from None
    return out
