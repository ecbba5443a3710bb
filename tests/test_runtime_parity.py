"""Logits parity of our runtime with transformers (fp32) on tiny random models of every supported architecture:
prefill, token-by-token decode through the paged cache, verify batches, ragged batches vs one sequence at a time.
Each runs twice: through the model's own torch path, and with the CPU decode kernels serving the few-row forwards
(`runtime/cpu_decode.py`, fp32 weights: the kernels' own error, without a bf16 copy's)."""

from __future__ import annotations

import pytest
import torch

from mtp_train.runtime.attention import BatchInfo
from mtp_train.runtime.cpu_decode import KERNEL_MAX_ROWS
from mtp_train.runtime.decode_runner import KernelDecoderLayer, apply_decode_path
from mtp_train.runtime.kernels import cpu_kernels
from mtp_train.runtime.kv_cache import PageAllocator, Sequence
from mtp_train.runtime.loader import load_model
from tests.paged_checks import check_decode_token_by_token, check_ragged_verify, check_verify_batch
from tests.tiny_models import save_tiny_model

pytestmark = pytest.mark.cpu_paths  # its expectations depend on the CPU: rerun as other kinds (tests/test_cpu_kinds.py)

TOL = 1e-4

ARCHS = {
    "llama": dict(model_type="llama"),
    "llama-tied": dict(model_type="llama", tie_word_embeddings=True),
    "llama3-rope": dict(
        model_type="llama",
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "llama-bias": dict(model_type="llama", attention_bias=True, mlp_bias=True),
    "mistral-window": dict(model_type="mistral", sliding_window=7),
    "qwen2": dict(model_type="qwen2"),
    "qwen3": dict(model_type="qwen3", head_dim=24),
}


def hf_logits(hf_dir, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module", params=[(name, path) for name in ARCHS for path in ("torch", "kernels")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def arch(request, tmp_path_factory):
    name, path_kind = request.param
    overrides = dict(ARCHS[name])
    model_type = overrides.pop("model_type")
    path = save_tiny_model(tmp_path_factory.mktemp(name), model_type, seed=len(name), **overrides)
    model = load_model(path, dtype="float32", device="cpu")
    if path_kind == "kernels":
        assert cpu_kernels() is not None, "the CPU decode kernels did not build (g++ and ninja are needed)"
        apply_decode_path(model, torch.float32, KERNEL_MAX_ROWS)
        assert all(isinstance(layer, KernelDecoderLayer) for layer in model.model.layers)
    gen = torch.Generator().manual_seed(1)
    sequences = [torch.randint(2, 96, (n,), generator=gen).tolist() for n in (19, 5, 12)]
    references = [hf_logits(path, ids) for ids in sequences]
    return model, sequences, references


def test_prefill_without_cache(arch):
    model, sequences, references = arch
    for ids, ref in zip(sequences, references):
        out = model(torch.tensor(ids), BatchInfo.without_cache([len(ids)]))
        assert (out.logits - ref).abs().max() <= TOL


def test_ragged_prefill_matches_single_sequences(arch):
    model, sequences, references = arch
    flat = torch.tensor([t for ids in sequences for t in ids])
    ragged = model(flat, BatchInfo.without_cache([len(s) for s in sequences])).logits
    allocator = PageAllocator(32, page_size=4)
    cache = model.new_kv_cache(allocator)
    seqs = [Sequence(i) for i in range(len(sequences))]
    paged = model(flat, BatchInfo.for_sequences(seqs, [len(s) for s in sequences], allocator), cache).logits
    assert (ragged - torch.cat(references)).abs().max() <= TOL
    assert (paged - torch.cat(references)).abs().max() <= TOL


def test_decode_token_by_token_through_paged_cache(arch):
    model, sequences, references = arch
    check_decode_token_by_token(model, sequences, references, TOL)


@pytest.mark.parametrize("verify_len", [1, 2, 3, 4, 5])
def test_verify_batches(arch, verify_len):
    model, sequences, references = arch
    check_verify_batch(model, sequences, references, verify_len, TOL)


def test_ragged_verify_mixed_lengths(arch):
    model, sequences, references = arch
    check_ragged_verify(model, sequences, references, TOL)


def test_hidden_states_and_aux_layers(arch):
    from transformers import AutoModelForCausalLM

    model, sequences, _ = arch
    ids = sequences[0]
    out = model(torch.tensor(ids), BatchInfo.without_cache([len(ids)]), return_hidden=True, aux_layers=(0,))
    hf = AutoModelForCausalLM.from_pretrained(
        model.config.hf_config._name_or_path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        hf_out = hf(torch.tensor([ids]), output_hidden_states=True)
    # HF: hidden_states[0] = embeddings, [j+1] = output of layer j, [-1] = final output after the norm.
    assert (out.hidden - hf_out.hidden_states[-1][0]).abs().max() <= TOL
    assert (out.aux_hidden[0] - hf_out.hidden_states[1][0]).abs().max() <= TOL


@pytest.mark.parametrize("batch_size", [8, 32])
def test_batched_decode_and_verify_with_ragged_lengths(arch, batch_size):
    """Serving-size batches: `batch_size` sequences of different lengths prefilled together, two decode steps and a
    verify of 3 tokens for all of them in one forward each (on the kernels path, 32 rows and more are the many-row
    path: GEMMs on the fp32 weights, attention over the pages in place), then a ragged step after a truncation; every
    row within TOL of transformers."""
    from transformers import AutoModelForCausalLM

    model, _, _ = arch
    gen = torch.Generator().manual_seed(batch_size)
    lengths = torch.randint(8, 30, (batch_size,), generator=gen).tolist()
    sequences = [torch.randint(2, 96, (n,), generator=gen).tolist() for n in lengths]
    hf = AutoModelForCausalLM.from_pretrained(
        model.config.hf_config._name_or_path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        references = [hf(torch.tensor([ids])).logits[0].float() for ids in sequences]
    allocator = PageAllocator(sum(-(-n // 4) for n in lengths) + batch_size, page_size=4)
    cache = model.new_kv_cache(allocator)
    seqs = [Sequence(i) for i in range(batch_size)]
    prompt_lens = [n - 7 for n in lengths]  # 7 more tokens: 1 + 1 + 3 verified (1 or 2 kept) + up to 3
    model(torch.tensor([t for ids, p in zip(sequences, prompt_lens) for t in ids[:p]]),
          BatchInfo.for_sequences(seqs, prompt_lens, allocator), cache)
    done = list(prompt_lens)

    def step(counts: list[int]) -> None:
        new = [t for ids, d, c in zip(sequences, done, counts) for t in ids[d : d + c]]
        logits = model(torch.tensor(new), BatchInfo.for_sequences(seqs, counts, allocator), cache).logits
        expected = torch.cat([ref[d : d + c] for ref, d, c in zip(references, done, counts)])
        assert (logits - expected).abs().max() <= TOL, counts
        for b, c in enumerate(counts):
            done[b] += c

    step([1] * batch_size)
    step([1] * batch_size)
    step([3] * batch_size)  # a verify of 3 tokens per sequence
    for b, seq in enumerate(seqs):  # keep 1 or 2 of the 3 verified tokens, as after rejections
        keep = 1 + b % 2
        seq.truncate(seq.num_cached - 3 + keep, allocator)
        done[b] -= 3 - keep
    step([1 + b % 3 for b in range(batch_size)])  # ragged: 1, 2 or 3 tokens per sequence
    for seq in seqs:
        seq.release(allocator)
    assert allocator.num_free == allocator.num_pages
