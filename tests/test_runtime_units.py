"""Page allocator, sampler and loader errors."""

from __future__ import annotations

import json

import pytest
import torch

from mtp_train.errors import UserError
from mtp_train.runtime.kv_cache import OutOfPagesError, PageAllocator, Sequence
from mtp_train.runtime.loader import load_model
from mtp_train.runtime.sampler import SamplingParams, processed_probs, sample
from tests.tiny_models import save_tiny_model


def test_allocator_no_leak_after_free():
    allocator = PageAllocator(10, page_size=4)
    seqs = [Sequence(i) for i in range(3)]
    for seq, n in zip(seqs, (5, 9, 1)):
        seq.reserve(n, allocator)
        seq.num_cached = n
    assert [len(s.pages) for s in seqs] == [2, 3, 1]
    assert allocator.num_free == 4
    assert len({p for s in seqs for p in s.pages}) == 6  # no page handed out twice
    seqs[1].truncate(4, allocator)
    assert len(seqs[1].pages) == 1 and allocator.num_free == 6
    for seq in seqs:
        seq.release(allocator)
    assert allocator.num_free == allocator.num_pages


def test_allocator_out_of_pages_is_clear():
    allocator = PageAllocator(2, page_size=4)
    seq = Sequence(0)
    with pytest.raises(OutOfPagesError, match="out of pages: need 3 more page"):
        seq.reserve(12, allocator)
    assert allocator.num_free == 2  # a failed request takes nothing


def test_double_free_detected():
    allocator = PageAllocator(2, page_size=4)
    pages = allocator.allocate(1)
    allocator.free(pages)
    with pytest.raises(RuntimeError, match="freed twice"):
        allocator.free(pages)


def test_sampler_greedy_topk_topp():
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0]])
    assert sample(logits, SamplingParams()).item() == 1
    probs = processed_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert probs[0, 0] == 0 and probs[0, 3] == 0 and abs(probs.sum() - 1) < 1e-6
    probs = processed_probs(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert probs[0].nonzero().flatten().tolist() == [1]  # the top token alone holds > 50%
    gen = torch.Generator().manual_seed(0)
    draws = sample(logits.expand(4000, -1), SamplingParams(temperature=1.0), gen)
    freq = torch.bincount(draws, minlength=4).float() / 4000
    assert (freq - logits.softmax(-1)[0]).abs().max() < 0.03


def test_sampler_rejects_bad_params():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(temperature=1, top_p=0)


def test_loader_errors(tmp_path):
    with pytest.raises(UserError, match="model directory not found"):
        load_model(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match="config.json: not found"):
        load_model(empty)
    path = save_tiny_model(tmp_path / "tiny")
    config = json.loads((path / "config.json").read_text())
    bad = tmp_path / "gpt2ish"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(UserError, match="model_type 'gpt2' is not supported; supported by our runtime: llama"):
        load_model(bad)
    with pytest.raises(UserError, match="float16 is not available for CPU"):
        load_model(path, dtype="float16", device="cpu")
    no_weights = tmp_path / "noweights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(UserError, match="no \\*.safetensors weights"):
        load_model(no_weights)
    rope = tmp_path / "rope"
    rope.mkdir()
    (rope / "config.json").write_text(
        json.dumps({**config, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}})
    )
    with pytest.raises(UserError, match="dynamic"):
        load_model(rope)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_small_query_attention_equals_sdpa(dtype, tol):
    """The CPU decode/verify path (fp32 matmuls + softmax) against SDPA, with GQA and a causal-plus-padding mask."""
    import torch.nn.functional as F

    from mtp_train.runtime.attention import _small_query_attention

    gen = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, n_q, kv, head_dim = 3, 6, 2, 4, 11, 8
    q = torch.randn(batch, heads, n_q, head_dim, generator=gen).to(dtype)
    k = torch.randn(batch, kv_heads, kv, head_dim, generator=gen).to(dtype)
    v = torch.randn(batch, kv_heads, kv, head_dim, generator=gen).to(dtype)
    kv_lens = [11, 7, 5]
    mask = torch.zeros(batch, 1, n_q, kv, dtype=torch.bool)
    for b, length in enumerate(kv_lens):  # the last n_q keys are the new tokens: causal among themselves
        positions = torch.arange(length - n_q, length)
        mask[b, 0, :, :length] = torch.arange(length)[None, :] <= positions[:, None]
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=0.3,
                                              enable_gqa=True)
    got = _small_query_attention(q, k, v, mask, 0.3)
    assert got.dtype == dtype
    assert torch.allclose(got.float(), expected, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_rows_from_the_cached_table_equal_the_computed_ones(tmp_path, dtype):
    """RotaryEmbedding reads cos/sin rows from a table of positions 0..L-1 grown on demand: bit-identical to computing
    them for the positions asked (`tables`), in any order, across a growth of the table."""
    model = load_model(save_tiny_model(tmp_path, "llama", seed=3), dtype="float32", device="cpu")
    rotary = model.rotary
    for positions in ([0], [3, 1, 2], [255], [256, 7], [1000, 999, 0]):
        ids = torch.tensor(positions)
        got, expected = rotary(ids, dtype), rotary.tables(ids, dtype)
        assert got[0].dtype == dtype and torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert rotary._cache[dtype][0].shape[0] == 1024  # grown to the next power of two
    empty = rotary(torch.zeros(0, dtype=torch.long), dtype)
    assert empty[0].shape == (0, model.config.head_dim)


def test_cpu_facts_name_the_core_generation(tmp_path, monkeypatch):
    """A VM's model name may say only "AMD EPYC": the family/model numbers tell a Zen 3 (AVX2 only) from a Zen 4, and
    every figure's machine line must say which."""
    from mtp_train.runtime import hardware
    from mtp_train.runtime.hardware import CpuFacts, _read_cpuinfo, cpu_generation

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 1\n"
                       "model name\t: AMD EPYC\nflags\t\t: fpu avx2 fma\n\nprocessor\t: 1\ncpu family\t: 99\n")
    model, flags, family, model_number = _read_cpuinfo(str(cpuinfo))
    assert (model, family, model_number) == ("AMD EPYC", 25, 1) and {"avx2", "fma"} <= flags
    assert _read_cpuinfo(str(tmp_path / "missing")) == ("", frozenset(), None, None)

    assert cpu_generation("AMD EPYC", 25, 1) == "Zen 3"
    assert cpu_generation("AMD EPYC", 25, 17) == "Zen 4"
    assert cpu_generation("AMD Ryzen 7 5800X", 25, 0x21) == "Zen 3"
    assert cpu_generation("AMD EPYC 7742", 23, 0x31) == "Zen 2"
    assert cpu_generation("AMD EPYC 9755", 26, 2) == "Zen 5"
    assert cpu_generation("Intel(R) Xeon(R) Platinum 8480+", 6, 143) is None  # numbers reported as they are
    assert cpu_generation("AMD EPYC", None, None) is None

    zen3 = CpuFacts("AMD EPYC", "x86_64", frozenset({"avx2"}), "AVX2", 2, family=25, model_number=1)
    assert zen3.describe() == "AMD EPYC (Zen 3)"
    xeon = CpuFacts("Intel(R) Xeon(R) Platinum 8480+", "x86_64", frozenset(), "AVX512", 2, 6, 143)
    assert xeon.describe() == "Intel(R) Xeon(R) Platinum 8480+ (family 6 model 143)"
    assert CpuFacts("Neoverse", "aarch64").describe() == "Neoverse"

    monkeypatch.setattr(hardware, "_read_cpuinfo", lambda: _read_cpuinfo(str(cpuinfo)))
    hardware.cpu_facts.cache_clear()
    try:
        fields = hardware.machine_fields("float32").split()
        assert {"cpu=AMD_EPYC", "cpu_family=25", "cpu_model=1", "cpu_generation=Zen_3"} <= set(fields)
        assert hardware.machine_name().endswith("(AMD EPYC, Zen 3)")
    finally:
        hardware.cpu_facts.cache_clear()  # the next caller reads this machine's facts again
