"""Tensor parallelism for the runtime, applied from outside the model definition (as gpt-fast's `tp.py` does).

One copy of the target is split over the N ranks of a tensor-parallel group (`torch.distributed`, NCCL on CUDA, gloo on
the CPU), Megatron-style, with one all-reduce per attention block and one per MLP block:

- attention: q/k/v projections column-parallel by whole heads (rows of their weights and biases), o_proj row-parallel
  (its input columns). Heads go to ranks in whole GQA groups (a KV head with the query heads that read it), as evenly
  as the groups allow: SmolLM2's 3 KV groups of 3 heads on 2 ranks are 2 + 1 groups. With fewer KV heads than ranks
  each KV head is replicated on N / kv_heads ranks and its query heads split between them.
- MLP: gate/up column-parallel, down row-parallel, the intermediate size split as evenly as it goes.
- a row-parallel bias is added once: the group's leader keeps it, the others hold zeros.
- embed_tokens, the norms and lm_head are replicated. A draft head reads the target's `embed_tokens.weight` and
  `lm_head.weight` whole (its draft-vocabulary rows, the frozen-parts checks of `export.load`), and every rank runs the
  same decoding loop, so each rank needs the full logits anyway. The price is memory: for Llama-3.3-70B the two
  128256 × 8192 bf16 matrices are 4.2 GB per rank (2 × 2.1 GB), 3 % of the 141 GB of weights (computed, not measured).
- the paged KV cache holds the rank's local KV heads only (`new_kv_cache`).

`mtp_train.runtime.model` stays the definition: this module narrows the parameters, sets the attention modules' head
counts to the local ones, and adds forward hooks that all-reduce the attention and MLP outputs. The CPU decode kernels
(`runtime/cpu_decode.py`) read `tensor_parallel_all_reduce` from each layer and reduce before their residual adds.
`load_model_tensor_parallel` reads only each rank's slices from the safetensors files (a 70B target never has to fit
in one rank's memory).

Layout under torchrun with world size W and tensor parallelism N: W / N data-parallel groups of N consecutive ranks
(ranks dp·N .. dp·N + N - 1; on one node they share NVLink); the first rank of a group is its leader (writes the
group's files, prints).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from mtp_train.errors import UserError
from mtp_train.runtime.attention import get_backend
from mtp_train.runtime.config import ModelConfig, load_config, require_runtime
from mtp_train.runtime.distributed import all_reduce, init_process_group
from mtp_train.runtime.kv_cache import KVCache, PageAllocator
from mtp_train.runtime.loader import (
    assign_tensor,
    checkpoint_index,
    finish_loading,
    load_model,
    resolve_device,
    resolve_dtype,
    stream_into,
)
from mtp_train.runtime.model import MLP, Attention, CausalLM

log = logging.getLogger(__name__)

SETTING = "target.tensor_parallel (--tp)"


# ---------------------------------------------------------------------------------------------------------------
# layout and process groups
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParallelLayout:
    """Where one rank sits in the TP × DP layout: `dp_size` groups of `tensor_parallel` consecutive ranks."""

    rank: int = 0
    world_size: int = 1
    tensor_parallel: int = 1

    def __post_init__(self):
        if self.tensor_parallel < 1:
            raise UserError(f"{SETTING}: {self.tensor_parallel} must be at least 1")
        if self.world_size % self.tensor_parallel:
            raise UserError(
                f"{SETTING}: {self.tensor_parallel} does not divide the world size {self.world_size}; launch "
                f"torchrun with a multiple of {self.tensor_parallel} processes (W / N data-parallel groups of N ranks)"
            )

    @staticmethod
    def from_environ(tensor_parallel: int = 1) -> "ParallelLayout":
        return ParallelLayout(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), tensor_parallel)

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tensor_parallel

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tensor_parallel

    @property
    def dp_size(self) -> int:
        return self.world_size // self.tensor_parallel

    @property
    def is_leader(self) -> bool:
        """The group's first rank: it writes the group's shards and reports."""
        return self.tp_rank == 0

    @property
    def tp_ranks(self) -> list[int]:
        return list(range(self.dp_rank * self.tensor_parallel, (self.dp_rank + 1) * self.tensor_parallel))


class TensorParallelGroup:
    """The process group one sharded target computes over (size 1: no communication at all)."""

    def __init__(self, size: int = 1, rank: int = 0, group=None, leader: int = 0):
        self.size, self.rank, self.group, self.leader = size, rank, group, leader

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the group, in place; returns it."""
        if self.size > 1:
            all_reduce(tensor, group=self.group)  # refuses a tensor off the backend's device (a CPU one under NCCL)
        return tensor

    def broadcast_object(self, obj):
        """The leader's `obj` on every rank of the group."""
        if self.size == 1:
            return obj

        holder = [obj]
        dist.broadcast_object_list(holder, src=self.leader, group=self.group)
        return holder[0]


def init_distributed(device: torch.device | str, timeout_minutes: float):
    """`torch.distributed` with the default group initialized for a stage computing on `device` (NCCL for CUDA,
    gloo for the CPU; `runtime.distributed.init_process_group`), or None in a single process."""
    if int(os.environ.get("WORLD_SIZE", 1)) <= 1:
        return None
    init_process_group(device, timeout_minutes)
    return dist


def init_tensor_parallel(layout: ParallelLayout, device: torch.device | str,
                         timeout_minutes: float) -> TensorParallelGroup:
    """This rank's tensor-parallel group; the default group, where none exists yet, for a stage on `device` with
    collectives timing out after `timeout_minutes` (the recipe's `distributed.timeout_minutes`). Collective: every
    rank creates every group, in the same order."""
    if layout.tensor_parallel == 1:
        return TensorParallelGroup()
    dist = init_distributed(device, timeout_minutes)
    if dist is None:
        raise UserError(f"{SETTING}: {layout.tensor_parallel} needs that many processes; launch with "
                        f"`torchrun --nproc_per_node={layout.tensor_parallel} -m mtp_train ...`")
    mine = None
    for dp_rank in range(layout.dp_size):
        ranks = list(range(dp_rank * layout.tensor_parallel, (dp_rank + 1) * layout.tensor_parallel))
        group = dist.new_group(ranks) if layout.dp_size > 1 else dist.group.WORLD
        if dp_rank == layout.dp_rank:
            mine = group
    return TensorParallelGroup(layout.tensor_parallel, layout.tp_rank, mine, leader=layout.tp_ranks[0])


# ---------------------------------------------------------------------------------------------------------------
# the split
# ---------------------------------------------------------------------------------------------------------------


def balanced_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of part `index` when `total` items are cut into `parts` contiguous parts differing by at most 1."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


@dataclass(frozen=True)
class HeadShard:
    """One rank's attention heads: query heads [q_start, q_stop) and the KV heads [kv_start, kv_stop) they read."""

    q_start: int
    q_stop: int
    kv_start: int
    kv_stop: int

    @property
    def num_heads(self) -> int:
        return self.q_stop - self.q_start

    @property
    def num_kv_heads(self) -> int:
        return self.kv_stop - self.kv_start


def shard_heads(num_heads: int, num_kv_heads: int, tp: int, tp_rank: int) -> HeadShard:
    """Whole GQA groups per rank when there are at least `tp` KV heads (as evenly as they go); with fewer, each KV
    head replicated on tp / kv_heads ranks and its query heads split evenly between them."""
    group = num_heads // num_kv_heads  # query heads per KV head
    if num_kv_heads >= tp:
        kv_start, kv_stop = balanced_range(num_kv_heads, tp, tp_rank)
        return HeadShard(kv_start * group, kv_stop * group, kv_start, kv_stop)
    if tp % num_kv_heads or group % (tp // num_kv_heads):
        raise UserError(
            f"{SETTING}: {tp} ranks cannot split {num_heads} attention heads with {num_kv_heads} KV heads; with fewer "
            "KV heads than ranks, the ranks must be a multiple of the KV heads and divide the attention heads "
            f"(here: a divisor of {num_heads} that is a multiple of {num_kv_heads}, or at most {num_kv_heads})"
        )
    per_kv = tp // num_kv_heads  # ranks sharing one KV head
    kv = tp_rank // per_kv
    q_start = kv * group + (tp_rank % per_kv) * (group // per_kv)
    return HeadShard(q_start, q_start + group // per_kv, kv, kv + 1)


@dataclass(frozen=True)
class Slice:
    """The part of a tensor a rank holds: [start, stop) along `dim`."""

    dim: int
    start: int
    stop: int


LEADER_ONLY = "leader-only"  # a row-parallel bias: the leader holds it, the other ranks zeros (added once)


def shard_plan(config: ModelConfig, tp: int, tp_rank: int) -> dict[str, Slice | str]:
    """Parameter name -> how rank `tp_rank` of `tp` holds it (names absent: replicated)."""
    heads = shard_heads(config.num_attention_heads, config.num_key_value_heads, tp, tp_rank)
    if config.intermediate_size < tp:
        raise UserError(f"{SETTING}: {tp} ranks exceed the MLP's {config.intermediate_size} columns")
    d = config.head_dim
    q = Slice(0, heads.q_start * d, heads.q_stop * d)
    kv = Slice(0, heads.kv_start * d, heads.kv_stop * d)
    inter_start, inter_stop = balanced_range(config.intermediate_size, tp, tp_rank)
    row_bias = None if tp_rank == 0 else LEADER_ONLY
    plan: dict[str, Slice | str] = {}
    for i in range(config.num_hidden_layers):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        plan.update({f"{attn}.q_proj.weight": q, f"{attn}.q_proj.bias": q,
                     f"{attn}.k_proj.weight": kv, f"{attn}.k_proj.bias": kv,
                     f"{attn}.v_proj.weight": kv, f"{attn}.v_proj.bias": kv,
                     f"{attn}.o_proj.weight": Slice(1, q.start, q.stop)})
        column = Slice(0, inter_start, inter_stop)
        plan.update({f"{mlp}.gate_proj.weight": column, f"{mlp}.gate_proj.bias": column,
                     f"{mlp}.up_proj.weight": column, f"{mlp}.up_proj.bias": column,
                     f"{mlp}.down_proj.weight": Slice(1, inter_start, inter_stop)})
        if row_bias:
            plan.update({f"{attn}.o_proj.bias": row_bias, f"{mlp}.down_proj.bias": row_bias})
    return plan


def _check_supported(model: CausalLM) -> None:
    for i, layer in enumerate(model.model.layers):
        if type(layer.self_attn) is not Attention or type(layer.mlp) is not MLP:
            raise UserError(f"{SETTING}: {model.config.model_type} (layer {i}: {type(layer.self_attn).__name__}, "
                            f"{type(layer.mlp).__name__}) has no tensor-parallel split here; use tensor_parallel: 1")


def shard_model(model: CausalLM, group: TensorParallelGroup) -> CausalLM:
    """Split a `CausalLM` (loaded, or still on the meta device) over `group` in place and install the all-reduces and
    the local KV cache. Size 1: unchanged."""
    if group.size == 1:
        return model
    _check_supported(model)
    config = model.config
    plan = shard_plan(config, group.size, group.rank)
    _narrow_parameters(model, plan)
    heads = shard_heads(config.num_attention_heads, config.num_key_value_heads, group.size, group.rank)
    for layer in model.model.layers:
        layer.self_attn.num_heads, layer.self_attn.num_kv_heads = heads.num_heads, heads.num_kv_heads
    _install_communication(model, group)
    return model


def _narrow_parameters(model: nn.Module, plan: dict[str, Slice | str]) -> None:
    for name, how in plan.items():
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        param = getattr(module, attr, None)
        if param is None:
            continue  # a bias the architecture does not have
        if how == LEADER_ONLY:
            value = torch.zeros_like(param)
        else:
            value = param.detach().narrow(how.dim, how.start, how.stop - how.start).clone()
        setattr(module, attr, nn.Parameter(value, requires_grad=param.requires_grad))
        if isinstance(module, nn.Linear):
            module.out_features, module.in_features = module.weight.shape


def _install_communication(model: CausalLM, group: TensorParallelGroup) -> None:
    def reduce_output(_module, _inputs, output: torch.Tensor) -> torch.Tensor:
        return group.all_reduce(output)

    for layer in model.model.layers:
        layer.self_attn.register_forward_hook(reduce_output)
        layer.mlp.register_forward_hook(reduce_output)
        layer.tensor_parallel_all_reduce = group.all_reduce  # read by the CPU decode kernels (runtime/cpu_decode.py)
    attn = model.model.layers[0].self_attn
    num_kv_heads, head_dim, num_layers = attn.num_kv_heads, attn.head_dim, model.config.num_hidden_layers

    def new_kv_cache(allocator: PageAllocator) -> KVCache:
        """This rank's KV heads only ([pages, page_size, local_kv_heads, head_dim] per layer)."""
        return KVCache(allocator, num_layers, num_kv_heads, head_dim, model.kv_cache_dtype or model.dtype, model.device)

    model.new_kv_cache = new_kv_cache
    model.tensor_parallel = group


# ---------------------------------------------------------------------------------------------------------------
# loading each rank's slices
# ---------------------------------------------------------------------------------------------------------------


def load_model_tensor_parallel(model_dir: str | Path, group: TensorParallelGroup, dtype="bfloat16",
                               device: str | torch.device = "auto", backend: str = "auto", precision=None) -> CausalLM:
    """`runtime.loader.load_model` for one rank of `group`: reads only the rank's slices of the split tensors
    (safetensors slices, nothing else materialized), one tensor at a time straight to `device` (host memory holds
    one slice at a time, `loader.stream_into`), then the decode path as `load_model` sets it. Size 1: `load_model`
    itself."""
    if group.size == 1:
        return load_model(model_dir, dtype=dtype, device=device, backend=backend, precision=precision)
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise UserError(f"{model_dir}: model directory not found (run `mtp-train fetch-assets` for the default model)")
    config = load_config(model_dir)
    require_runtime(config, model_dir / "config.json")
    if getattr(config, "deepseek", None) is not None:
        raise UserError(f"{SETTING}: {model_dir} is a DeepSeek (MLA/MoE) target, which has no tensor-parallel split "
                        "here; use tensor_parallel: 1")
    device = resolve_device(device) if isinstance(device, str) else device
    torch_dtype = resolve_dtype(precision.dtype if precision is not None else dtype, device)
    with torch.device("meta"):
        model = CausalLM(config, backend=get_backend(backend, device, torch_dtype, config.head_dim))
    full_shapes = {key: tuple(t.shape) for key, t in model.state_dict().items()}
    shard_model(model, group)
    plan = shard_plan(config, group.size, group.rank)
    expected = set(full_shapes)
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    index = checkpoint_index(model_dir)  # the headers: every check below runs before any tensor is read
    stored = {key: shape for key, (_path, shape) in index.items()}
    for key in sorted(expected & stored.keys()):
        if stored[key] != full_shapes[key]:
            raise UserError(f"{model_dir}: tensor {key} has shape {stored[key]}, config implies {full_shapes[key]}")
    missing = sorted(expected - stored.keys())
    if missing:
        raise UserError(f"{model_dir}: weights missing for {len(missing)} tensor(s), e.g. {', '.join(missing[:3])} "
                        f"(config.json says model_type={config.model_type}, {config.num_hidden_layers} layers)")
    unexpected = sorted(key for key in stored.keys() - expected
                        if "rotary_emb" not in key and not (key == "lm_head.weight" and config.tie_word_embeddings))
    if unexpected:
        raise UserError(f"{model_dir}: unexpected tensor(s) {', '.join(unexpected[:3])} for "
                        f"model_type={config.model_type} (an unsupported config option or a different architecture)")
    for key in expected:  # a row-parallel bias off the leader: zeros, nothing to read
        if plan.get(key) == LEADER_ONLY:
            assign_tensor(model, key, torch.zeros(full_shapes[key], dtype=torch_dtype, device=device))

    def rank_part(f, key: str) -> torch.Tensor:
        """The part of `key` this rank holds, read as a safetensors slice (the rest of the tensor is never read)."""
        how = plan.get(key)
        if how is None:
            return f.get_tensor(key)
        part = f.get_slice(key)
        return part[how.start:how.stop] if how.dim == 0 else part[:, how.start:how.stop]

    stream_into(model, index, sorted(key for key in expected if plan.get(key) != LEADER_ONLY), rank_part, device,
                lambda _key: torch_dtype)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.out_features, module.in_features = module.weight.shape
    return finish_loading(model, model_dir, device, precision)


def describe(layout: ParallelLayout, config: ModelConfig) -> str:
    """One line for a stage's output: the layout and this rank's share of the heads."""
    heads = shard_heads(config.num_attention_heads, config.num_key_value_heads, layout.tensor_parallel,
                        layout.tp_rank)
    return (f"tensor parallel {layout.tensor_parallel} × data parallel {layout.dp_size} (world {layout.world_size}); "
            f"rank {layout.rank}: heads {heads.q_start}..{heads.q_stop - 1}, KV heads {heads.kv_start}.."
            f"{heads.kv_stop - 1}")
