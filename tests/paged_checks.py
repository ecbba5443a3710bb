"""Paged-cache parity checks shared by every model family's runtime tests (tests/test_runtime_parity.py for the Llama
family, tests/test_deepseek_runtime.py for MLA + MoE): `model` is our runtime's model, `sequences` token lists and
`references` transformers' logits of each whole sequence ([len, vocab]); every forward below must reproduce them
within `tol`."""

from __future__ import annotations

import torch

from mtp_train.runtime.attention import BatchInfo
from mtp_train.runtime.kv_cache import PageAllocator, Sequence


def check_decode_token_by_token(model, sequences, references, tol: float) -> None:
    """A 3-token prefill of every sequence, then batched decode: all sequences step together while they have tokens
    left (ragged ends); every page is back on the allocator afterwards."""
    allocator = PageAllocator(32, page_size=4)
    cache = model.new_kv_cache(allocator)
    seqs = [Sequence(i) for i in range(len(sequences))]
    prompt_len = 3
    flat = torch.tensor([t for ids in sequences for t in ids[:prompt_len]])
    model(flat, BatchInfo.for_sequences(seqs, [prompt_len] * len(seqs), allocator), cache)
    for pos in range(prompt_len, max(len(s) for s in sequences)):
        active = [i for i, s in enumerate(sequences) if pos < len(s)]
        batch = BatchInfo.for_sequences([seqs[i] for i in active], [1] * len(active), allocator)
        logits = model(torch.tensor([sequences[i][pos] for i in active]), batch, cache).logits
        for row, i in enumerate(active):
            assert (logits[row] - references[i][pos]).abs().max() <= tol, (i, pos)
    for seq in seqs:
        seq.release(allocator)
    assert allocator.num_free == allocator.num_pages


def check_verify_batch(model, sequences, references, verify_len: int, tol: float) -> None:
    """`verify_len` new tokens for each of two sequences attend to the cached prefix and causally to each other; then
    the rejected tail is truncated and decoding continues correctly from the truncated cache."""
    ids, other = sequences[0], sequences[2]
    allocator = PageAllocator(16, page_size=4)
    cache = model.new_kv_cache(allocator)
    seqs = [Sequence(0), Sequence(1)]
    prefix = 6
    model(torch.tensor(ids[:prefix] + other[:prefix]), BatchInfo.for_sequences(seqs, [prefix, prefix], allocator),
          cache)
    batch = BatchInfo.for_sequences(seqs, [verify_len, verify_len], allocator)
    new = ids[prefix : prefix + verify_len] + other[prefix : prefix + verify_len]
    logits = model(torch.tensor(new), batch, cache).logits
    assert (logits[:verify_len] - references[0][prefix : prefix + verify_len]).abs().max() <= tol
    assert (logits[verify_len:] - references[2][prefix : prefix + verify_len]).abs().max() <= tol
    # Keep only the first accepted token; the next forward must see exactly prefix + 1 tokens.
    seqs[0].truncate(prefix + 1, allocator)
    logits = model(torch.tensor([ids[prefix + 1]]), BatchInfo.for_sequences(seqs[:1], [1], allocator), cache).logits
    assert (logits[0] - references[0][prefix + 1]).abs().max() <= tol


def check_ragged_verify(model, sequences, references, tol: float) -> None:
    """Three sequences bring 3, 1 and 4 new tokens after prefixes of 7, 2 and 5 in one forward."""
    allocator = PageAllocator(32, page_size=4)
    cache = model.new_kv_cache(allocator)
    seqs = [Sequence(i) for i in range(3)]
    prefixes = [7, 2, 5]
    model(torch.tensor([t for s, p in zip(sequences, prefixes) for t in s[:p]]),
          BatchInfo.for_sequences(seqs, prefixes, allocator), cache)
    counts = [3, 1, 4]
    new = [t for s, p, c in zip(sequences, prefixes, counts) for t in s[p : p + c]]
    logits = model(torch.tensor(new), BatchInfo.for_sequences(seqs, counts, allocator), cache).logits
    expected = torch.cat([r[p : p + c] for r, p, c in zip(references, prefixes, counts)])
    assert (logits - expected).abs().max() <= tol
