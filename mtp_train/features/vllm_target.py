"""The target of `precompute.backend: vllm`: vLLM's forward, our conventions for what is stored.

The cache holds, per token, H (the last decoder layer's output after the final norm: what an MTP / EAGLE-1 head
reads) and, for EAGLE-3, the outputs of the decoder layers `precompute.aux_layers` (0-based), exactly as the runtime
backend stores them. vLLM captures residual streams by its own ids (k = the output of decoder layer k - 1, no final
norm; docs/vllm-backend.md), so H is the target's final RMSNorm, read from its safetensors, applied here to id
`num_hidden_layers`, and aux layer j is id j + 1. The lm_head (for `precompute.target_argmax`) is read the same way;
nothing else of the target is loaded in this process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mtp_train.errors import UserError
from mtp_train.runtime.frozen_parts import EMBED_KEY, FINAL_NORM_KEY, LM_HEAD_KEY, read_tensors
from mtp_train.runtime.model import RMSNorm
from mtp_train.vllm_engine.capture import VllmCapture

VLLM_DTYPES = {"auto": "auto", "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def engine_args(section, max_sample_len: int) -> dict[str, Any]:
    """`precompute.vllm` as `vllm.LLM` keyword arguments (null keys left to vLLM)."""
    args = {"tensor_parallel_size": section.tensor_parallel_size,
            "pipeline_parallel_size": section.pipeline_parallel_size,
            "kv_cache_dtype": section.kv_cache_dtype,
            "enforce_eager": section.enforce_eager,
            "max_model_len": section.max_model_len or max_sample_len + 1}  # + the one token generated per sample
    for key in ("quantization", "gpu_memory_utilization", "max_num_batched_tokens"):
        value = getattr(section, key)
        if value is not None:
            args[key] = value
    overlap = sorted(set(section.engine_args) & (set(args) | {"model", "dtype", "speculative_config",
                                                                "kv_transfer_config", "skip_tokenizer_init"}))
    if overlap:
        raise UserError(f"precompute.vllm.engine_args: {', '.join(overlap)} set here; use the key of its own "
                        "(precompute.vllm.<key>, precision.compute) or leave it to precompute")
    if "data_parallel_size" in section.engine_args:
        raise UserError("precompute.vllm.engine_args: data_parallel_size set here; data parallelism is torchrun's "
                        "ranks, one engine each over its own tensor_parallel_size x pipeline_parallel_size GPUs "
                        "(torchrun --nproc_per_node=8 -m mtp_train precompute ... with tensor_parallel_size 1: eight "
                        "engines side by side)")
    return {**args, **section.engine_args}


class VllmTarget:
    """The target run by vLLM: `forward(ids, lengths)` -> (H [T, d], aux [T, len(aux_layers), d] or None), both in the
    engine's compute dtype; `lm_head_weight` [V, d]; `info` what the engine reported (version, dtype, device).
    `devices`: the CUDA devices of this engine (`engine_devices`), None = all. The final norm and the lm_head (the
    stored argmax: a [T, d] x [d, V] matmul per batch) run on the engine's first GPU where it has one, loaded after
    the engine has taken its share of the memory, else on the CPU."""

    def __init__(self, recipe, config, work_dir: Path, max_sample_len: int, devices: list[int] | None = None):
        self.config = config
        self.model_dir = recipe.target.path
        self.aux_layers = tuple(recipe.precompute.aux_layers)
        num_layers = config.num_hidden_layers
        self.layer_ids = list(dict.fromkeys([num_layers, *(j + 1 for j in self.aux_layers)]))
        self.capture = VllmCapture(recipe.target.path, VLLM_DTYPES[recipe.precision.compute], self.layer_ids, work_dir,
                                   engine_args(recipe.precompute.vllm, max_sample_len), recipe.precompute.vllm.python,
                                   devices)
        on_gpu = recipe.target.device != "cpu" and torch.cuda.is_available()
        self.device = torch.device("cuda", (devices or [0])[0]) if on_gpu else torch.device("cpu")
        self.info: dict[str, Any] = {}
        self.norm: RMSNorm | None = None
        self.lm_head_weight: torch.Tensor | None = None

    def start(self, want_lm_head: bool) -> dict[str, Any]:
        self.info = self.capture.start()
        dtype = getattr(torch, self.info["dtype"])
        d, vocab = self.config.hidden_size, self.config.vocab_size
        shapes = {FINAL_NORM_KEY: (d,)}
        head_key = EMBED_KEY if self.config.tie_word_embeddings else LM_HEAD_KEY
        if want_lm_head:
            shapes[head_key] = (vocab, d)
        tensors = read_tensors(self.model_dir, shapes, dtype, self.device)
        self.norm = RMSNorm(d, self.config.rms_norm_eps).to(self.device, dtype)
        with torch.no_grad():
            self.norm.weight.copy_(tensors[FINAL_NORM_KEY])
        self.lm_head_weight = tensors.get(head_key)
        return self.info

    @property
    def dtype(self) -> str:
        return self.info["dtype"]

    @property
    def kv_dtype(self) -> str:
        kv = self.info.get("kv_cache_dtype", "auto")
        return self.dtype if kv == "auto" else kv

    def header_fields(self) -> dict[str, Any]:
        return {"backend": "vllm", "vllm_version": self.info["vllm"], "kv_dtype": self.kv_dtype,
                "tensor_parallel": self.capture.engine_args["tensor_parallel_size"],
                "pipeline_parallel": self.capture.engine_args["pipeline_parallel_size"]}

    def flops(self, lengths: list[int], argmax_rows: int) -> float:
        return 0.0  # vLLM's kernels are not counted here: precompute reports tokens/s only

    def forward(self, ids: list[torch.Tensor], lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        states = self.capture.capture([t.tolist() for t in ids])  # each [T_i, layers, d]
        stacked = torch.cat(states).to(self.device)  # [T, layers, d]
        with torch.no_grad():
            hidden = self.norm(stacked[:, 0])
        if not self.aux_layers:
            return hidden, None
        aux = stacked[:, [self.layer_ids.index(j + 1) for j in self.aux_layers]]
        return hidden, aux

    def close(self, abort: bool = False) -> None:
        self.capture.close(abort)


def engine_devices(section, local_rank: int, local_world_size: int, cuda_devices: int) -> list[int] | None:
    """The CUDA devices of this rank's engine when ranks run engines side by side (data parallelism): local rank r
    takes devices [r * n, (r + 1) * n), n = tensor_parallel_size x pipeline_parallel_size. None with one rank per
    node or no CUDA device (vLLM's CPU build: each engine is its own process and threads)."""
    if local_world_size <= 1 or cuda_devices == 0:
        return None
    per_engine = section.tensor_parallel_size * section.pipeline_parallel_size
    if local_world_size * per_engine > cuda_devices:
        raise UserError(
            f"precompute.backend vllm: {local_world_size} ranks on this node, each an engine over "
            f"tensor_parallel_size x pipeline_parallel_size = {per_engine} GPUs, need {local_world_size * per_engine} "
            f"GPUs; this node has {cuda_devices} (fewer torchrun ranks, or smaller engines)")
    return list(range(local_rank * per_engine, (local_rank + 1) * per_engine))

