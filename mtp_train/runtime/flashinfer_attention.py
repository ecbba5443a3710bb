"""Attention through FlashInfer's batch kernels (CUDA, fp16/bf16): the `flashinfer` backend of `get_backend`.

One forward's `BatchInfo` maps onto one of three FlashInfer wrappers, planned once per batch and run by every layer:

- decode (a cache, one new token per sequence, no tree): `BatchDecodeWithPagedKVCacheWrapper`;
- paged prefill, verify and trees (a cache, any number of new tokens): `BatchPrefillWithPagedKVCacheWrapper`, causal
  (FlashInfer aligns a sequence's queries with its last keys, which is where the new tokens sit), or for a tree batch
  with a custom mask over each sequence's whole key range: the prefix before the tree region causally (within the
  sliding window), the region as `BatchInfo.tree_masks` says;
- no cache (feature precompute): `BatchPrefillWithRaggedKVCacheWrapper`, causal, each sequence over its own tokens,
  keys and values rounded to `BatchInfo.kv_dtype` first as the torch backend rounds them.

New keys and values are written into the cache's slots (`slot_mapping`) before the paged kernels read it. The K/V
cache layout, `[num_pages, page_size, kv_heads, head_dim]` per layer for K and V, is FlashInfer's NHD layout, so the
kernels read it in place. Grouped-query attention is the kernels' own (`num_qo_heads` a multiple of `num_kv_heads`).

FlashInfer has no backward pass, computes in fp16/bf16 only, over a K/V cache of the queries' dtype, and its attention
kernels are built for head_dim 64, 128 and 256 (`HEAD_DIMS`; FlashInfer's Python side does not refuse another, which
then fails inside it, and a fault inside a kernel can leave the CUDA context unusable for everything after it). Calls
it cannot serve go to the torch backend: tensors that need gradients (training a draft head), fp32 queries, a cache in
another dtype than the queries, another head_dim, tensors off CUDA. `get_backend` checks the model's head_dim before
it builds this backend (`auto` then picks torch; an explicit `flashinfer` is a UserError).

`plan()` reads the index tensors (indptrs, page indices, last-page lengths) on the host and copies them to the device
itself, so they are built on the host (pinned on CUDA: the copy it queues does not wait for the device); only a tree's
custom mask is built on the device, where FlashInfer packs it. `flashinfer-python` is an optional dependency (`pip
install 'mtp_train[gpu]'`), imported only when this backend is built.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from mtp_train.errors import UserError
from mtp_train.runtime.attention import AttentionBackend, BatchInfo, TorchAttention

log = logging.getLogger(__name__)

INSTALL_HINT = "install the optional extra: pip install 'mtp_train[gpu]' (it brings flashinfer-python)"
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (64, 128, 256)  # the head dims FlashInfer's attention kernels are built for (queries, keys and values)
WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended float workspace (split-KV partial results)
# Decode with grouped-query attention runs FlashInfer's tensor-core (prefill) kernel when a KV head serves more
# than this many query heads: the CUDA-core decode kernel's work per KV head grows with the group.
_TENSOR_CORE_DECODE_GROUP = 4


class FlashInferUnavailable(UserError):
    """flashinfer-python is not installed (`installed` False) or does not import (True)."""

    def __init__(self, message: str, installed: bool):
        super().__init__(message)
        self.installed = installed


def import_flashinfer():
    """The `flashinfer` module; FlashInferUnavailable naming the optional extra when it is not installed, or saying
    why an installed one does not import."""
    try:
        import flashinfer
    except ImportError as err:
        raise FlashInferUnavailable(f"the flashinfer attention backend needs the flashinfer-python package ({err}); "
                                    f"{INSTALL_HINT}, or choose target.attention: torch", installed=False) from None
    except Exception as err:  # an install that fails on import (e.g. built for another CUDA) raises its own errors
        raise FlashInferUnavailable(
            f"flashinfer-python is installed but does not import ({type(err).__name__}: {err}); reinstall it for "
            "this torch and CUDA, or choose target.attention: torch", installed=True) from None
    return flashinfer


def flashinfer_available() -> bool:
    """Whether `import flashinfer` works here (for `target.attention: auto`). An installed package that does not
    import is logged, since auto then attends with torch."""
    try:
        import_flashinfer()
    except FlashInferUnavailable as err:
        if err.installed:
            log.warning("target.attention auto: attending with torch: %s", err)
        return False
    return True


def head_dim_supported(head_dim: int) -> bool:
    """Whether FlashInfer's kernels take this head_dim (`HEAD_DIMS`)."""
    return head_dim in HEAD_DIMS


def window_left(sliding_window: int | None) -> int:
    """FlashInfer's `window_left` for a sliding window of `sliding_window` keys: a query at position p sees keys
    p - window_left .. p (both ends included), the torch backend's `key > p - sliding_window`; -1 = no window."""
    return -1 if sliding_window is None else sliding_window - 1


def host_int32(values, pin: bool) -> torch.Tensor:
    """`values` (a list or a host tensor) as an int32 host tensor for `plan()`, pinned when `pin` (a CUDA target: the
    copy plan() queues to the device then does not wait for it)."""
    tensor = (values.to(device="cpu", dtype=torch.int32) if isinstance(values, torch.Tensor)
              else torch.tensor(values, dtype=torch.int32))
    return tensor.pin_memory() if pin else tensor


def paged_kv_table(batch: BatchInfo, pin: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kv_page_indptr [batch + 1], kv_page_indices [pages], kv_last_page_len [batch]), int32 on the host (pinned
    when `pin`), describing exactly each sequence's attended keys (`kv_lens`). `BatchInfo`'s own table may describe
    more positions (pages reserved ahead, `for_sequences(reserve_ahead=...)`); FlashInfer reads a sequence's length
    from its table, so the table is cut to `kv_lens` here."""
    page_size = batch.page_size
    page_indptr = batch.kv_page_indptr.tolist()
    pages_used = [-(-kv_len // page_size) for kv_len in batch.kv_lens]
    indptr = [0]
    for used in pages_used:
        indptr.append(indptr[-1] + used)
    if indptr == page_indptr:
        indices = batch.kv_page_indices
    else:
        indices = torch.cat([batch.kv_page_indices[page_indptr[b] : page_indptr[b] + used]
                             for b, used in enumerate(pages_used)])
    last_page_len = [kv_len - (used - 1) * page_size if used else 0 for kv_len, used in zip(batch.kv_lens, pages_used)]
    return host_int32(indptr, pin), host_int32(indices, pin), host_int32(last_page_len, pin)


def tree_custom_mask(batch: BatchInfo, sliding_window: int | None, device: torch.device | str) -> torch.Tensor:
    """FlashInfer's flat custom mask for a tree batch: per sequence b a [q_len_b, kv_len_b] bool block (True =
    attend) over its WHOLE key range, flattened row-major and concatenated over b. The keys before the tree region
    (positions 0 .. kv_len_b - W_b - 1) are seen causally by rotary position, within `sliding_window`; the region
    (the last W_b keys) as `batch.tree_masks[b]` says."""
    bounds = batch.qo_indptr.tolist()
    blocks = []
    for b, tree_mask in enumerate(batch.tree_masks):
        q_positions = batch.positions[bounds[b] : bounds[b + 1]].to(device)  # [q_len_b]
        prefix_len = batch.kv_lens[b] - int(tree_mask.shape[1])
        key_positions = torch.arange(prefix_len, device=device)
        visible = key_positions[None, :] <= q_positions[:, None]  # [q_len_b, prefix_len]
        if sliding_window is not None:
            visible &= key_positions[None, :] > q_positions[:, None] - sliding_window
        blocks.append(torch.cat([visible, tree_mask.to(device=device, dtype=torch.bool)], dim=1).reshape(-1))
    return torch.cat(blocks)


@dataclass
class FlashInferPlan:
    """What one batch's wrapper is planned with, shared by every layer: which wrapper (`kind`), and the `plan()`
    arguments in FlashInfer's order (`args`, then `kwargs`)."""

    kind: str  # decode | paged | tree | ragged (paged and tree: both the paged prefill wrapper)
    window_left: int
    use_tensor_cores: bool  # decode only
    head_dim: int
    q_dtype: torch.dtype
    args: tuple
    kwargs: dict = field(default_factory=dict)

    @property
    def wrapper_key(self) -> tuple:
        """The wrapper this plan runs on. Some FlashInfer releases resolve a wrapper's `backend="auto"` (FA2 or
        FA3) at its first plan() and keep it, and only FA2 takes a custom mask; so causal and tree batches, and
        plans whose head_dim or dtype may resolve differently, each get their own wrapper."""
        return self.kind, self.window_left, self.use_tensor_cores, self.head_dim, self.q_dtype


def plan_for_batch(batch: BatchInfo, num_qo_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                   sliding_window: int | None, q_dtype: torch.dtype, device: torch.device | str) -> FlashInferPlan:
    """The wrapper and `plan()` arguments for `batch` on `device`: indptrs and indices int32 on the host, pinned
    when `device` is CUDA (plan() reads them there and copies them to the device itself), a tree's custom mask on
    `device`; see the module doc for which wrapper serves which batch. A custom (tree) mask carries the sliding
    window itself, so that plan has no `window_left`: FlashInfer's window counts key slots, while a tree's queries
    sit at depths, not slots."""
    common = dict(sm_scale=scale, q_data_type=q_dtype, kv_data_type=q_dtype)
    window = window_left(sliding_window)
    pin = torch.device(device).type == "cuda"

    def plan(kind: str, args: tuple, use_tensor_cores: bool = False, **kwargs) -> FlashInferPlan:
        return FlashInferPlan(kind, kwargs["window_left"], use_tensor_cores, head_dim, q_dtype, args,
                              {**kwargs, **common})

    if not batch.uses_cache:
        qo_indptr = host_int32(batch.qo_indptr, pin)
        return plan("ragged", (qo_indptr, qo_indptr, num_qo_heads, num_kv_heads, head_dim), causal=True,
                    window_left=window)
    kv_indptr, kv_indices, kv_last_page_len = paged_kv_table(batch, pin)
    if batch.tree_masks is None and min(batch.q_lens) == batch.max_q_len == 1:  # exactly one query per sequence
        return plan("decode", (kv_indptr, kv_indices, kv_last_page_len, num_qo_heads, num_kv_heads, head_dim,
                               batch.page_size),
                    use_tensor_cores=num_qo_heads // num_kv_heads > _TENSOR_CORE_DECODE_GROUP, window_left=window)
    paged_args = (host_int32(batch.qo_indptr, pin), kv_indptr, kv_indices, kv_last_page_len,
                  num_qo_heads, num_kv_heads, head_dim, batch.page_size)
    if batch.tree_masks is not None:
        return plan("tree", paged_args, custom_mask=tree_custom_mask(batch, sliding_window, device), causal=False,
                    window_left=-1)
    return plan("paged", paged_args, causal=True, window_left=window)


class FlashInferAttention(AttentionBackend):
    """FlashInfer's batch attention kernels (see the module doc); a torch backend for the calls they cannot serve.

    One float workspace per instance, shared by its wrappers (they run one after another on the device's stream);
    one wrapper per `FlashInferPlan.wrapper_key`, so that e.g. layers with and without a sliding window do not
    re-plan each other's wrapper. A wrapper is planned again when a layer brings another batch than the one it was
    last planned for (a target and its draft head can share this backend and interleave their batches)."""

    name = "flashinfer"

    def __init__(self):
        self._flashinfer = import_flashinfer()
        self._torch = TorchAttention()
        self._workspace: dict[torch.device, torch.Tensor] = {}
        self._wrappers: dict[tuple, object] = {}
        self._planned: dict[tuple, FlashInferPlan] = {}  # wrapper key -> the plan it was last planned with

    @staticmethod
    def serves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_cache) -> bool:
        """Whether FlashInfer's kernels can compute this call (else it goes to the torch backend): CUDA, fp16/bf16
        throughout, a head_dim of `HEAD_DIMS` for queries, keys and values, no gradients wanted."""
        if q.device.type != "cuda" or q.dtype not in SUPPORTED_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
            return False
        if not head_dim_supported(q.shape[-1]) or k.shape[-1] != q.shape[-1] or v.shape[-1] != q.shape[-1]:
            return False  # the kernels are built for HEAD_DIMS only; another head_dim fails inside them
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            return False  # no backward pass in FlashInfer
        return layer_cache is None or layer_cache[0].dtype == q.dtype

    def _wrapper(self, plan: FlashInferPlan, device: torch.device):
        key = (device, *plan.wrapper_key)
        wrapper = self._wrappers.get(key)
        if wrapper is None:
            workspace = self._workspace.get(device)
            if workspace is None:
                workspace = self._workspace[device] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            flashinfer = self._flashinfer
            if plan.kind == "decode":
                wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    workspace, "NHD", use_tensor_cores=plan.use_tensor_cores)
            elif plan.kind in ("paged", "tree"):
                wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
            else:
                wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")
            self._wrappers[key] = wrapper
        if self._planned.get(key) is not plan:
            wrapper.plan(*plan.args, **plan.kwargs)
            self._planned[key] = plan
        return wrapper

    def attend(self, q, k, v, layer_cache, batch: BatchInfo, scale: float, sliding_window: int | None):
        if not self.serves(q, k, v, layer_cache):
            return self._torch.attend(q, k, v, layer_cache, batch, scale, sliding_window)
        num_heads, num_kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
        key = (self.name, sliding_window, num_heads, num_kv_heads, head_dim, q.dtype, scale, q.device)
        plan = batch._plans.get(key)
        if plan is None:
            plan = batch._plans[key] = plan_for_batch(batch, num_heads, num_kv_heads, head_dim, scale,
                                                      sliding_window, q.dtype, q.device)
        wrapper = self._wrapper(plan, q.device)
        q = q.contiguous()
        if layer_cache is None:
            if batch.kv_dtype is not None and batch.kv_dtype != q.dtype:  # as a cache in that dtype would hold them
                k, v = k.to(batch.kv_dtype).to(q.dtype), v.to(batch.kv_dtype).to(q.dtype)
            return wrapper.run(q, k.contiguous(), v.contiguous())
        k_cache, v_cache = layer_cache
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, batch.slot_mapping, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, batch.slot_mapping, v)
        return wrapper.run(q, (k_cache, v_cache))
