"""Our runtime on the real SmolLM2-135M-Instruct (fp32) against transformers: logits and greedy generation."""

from __future__ import annotations

import pytest
import torch

from mtp_train.runtime.attention import BatchInfo
from mtp_train.runtime.chat import encode_chat
from mtp_train.runtime.generate import generate
from mtp_train.runtime.kv_cache import PageAllocator, Sequence
from mtp_train.runtime.loader import load_model, load_tokenizer

pytestmark = pytest.mark.real_model

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about autumn leaves.",
    "Explain in two sentences how a hash table works.",
    "List three uses of Python.",
]
TOL = 1e-3


@pytest.fixture(scope="module")
def real(smollm2_dir):
    from transformers import AutoModelForCausalLM

    model = load_model(smollm2_dir, dtype="float32", device="cpu")
    tokenizer = load_tokenizer(smollm2_dir)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    return model, hf, prompts


def test_prefill_decode_verify_logits_match_transformers(real):
    model, hf, prompts = real
    allocator = PageAllocator(64, page_size=16)
    cache = model.new_kv_cache(allocator)
    for i, ids in enumerate(prompts[:3]):
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
        seq = Sequence(i)
        split = len(ids) - 8
        prefill = model(torch.tensor(ids[:split]), BatchInfo.for_sequences([seq], [split], allocator), cache).logits
        assert (prefill - ref[:split]).abs().max() <= TOL
        for pos in range(split, split + 3):  # decode steps
            step = model(torch.tensor([ids[pos]]), BatchInfo.for_sequences([seq], [1], allocator), cache).logits
            assert (step[0] - ref[pos]).abs().max() <= TOL
        verify = model(torch.tensor(ids[split + 3 :]), BatchInfo.for_sequences([seq], [5], allocator), cache).logits
        assert (verify - ref[split + 3 :]).abs().max() <= TOL
        seq.release(allocator)
    assert allocator.num_free == allocator.num_pages


def test_ragged_batch_matches_single(real):
    model, hf, prompts = real
    flat = torch.tensor([t for p in prompts for t in p])
    ragged = model(flat, BatchInfo.without_cache([len(p) for p in prompts])).logits
    offset = 0
    for ids in prompts:
        single = model(torch.tensor(ids), BatchInfo.without_cache([len(ids)])).logits
        assert (ragged[offset : offset + len(ids)] - single).abs().max() <= TOL
        offset += len(ids)


def test_greedy_generate_equals_transformers(real):
    """64 new tokens per prompt, token for token, batched through our runtime (different prompt lengths)."""
    model, hf, prompts = real
    ours, stats = generate(model, prompts, max_new_tokens=64, stop_token_ids=(2,))
    assert stats.new_tokens == sum(len(r.token_ids) for r in ours)
    for ids, result in zip(prompts, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False, eos_token_id=2)
        assert result.token_ids == ref[0, len(ids) :].tolist()
