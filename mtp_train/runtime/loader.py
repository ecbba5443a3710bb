"""Build a `CausalLM` from a HF model directory (config.json + *.safetensors, single file or sharded)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from mtp_train.errors import UserError
from mtp_train.fileio import read_json_object
from mtp_train.runtime.attention import get_backend
from mtp_train.runtime.config import ModelConfig, load_config, require_runtime
from mtp_train.runtime.decode_runner import apply_decode_weights
from mtp_train.runtime.deepseek import DeepseekForCausalLM, is_mtp_key
from mtp_train.runtime.model import CausalLM
from mtp_train.runtime.precision import DECODE_ONLY_DTYPES, TORCH_DTYPES, Precision

log = logging.getLogger(__name__)

DTYPES = TORCH_DTYPES


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device {device!r} requested but CUDA is not available on this machine; use --device cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        torch_dtype = dtype
    elif dtype in DTYPES:
        torch_dtype = DTYPES[dtype]
    else:
        raise UserError(f"dtype {dtype!r} is not supported; expected one of {', '.join(DTYPES)}")
    if device.type == "cpu" and torch_dtype == torch.float16:
        raise UserError("dtype float16 is not available for CPU inference here; use bfloat16 or float32")
    if device.type == "cuda" and torch_dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise UserError("dtype bfloat16 is not supported by this GPU; use float16 or float32")
    return torch_dtype


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index, "the sharded weights' index").get("weight_map", {})
        if not isinstance(weight_map, dict):
            raise UserError(f"{index}: weight_map is not a JSON object")
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise UserError(f"{index}: lists shard(s) that are missing: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise UserError(f"{model_dir}: no *.safetensors weights found (expected model.safetensors or a sharded index)")
    return files


def model_class(config: ModelConfig) -> type[CausalLM]:
    """The runtime class of a config's model family: the Llama family's `CausalLM`, or DeepSeek-V2/V3's."""
    if config.deepseek is not None:

        return DeepseekForCausalLM
    return CausalLM


def checkpoint_index(model_dir: Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Checkpoint key -> (the safetensors file holding it, its shape), from the files' headers only: no tensor data is
    read. A key stored in two files counts as the later file's (sorted by name)."""
    index: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for path in _weight_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    index[key] = (path, tuple(f.get_slice(key).get_shape()))
        except Exception as err:
            raise UserError(f"{path}: could not read safetensors ({err})") from None
    return index


def assign_tensor(model: nn.Module, key: str, value: torch.Tensor) -> None:
    """Put `value` in place of the parameter or buffer `key` of `model` (one built on the meta device), keeping a
    parameter's requires_grad."""
    module_name, _, name = key.rpartition(".")
    module = model.get_submodule(module_name)
    current = getattr(module, name)
    if isinstance(current, nn.Parameter):
        setattr(module, name, nn.Parameter(value, requires_grad=current.requires_grad))
    else:
        setattr(module, name, value)


def stream_into(model: nn.Module, index: dict[str, tuple[Path, tuple[int, ...]]], keys: list[str],
                read: Callable[[Any, str], torch.Tensor], device: torch.device,
                dtype_of: Callable[[str], torch.dtype]) -> None:
    """Read `keys` (of `index`, `checkpoint_index`) one tensor at a time and assign each into `model`, converted to
    `dtype_of(key)` on `device`: `read(f, key)` takes the key's tensor (or the part of it this rank holds) from the
    open safetensors file `f`. Each host copy is dropped once it is on `device`, so host memory holds one tensor's
    worth at a time, never the model: a target that fits only on its devices (or only split over ranks) loads."""
    by_file: dict[Path, list[str]] = {}
    for key in keys:
        by_file.setdefault(index[key][0], []).append(key)
    for path, file_keys in by_file.items():
        try:
            handle = safe_open(str(path), framework="pt")
        except Exception as err:
            raise UserError(f"{path}: could not read safetensors ({err})") from None
        with handle as f:
            for key in file_keys:
                assign_tensor(model, key, _read_one(path, f, key, read).to(device=device, dtype=dtype_of(key)))


def _read_one(path: Path, f: Any, key: str, read: Callable[[Any, str], torch.Tensor]) -> torch.Tensor:
    try:
        return read(f, key)
    except Exception as err:
        raise UserError(f"{path}: could not read safetensors ({err})") from None


def load_model(
    model_dir: str | Path,
    dtype: str | torch.dtype = "bfloat16",
    device: str | torch.device = "auto",
    backend: str = "auto",
    precision: Precision | None = None,
) -> CausalLM:
    """Load a target model for inference. `precision` (from `runtime.precision.resolve_precision`) overrides `dtype`:
    the weights are held in its `dtype` and, when its decode dtype differs, few-row matmuls read a second copy
    (`apply_decode_weights`). Errors (missing files, unsupported options, missing tensors) are `UserError`s naming
    the file and key."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise UserError(f"{model_dir}: model directory not found (run `mtp-train fetch-assets` for the default model)")
    config: ModelConfig = load_config(model_dir)
    require_runtime(config, model_dir / "config.json")
    device = resolve_device(device) if isinstance(device, str) else device
    torch_dtype = resolve_dtype(precision.dtype if precision is not None else dtype, device)
    index = checkpoint_index(model_dir)  # the headers: every check below runs before any tensor is read
    stored = set(index)
    if config.tie_word_embeddings:
        stored.discard("lm_head.weight")  # some checkpoints store the tied copy too
    if config.deepseek is not None:  # DeepSeek's MTP modules (model.layers.{L + k}.*) are heads, not target layers
        stored = {k for k in stored if not is_mtp_key(config, k)}
    # A DeepSeek (MLA) target attends with its own code, not the backend: its head_dim is no attention width to check.
    head_dim = None if config.deepseek is not None else config.head_dim
    with torch.device("meta"):
        model = model_class(config)(config, backend=get_backend(backend, device, torch_dtype, head_dim))
    shapes = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    expected = set(shapes)
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing = sorted(expected - stored)
    unexpected = sorted(k for k in stored - expected if "rotary_emb" not in k)
    if missing:
        raise UserError(
            f"{model_dir}: weights missing for {len(missing)} tensor(s), e.g. {', '.join(missing[:3])} "
            f"(config.json says model_type={config.model_type}, {config.num_hidden_layers} layers)"
        )
    if unexpected:
        raise UserError(
            f"{model_dir}: unexpected tensor(s) {', '.join(unexpected[:3])} for model_type={config.model_type} "
            "(an unsupported config option or a different architecture)"
        )
    for key in expected:
        if index[key][1] != shapes[key]:
            raise UserError(f"{model_dir}: tensor {key} has shape {index[key][1]}, config implies {shapes[key]}")
    keep_fp32 = getattr(model, "FP32_TENSORS", ())  # DeepSeek's router (runtime/deepseek.py)
    stream_into(model, index, sorted(expected), lambda f, key: f.get_tensor(key), device,
                lambda key: torch.float32 if keep_fp32 and key.endswith(keep_fp32) else torch_dtype)
    return finish_loading(model, model_dir, device, precision)


def finish_loading(model: CausalLM, model_dir: Path, device: torch.device, precision: Precision | None) -> CausalLM:
    """The steps after the weights are assigned (here and in `tensor_parallel.load_model_tensor_parallel`): tied
    lm_head, source dir, device, frozen inference mode, the decode path of `precision`."""
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.source_dir = str(model_dir)
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    if precision is not None:
        if precision.decode_dtype not in DECODE_ONLY_DTYPES:  # int8: checked where it was resolved (CPU kernels)
            resolve_dtype(precision.decode_dtype, device)
        apply_decode_weights(model, precision)
        model.kv_cache_dtype = precision.kv_cache_torch_dtype
    return model


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as err:
        raise UserError(f"{model_dir}: could not load the tokenizer ({err})") from None
