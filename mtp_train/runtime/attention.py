"""Batch description for one forward over a ragged batch, and the attention backends.

A forward runs the flat concatenation of every sequence's new tokens (`[num_tokens, ...]`, no padding).
`BatchInfo` says which rows belong to which sequence and where their K/V live, in the shape FlashInfer's paged
wrappers take (`qo_indptr`, `kv_page_indptr`, `kv_page_indices`, `kv_last_page_len`), so a FlashInfer backend can
`plan()` from the same object. One batch kind covers the three uses:

- prefill: each sequence brings its whole prompt (n_b tokens, nothing cached yet);
- decode:  each sequence brings 1 token and attends to its cached prefix;
- verify:  each sequence brings k tokens that attend to the cached prefix and causally to each other;
- tree:    each sequence brings the nodes of a draft tree (`for_tree`): they attend to the cached prefix and, among
           the newest cached entries (the tree region), only to their ancestors and themselves (`tree_masks`); their
           rotary positions follow their depth, not their slot.

Without a cache (`kv_cache=None`, e.g. feature precompute) every sequence attends only to its own new tokens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from mtp_train.errors import UserError
from mtp_train.runtime.host_sync import host_tensor_to_device, to_device
from mtp_train.runtime.kv_cache import PageAllocator, Sequence

log = logging.getLogger(__name__)


@dataclass
class BatchInfo:
    positions: torch.Tensor  # [num_tokens] int64: position of each new token in its sequence
    q_lens: list[int]  # new tokens per sequence
    kv_lens: list[int]  # attended length per sequence after this forward (cached + new)
    qo_indptr: torch.Tensor  # [batch + 1] int32: sequence b owns rows qo_indptr[b]:qo_indptr[b+1]
    page_size: int = 0
    kv_page_indptr: torch.Tensor | None = None  # [batch + 1] int32
    kv_page_indices: torch.Tensor | None = None  # [total pages] int32
    kv_last_page_len: torch.Tensor | None = None  # [batch] int32
    slot_mapping: torch.Tensor | None = None  # [num_tokens] int64: flat cache slot each new K/V is written to
    # Tree batches only: per sequence [q_len_b, W_b] bool over its last W_b keys (the tree region, new tokens last):
    # True = attend. Keys before the region are the causal prefix every new token sees.
    tree_masks: list[torch.Tensor] | None = None
    # Without a cache: the dtype keys and values are rounded to before they are attended, as a paged cache in that
    # dtype holds them for decode (None: as computed; the torch attention honours it). Precompute sets it so that the
    # stored hidden states are those a decode over a bf16 K/V cache computes (`features/precompute.py`); never for a
    # DeepSeek target, whose latent cache keeps the model's dtype.
    kv_dtype: torch.dtype | None = None
    # With a cache: per sequence the pages its keys are read from (`kv_page_indices` split by `kv_page_indptr`, kept
    # as host lists so that the attention plans without reading a tensor back).
    kv_page_table: list[list[int]] | None = None
    _plans: dict = field(default_factory=dict, repr=False)  # per-backend precomputation, shared by all layers

    @property
    def batch_size(self) -> int:
        return len(self.q_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def max_q_len(self) -> int:
        """The most new tokens any sequence brings (decode 1, verify k + 1, prefill its prompt)."""
        if "max_q_len" not in self._plans:  # asked by every layer of a forward: computed once
            self._plans["max_q_len"] = max(self.q_lens, default=0)
        return self._plans["max_q_len"]

    @property
    def uses_cache(self) -> bool:
        return self.slot_mapping is not None

    def last_token_indices(self) -> torch.Tensor:
        """[batch] int64 on the batch's device: row of each sequence's last new token (where next-token logits are
        read); built from the host's lengths, copied without waiting for the device."""
        rows, end = [], 0
        for count in self.q_lens:
            end += count
            rows.append(end - 1)
        return to_device(rows, torch.long, self.positions.device)

    @staticmethod
    def without_cache(lengths: list[int], device: torch.device | str = "cpu",
                      kv_dtype: torch.dtype | None = None) -> "BatchInfo":
        """Prefill of whole sequences that attend only to themselves (nothing read from or written to a cache);
        `kv_dtype`: keys and values rounded to it before they are attended (see the field)."""
        positions = torch.cat([torch.arange(n) for n in lengths]) if lengths else torch.zeros(0, dtype=torch.long)
        qo_indptr = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        return BatchInfo(positions=positions.to(device), q_lens=list(lengths), kv_lens=list(lengths), qo_indptr=qo_indptr,
                         kv_dtype=kv_dtype)

    @staticmethod
    def for_sequences(
        sequences: list[Sequence],
        new_token_counts: list[int],
        allocator: PageAllocator,
        device: torch.device | str = "cpu",
        advance: bool = True,
        reserve_ahead: int = 0,
    ) -> "BatchInfo":
        """Append `new_token_counts[b]` tokens to each sequence: reserves pages, and (if `advance`) counts the new
        tokens as cached. Use `Sequence.truncate` afterwards to drop rejected tokens. `reserve_ahead`: also reserve
        the pages of that many positions after the new tokens; the page table (`kv_page_*`, `kv_last_page_len`) then
        describes end + reserve_ahead positions, `kv_lens` the attended ones — for forwards that run further steps in
        the same kernel call (a head's greedy draft chain, `mtp_head_chain`); not a batch for FlashInfer's plan."""
        # Built in Python lists, one tensor per field: a decode step calls this once per forward (the target's, and
        # a draft head's), and per-sequence tensor ops cost more than the few numbers they compute.
        # The device fields (positions, slot_mapping) are copied without waiting for the device (`to_device`), so
        # this runs while the previous forward is still on the device.
        page_size = allocator.page_size
        positions, slots, qo_indptr, page_indptr, page_indices, last_page_len, kv_lens = [], [], [0], [0], [], [], []
        page_table = []
        for seq, count in zip(sequences, new_token_counts, strict=True):
            start = seq.num_cached
            end = start + count
            seq.reserve(end + reserve_ahead, allocator)
            pages = seq.pages
            positions.extend(range(start, end))
            slots.extend(pages[p // page_size] * page_size + p % page_size for p in range(start, end))
            used_pages = -(-(end + reserve_ahead) // page_size)
            page_table.append(pages[:used_pages])
            page_indices.extend(page_table[-1])
            qo_indptr.append(qo_indptr[-1] + count)
            page_indptr.append(page_indptr[-1] + used_pages)
            last_page_len.append(end + reserve_ahead - (used_pages - 1) * page_size)
            kv_lens.append(end)
            if advance:
                seq.num_cached = end
        return BatchInfo(
            positions=to_device(positions, torch.long, device),
            q_lens=list(new_token_counts),
            kv_lens=kv_lens,
            qo_indptr=torch.tensor(qo_indptr, dtype=torch.int32),
            page_size=page_size,
            kv_page_indptr=torch.tensor(page_indptr, dtype=torch.int32),
            kv_page_indices=torch.tensor(page_indices, dtype=torch.int32),
            kv_last_page_len=torch.tensor(last_page_len, dtype=torch.int32),
            slot_mapping=to_device(slots, torch.long, device),
            kv_page_table=page_table,
        )


    @staticmethod
    def for_tree(
        sequences: list[Sequence],
        positions: list[list[int]],
        tree_masks: list[torch.Tensor],
        allocator: PageAllocator,
        device: torch.device | str = "cpu",
    ) -> "BatchInfo":
        """Append the nodes of a draft tree to each sequence (slots num_cached.., counted as cached): sequence b
        brings len(positions[b]) tokens whose rotary positions are `positions[b]` (prefix length + depth) and whose
        attention over the sequence's last W_b keys (earlier tree nodes, then these) is `tree_masks[b]` [n_b, W_b]
        bool; every key before those W_b is visible. Rewind (and compact) afterwards to keep only the accepted path."""
        counts = [len(p) for p in positions]
        for b, (seq, mask) in enumerate(zip(sequences, tree_masks, strict=True)):
            width = int(mask.shape[1])
            if mask.shape[0] != counts[b] or not counts[b] <= width <= seq.num_cached + counts[b]:
                raise ValueError(f"sequence {b}: tree mask of shape {tuple(mask.shape)} for {counts[b]} new tokens "
                                 f"after {seq.num_cached} cached")
        batch = BatchInfo.for_sequences(sequences, counts, allocator, device)
        batch.positions = to_device([p for ps in positions for p in ps], torch.long, device)
        # every sequence's mask in one copy that does not wait for the device
        flat = host_tensor_to_device(torch.cat([mask.reshape(-1).to(torch.bool) for mask in tree_masks]), device)
        batch.tree_masks = [block.view(mask.shape) for block, mask in
                            zip(flat.split([mask.numel() for mask in tree_masks]), tree_masks)]
        return batch


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[n, n] bool: row i is True at i and at each of its ancestors (`parents[i]` < i, -1 for a root)."""
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            if parent >= i:
                raise ValueError(f"tree node {i} has parent {parent}: parents must come before their children")
            mask[i] |= mask[parent]
    return mask


class AttentionBackend:
    """Computes attention for one layer. `q: [num_tokens, heads, head_dim]`, `k, v: [num_tokens, kv_heads,
    head_dim]`, `layer_cache`: that layer's (K, V) page storage or None. Returns `[num_tokens, heads, head_dim]`."""

    name = "base"

    def attend(self, q, k, v, layer_cache, batch: BatchInfo, scale: float, sliding_window: int | None):
        raise NotImplementedError


def _allowed_mask(
    q_positions: torch.Tensor, kv_len: int, sliding_window: int | None, key_positions: torch.Tensor | None = None
) -> torch.Tensor:
    """[n_q, kv_len] bool: causal (key position <= query position), optionally within a sliding window. Cached keys
    sit at positions 0..kv_len-1; without a cache the keys are the new tokens themselves (`key_positions`)."""
    if key_positions is None:
        key_positions = torch.arange(kv_len, device=q_positions.device)
    allowed = key_positions[None, :] <= q_positions[:, None]
    if sliding_window is not None:
        allowed &= key_positions[None, :] > q_positions[:, None] - sliding_window
    return allowed


def _tree_allowed_mask(
    q_positions: torch.Tensor, kv_len: int, tree_mask: torch.Tensor, sliding_window: int | None
) -> torch.Tensor:
    """[n_q, kv_len] bool for a tree batch's sequence: the prefix keys (positions 0..kv_len-W-1) causally, within the
    sliding window; the tree region (the last W keys) as `tree_mask` [n_q, W] says (a tree is a few tokens deep, well
    inside any window)."""
    width = int(tree_mask.shape[1])
    prefix = _allowed_mask(q_positions, kv_len - width, sliding_window)
    return torch.cat([prefix, tree_mask], dim=1)  # tree_mask is on the batch's device (`BatchInfo.for_tree`)


_SMALL_QUERY = 8  # decode and verify batches: at most this many new tokens per sequence


def _small_query_attention(
    q: torch.Tensor,  # [batch, heads, n_q, head_dim]
    k: torch.Tensor,  # [batch, kv_heads, kv, head_dim]
    v: torch.Tensor,  # [batch, kv_heads, kv, head_dim]
    mask: torch.Tensor,  # [batch, 1, n_q, kv] bool: True = attend
    scale: float,
) -> torch.Tensor:
    """Masked attention for a few queries per sequence as two batched matmuls in fp32 (scores and softmax in fp32,
    like SDPA's accumulation). On CPU, SDPA's flash kernel parallelizes over queries, which makes it slower than
    this for padded decode batches of one or a few queries (figures in docs/benchmarks.md)."""
    batch, heads, n_q, head_dim = q.shape
    kv_heads, kv = k.shape[1], k.shape[2]
    group = heads // kv_heads  # query heads per KV head (GQA)
    q_grouped = q.reshape(batch, kv_heads, group * n_q, head_dim).float()  # heads of a group are adjacent
    scores = torch.matmul(q_grouped, k.float().transpose(-1, -2)).mul_(scale)  # [batch, kv_heads, group*n_q, kv]
    scores = scores.view(batch, kv_heads, group, n_q, kv).masked_fill_(~mask.view(batch, 1, 1, n_q, kv), float("-inf"))
    probs = scores.softmax(-1).view(batch, kv_heads, group * n_q, kv)
    return torch.matmul(probs, v.float()).view(batch, heads, n_q, head_dim).to(q.dtype)


class TorchAttention(AttentionBackend):
    """Pure-torch paged attention (CPU and CUDA) on `scaled_dot_product_attention`.

    With a cache, new K/V are scattered into their slots, then each sequence's keys are gathered from its pages.
    Batches whose sequences all bring the same number of tokens (decode, verify) run as one padded SDPA call;
    ragged prefills run one call per sequence, so no compute is spent on padding.
    """

    name = "torch"

    def _plan(self, batch: BatchInfo, sliding_window: int | None, device) -> dict:
        """What every layer of a forward shares: each sequence's rows, where its keys are read from (a slice of the
        flat cache where its pages follow each other, else a slot index) and its mask; for a uniform batch the padded
        slots [batch, max_kv] and mask [batch, 1, n_q, max_kv]. Built from the batch's host lists; what goes to the
        device is copied without waiting for it (`to_device`), one tensor per field."""
        key = (self.name, sliding_window)
        if key in batch._plans:
            return batch._plans[key]
        plan: dict = {}
        rows, end = [], 0
        for count in batch.q_lens:
            rows.append((end, end + count))
            end += count
        plan["rows"] = rows
        uniform = len(set(batch.q_lens)) == 1 and batch.batch_size > 1 and batch.uses_cache
        plan["uniform"] = uniform
        page_table = batch.kv_page_table
        if batch.uses_cache and page_table is None:  # a batch built by hand: its page table read back once
            page_indptr, page_indices = batch.kv_page_indptr.tolist(), batch.kv_page_indices.tolist()
            page_table = [page_indices[page_indptr[b]:page_indptr[b + 1]] for b in range(batch.batch_size)]
        page_size = batch.page_size
        if batch.uses_cache:
            kv_slots = []
            for pages, kv_len in zip(page_table, batch.kv_lens):
                pages = pages[: -(-kv_len // page_size)]
                # Pages that follow each other in the pool (the usual case for a request allocated step by step)
                # are read as one slice, a view; otherwise the slots are gathered (index_select, faster than
                # advanced indexing on CPU).
                if all(b == a + 1 for a, b in zip(pages, pages[1:])):
                    first = pages[0] * page_size if pages else 0
                    kv_slots.append(slice(first, first + kv_len))
                else:
                    slots = [page * page_size + i for page in pages for i in range(page_size)][:kv_len]
                    kv_slots.append(to_device(slots, torch.long, device))
            plan["kv_slots"] = kv_slots
        if uniform:
            n_q, max_kv = batch.q_lens[0], max(batch.kv_lens)
            max_pages = -(-max_kv // page_size)
            padded_pages = [pages[:max_pages] + [0] * (max_pages - len(pages[:max_pages])) for pages in page_table]
            pages_t = to_device(padded_pages, torch.long, device)  # [batch, max_pages]
            offsets = torch.arange(page_size, device=device)
            padded_slots = (pages_t[:, :, None] * page_size + offsets).view(batch.batch_size, -1)[:, :max_kv]
            q_positions = batch.positions.view(batch.batch_size, n_q)  # [batch, n_q]
            if batch.tree_masks is None:
                # Causal on the positions: a query at position p < kv_len sees keys 0..p, never the padding.
                key_positions = torch.arange(max_kv, device=device)
                mask = key_positions[None, None, :] <= q_positions[:, :, None]  # [batch, n_q, max_kv]
                if sliding_window is not None:
                    mask &= key_positions[None, None, :] > q_positions[:, :, None] - sliding_window
                mask = mask[:, None]
            else:
                mask = torch.zeros(batch.batch_size, 1, n_q, max_kv, dtype=torch.bool, device=device)
                for b in range(batch.batch_size):
                    kv_len = batch.kv_lens[b]
                    mask[b, 0, :, :kv_len] = _tree_allowed_mask(q_positions[b], kv_len, batch.tree_masks[b],
                                                                 sliding_window)
            plan["padded_slots"], plan["padded_mask"] = padded_slots.contiguous(), mask
        else:
            masks = []
            for b, (start, end) in enumerate(rows):
                q_positions = batch.positions[start:end]
                kv_len = batch.kv_lens[b]
                n_q = end - start
                plain_causal = sliding_window is None or kv_len <= sliding_window
                if batch.tree_masks is not None:
                    masks.append(_tree_allowed_mask(q_positions, kv_len, batch.tree_masks[b], sliding_window))
                elif n_q == 1 and plain_causal:
                    masks.append(None)  # one query sees every cached key
                elif n_q == kv_len and plain_causal:
                    masks.append("causal")
                else:
                    key_positions = None if batch.uses_cache else q_positions
                    masks.append(_allowed_mask(q_positions, kv_len, sliding_window, key_positions))
            plan["masks"] = masks
        batch._plans[key] = plan
        return plan

    def attend(self, q, k, v, layer_cache, batch: BatchInfo, scale: float, sliding_window: int | None):
        plan = self._plan(batch, sliding_window, q.device)
        num_heads, num_kv_heads = q.shape[1], k.shape[1]
        gqa = num_heads != num_kv_heads
        if layer_cache is not None:
            k_cache, v_cache = layer_cache
            k_flat = k_cache.view(-1, *k_cache.shape[2:])  # [num_pages * page_size, kv_heads, head_dim]
            v_flat = v_cache.view(-1, *v_cache.shape[2:])
            k_flat.index_copy_(0, batch.slot_mapping, k.to(k_flat.dtype))
            v_flat.index_copy_(0, batch.slot_mapping, v.to(v_flat.dtype))
        if plan["uniform"]:
            n_q = batch.q_lens[0]
            q_b = q.view(batch.batch_size, n_q, num_heads, -1).transpose(1, 2)  # [batch, heads, n_q, head_dim]
            padded = plan["padded_slots"]
            k_b = k_flat.index_select(0, padded.view(-1)).view(*padded.shape, *k_flat.shape[1:]).transpose(1, 2)
            v_b = v_flat.index_select(0, padded.view(-1)).view(*padded.shape, *v_flat.shape[1:]).transpose(1, 2)
            # k_b, v_b: [batch, kv_heads, max_kv, head_dim]
            if q.device.type == "cpu" and n_q <= _SMALL_QUERY:
                out = _small_query_attention(q_b, k_b, v_b, plan["padded_mask"], scale)
            else:
                k_b, v_b = k_b.to(q.dtype), v_b.to(q.dtype)  # a cache in another dtype (bf16 K/V, fp32 queries)
                out = F.scaled_dot_product_attention(
                    q_b, k_b, v_b, attn_mask=plan["padded_mask"], scale=scale, enable_gqa=gqa
                )
            return out.transpose(1, 2).reshape(q.shape)
        outputs = []
        for b, (start, end) in enumerate(plan["rows"]):
            q_b = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, heads, n_q, head_dim]
            if layer_cache is not None and batch.kv_lens[b] == end - start:
                # a prefill of the whole sequence: its own fresh K/V are its whole history, read as the cache holds
                # them (rounded where the cache is narrower, e.g. bf16 K/V), so that the prompt's states are those
                # decode steps over the same cache compute
                k_b, v_b = k[start:end].to(k_flat.dtype), v[start:end].to(v_flat.dtype)
            elif layer_cache is not None:
                slots = plan["kv_slots"][b]
                if isinstance(slots, slice):
                    k_b, v_b = k_flat[slots], v_flat[slots]  # [kv_len, kv_heads, head_dim], views
                else:
                    k_b, v_b = k_flat.index_select(0, slots), v_flat.index_select(0, slots)
            else:
                k_b, v_b = k[start:end], v[start:end]
                if batch.kv_dtype is not None:  # as a cache in that dtype would hold them
                    k_b, v_b = k_b.to(batch.kv_dtype), v_b.to(batch.kv_dtype)
            k_b = k_b.to(q.dtype).transpose(0, 1).unsqueeze(0)  # a cache may hold another dtype (bf16 K/V)
            v_b = v_b.to(q.dtype).transpose(0, 1).unsqueeze(0)
            mask = plan["masks"][b]
            if isinstance(mask, str):
                out = F.scaled_dot_product_attention(q_b, k_b, v_b, is_causal=True, scale=scale, enable_gqa=gqa)
            else:
                out = F.scaled_dot_product_attention(q_b, k_b, v_b, attn_mask=mask, scale=scale, enable_gqa=gqa)
            outputs.append(out[0].transpose(0, 1))
        return torch.cat(outputs, dim=0) if len(outputs) > 1 else outputs[0]


BACKEND_NAMES = ("auto", "torch", "flashinfer")


def get_backend(name: str = "auto", device: torch.device | str = "cpu",
                dtype: torch.dtype | None = None, head_dim: int | None = None) -> AttentionBackend:
    """The attention backend `name` (`target.attention`) for a model on `device` whose weights are in `dtype` and
    whose attention heads are `head_dim` wide.

    `torch` runs everywhere. `flashinfer` (runtime/flashinfer_attention.py) needs CUDA, fp16/bf16, a head_dim its
    kernels are built for (64, 128, 256) and the optional flashinfer-python package: asked for without them it is a
    UserError saying what is missing. `auto` picks flashinfer on CUDA with an fp16/bf16 `dtype` and such a head_dim
    when the package imports, else torch (also when `dtype` is not given, e.g. for training, which needs torch's
    backward pass). `head_dim` None: not checked here (the backend still sends calls of another head_dim to torch)."""
    if name not in BACKEND_NAMES:
        raise UserError(f"target.attention: unknown attention backend {name!r}; choose one of "
                        f"{', '.join(BACKEND_NAMES)}")
    if name == "torch":
        return TorchAttention()
    on_cuda = torch.device(device).type == "cuda"
    half = dtype in (torch.float16, torch.bfloat16)
    if name == "auto":
        if not (on_cuda and half):
            return TorchAttention()
        from mtp_train.runtime.flashinfer_attention import (
            HEAD_DIMS,
            FlashInferAttention,
            flashinfer_available,
            head_dim_supported,
        )

        if head_dim is not None and not head_dim_supported(head_dim):
            log.info("target.attention auto: attending with torch: FlashInfer's kernels take head_dim %s, the "
                     "model's is %d", ", ".join(map(str, HEAD_DIMS)), head_dim)
            return TorchAttention()
        return FlashInferAttention() if flashinfer_available() else TorchAttention()
    if not on_cuda:
        raise UserError(f"target.attention: flashinfer (FlashInfer's kernels, the optional extra mtp_train[gpu]) "
                        f"runs on CUDA GPUs only, the target is on {device}; use target.attention: torch (or auto) "
                        "on this machine")
    if dtype is not None and not half:
        raise UserError(f"target.attention: flashinfer computes in float16/bfloat16, the target's weights are {dtype}; "
                        "set precision.compute bfloat16 (or float16), or target.attention: torch")
    from mtp_train.runtime.flashinfer_attention import HEAD_DIMS, FlashInferAttention, head_dim_supported

    if head_dim is not None and not head_dim_supported(head_dim):
        raise UserError(f"target.attention: flashinfer's kernels take head_dim {', '.join(map(str, HEAD_DIMS))}; this "
                        f"model's attention heads are {head_dim} wide; use target.attention: torch (or auto, which "
                        "picks torch for it)")
    return FlashInferAttention()
