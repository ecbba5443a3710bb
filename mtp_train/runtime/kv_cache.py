"""Paged KV cache: fixed-size pages handed out by one allocator, a block table per sequence.

Pages are *ids*; each model owns its own K/V storage indexed by those ids. Target and draft therefore share one
`PageAllocator` and one `Sequence` (block table) per request: position p of a sequence lives in page
`pages[p // page_size]`, slot `p % page_size`, in every model's cache. The layout of a layer's storage,
`[num_pages, page_size, num_kv_heads, head_dim]` for K and V each, is FlashInfer's NHD paged layout.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from mtp_train.errors import UserError


class OutOfPagesError(UserError):
    """The allocator has fewer free pages than a request needs."""


class PageAllocator:
    """Hands out page ids from a free list. Freed pages are reused; `num_free` returns to `num_pages` when idle."""

    def __init__(self, num_pages: int, page_size: int = 16):
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages and page_size must be positive, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        # A stack: the most recently freed page is reused first (warm in cache).
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._allocated = [False] * num_pages
        # model -> {role: its KVCache over these pages}: built once, reused by every call that brings this allocator
        self._caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def cache_for(self, model, role: str) -> "KVCache":
        """`model.new_kv_cache(self)`, built on the first call and returned again to every later one with the same
        model and role, so a caller that decodes batch after batch over one allocator (the eval) allocates its
        caches once instead of per call. `role` ("target", "draft") keeps one model drafting for itself from
        sharing storage with itself. Reused storage needs no clearing: a slot is written before any forward reads
        it. Rebuilt when the model's K/V dtype changed since."""
        dtype = getattr(model, "kv_cache_torch_dtype", None)
        caches = self._caches.setdefault(model, {})
        if role not in caches or caches[role][0] != dtype:
            caches[role] = (dtype, model.new_kv_cache(self))
        return caches[role][1]

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise OutOfPagesError(
                f"KV cache out of pages: need {count} more page(s) of {self.page_size} tokens, "
                f"{len(self._free)} of {self.num_pages} free; raise the cache size (num_pages) or lower the batch "
                "size / max_new_tokens"
            )
        pages = [self._free.pop() for _ in range(count)]
        for page in pages:
            self._allocated[page] = True
        return pages

    def free(self, pages: list[int]) -> None:
        for page in pages:
            if not self._allocated[page]:
                raise RuntimeError(f"page {page} freed twice")
            self._allocated[page] = False
            self._free.append(page)


@dataclass
class Sequence:
    """One request's block table: the pages holding its tokens and how many tokens are cached."""

    seq_id: int
    pages: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose K/V are in the cache (positions 0 .. num_cached-1)

    def reserve(self, num_tokens: int, allocator: PageAllocator) -> None:
        """Make room for positions 0 .. num_tokens-1 (allocating pages as needed)."""
        pages_needed = -(-num_tokens // allocator.page_size)
        if pages_needed > len(self.pages):
            self.pages.extend(allocator.allocate(pages_needed - len(self.pages)))

    def truncate(self, num_tokens: int, allocator: PageAllocator) -> None:
        """Forget cached positions >= num_tokens (e.g. rejected draft tokens) and free pages no longer needed."""
        if num_tokens > self.num_cached:
            raise ValueError(f"cannot truncate sequence {self.seq_id} to {num_tokens} > {self.num_cached} cached")
        self.num_cached = num_tokens
        pages_needed = -(-num_tokens // allocator.page_size)
        if pages_needed < len(self.pages):
            allocator.free(self.pages[pages_needed:])
            del self.pages[pages_needed:]

    def release(self, allocator: PageAllocator) -> None:
        allocator.free(self.pages)
        self.pages = []
        self.num_cached = 0


class KVCache:
    """One model's K/V storage over the pages of an allocator: per layer a (K, V) pair of
    `[num_pages, page_size, num_kv_heads, head_dim]` tensors."""

    def __init__(
        self,
        allocator: PageAllocator,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        self.allocator = allocator
        shape = (allocator.num_pages, allocator.page_size, num_kv_heads, head_dim)
        self.layers = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)
        ]

    @property
    def page_size(self) -> int:
        return self.allocator.page_size

    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)
