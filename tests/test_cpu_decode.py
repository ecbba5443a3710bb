"""The CPU decode kernels (`runtime/csrc/cpu_kernels.cpp`) and the decode path built on them (`runtime/cpu_decode.py`,
`runtime/decode_runner.py`):
each kernel against torch, verify rows bit-identical to decode steps, greedy speculative output identical to plain
greedy with a head served by the kernels, bf16 decode weights within bf16 rounding, and the fallback without kernels.
(Logits parity with transformers through the kernels on every architecture: tests/test_runtime_parity.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mtp_train.heads import DraftHead, HeadConfig
from mtp_train.runtime import kernels
from mtp_train.runtime.attention import BatchInfo
from mtp_train.runtime.cpu_decode import KERNEL_MAX_ROWS, SmallRowLinear, pack_gate_up
from mtp_train.runtime.decode_runner import DecodeLinear, HeadRunner, apply_decode_path, head_runner
from mtp_train.runtime.kv_cache import PageAllocator, Sequence
from mtp_train.runtime.loader import load_model
from tests.spec_helpers import make_prompts, node_path, run_and_compare
from tests.tiny_models import save_tiny_model

pytestmark = pytest.mark.cpu_paths  # its expectations depend on the CPU: rerun as other kinds (tests/test_cpu_kinds.py)


@pytest.fixture(scope="module")
def ops():
    ops = kernels.cpu_kernels()
    assert ops is not None, f"the CPU decode kernels did not build: {kernels.unavailable_reason()}"
    return ops


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 16])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features", [64, 576, 77])  # 77: columns past the last multiple of 8
def test_linear_matches_torch(ops, rows, weight_dtype, in_features):
    gen = torch.Generator().manual_seed(rows * in_features)
    x = torch.randn(rows, in_features, generator=gen)
    weight = torch.randn(200, in_features, generator=gen).to(weight_dtype)
    bias, residual = torch.randn(200, generator=gen), torch.randn(rows, 200, generator=gen)
    if weight_dtype == torch.bfloat16 and ops.bf16_activations():
        x_met = x.bfloat16()  # the AVX512-BF16 build: bf16 weights meet bf16-rounded activations (vdpbf16ps)
    else:
        x_met = x
    reference = F.linear(x_met.double(), weight.double())  # fp32 accumulation vs an fp64 reference
    tol = dict(rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(ops.linear(x, weight, None, None), reference.float(), **tol)
    torch.testing.assert_close(ops.linear(x, weight, bias, residual), (reference + bias + residual).float(), **tol)


@pytest.mark.parametrize("rows", [1, 3, 8, 11])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_silu_mul_matches_torch(ops, rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 64, generator=gen)
    gate, up = torch.randn(40, 64, generator=gen).bfloat16(), torch.randn(40, 64, generator=gen).bfloat16()
    gate_bias, up_bias = torch.randn(40, generator=gen), torch.randn(40, generator=gen)
    bias = torch.stack((gate_bias, up_bias), dim=1).contiguous() if with_bias else None
    x_met = x.bfloat16().float() if ops.bf16_activations() else x  # see test_linear_matches_torch
    expected = F.silu(F.linear(x_met, gate.float(), gate_bias if with_bias else None)) * F.linear(
        x_met, up.float(), up_bias if with_bias else None)
    torch.testing.assert_close(ops.linear_silu_mul(x, pack_gate_up(gate, up).contiguous(), bias), expected,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 8, 11])
@pytest.mark.parametrize("in_features", [64, 576, 77])
def test_int8_weights_compute_the_dequantized_linear(ops, rows, in_features):
    """Weight-only int8 (`quantize_rows`: one scale per output row): the kernel's product is the fp32 product with the
    dequantized weight (the activations stay fp32), for the plain linear and for packed gate/up with SiLU."""
    from mtp_train.runtime.cpu_decode import quantize_rows

    gen = torch.Generator().manual_seed(rows + in_features)
    x = torch.randn(rows, in_features, generator=gen)
    weight, bias = torch.randn(200, in_features, generator=gen), torch.randn(200, generator=gen)
    residual = torch.randn(rows, 200, generator=gen)
    quantized, scale = quantize_rows(weight)
    assert quantized.dtype == torch.int8 and scale.shape == (200,)
    dequantized = quantized.double() * scale.double()[:, None]
    assert (dequantized - weight.double()).abs().max() <= 0.5 * scale.max() + 1e-7  # round to nearest
    expected = F.linear(x.double(), dequantized) + bias + residual
    torch.testing.assert_close(ops.linear(x, quantized, bias, residual, scale), expected.float(), rtol=1e-5, atol=1e-4)
    if in_features % 8 == 0:
        gate, up = torch.randn(40, in_features, generator=gen), torch.randn(40, in_features, generator=gen)
        (gate_q, gate_scale), (up_q, up_scale) = quantize_rows(gate), quantize_rows(up)
        expected = F.silu(F.linear(x.double(), gate_q.double() * gate_scale.double()[:, None])) * F.linear(
            x.double(), up_q.double() * up_scale.double()[:, None])
        got = ops.linear_silu_mul(x, pack_gate_up(gate_q, up_q).contiguous(), None,
                                  torch.stack((gate_scale, up_scale), dim=1).contiguous())
        # fp32 sums of `in_features` products, then a product of two of them: the rounding scales with the outputs'
        # size (the AVX2 build sums a gate/up pair in one chain per dot product: 1.7e-4 off outputs up to ~2,700)
        torch.testing.assert_close(got, expected.float(), rtol=1e-5, atol=1e-6 * expected.abs().max().item())


def test_rms_norm_matches_transformers_formula(ops):
    x, weight = torch.randn(3, 96) * 4, torch.randn(96)
    expected = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-5), expected, rtol=1e-6, atol=1e-6)


def test_bad_inputs_are_refused_with_their_reason(ops):
    with pytest.raises(RuntimeError, match="features"):
        ops.linear(torch.randn(2, 8), torch.randn(4, 16), None, None)
    with pytest.raises(RuntimeError, match="float32"):
        ops.linear(torch.randn(2, 8).double(), torch.randn(4, 8), None, None)
    with pytest.raises(RuntimeError, match="int8 weights need their per-row scale"):
        ops.linear(torch.randn(2, 8), torch.ones(4, 8, dtype=torch.int8), None, None)
    with pytest.raises(RuntimeError, match="a scale goes with int8 weights only"):
        ops.linear(torch.randn(2, 8), torch.randn(4, 8), None, None, torch.ones(4))
    with pytest.raises(RuntimeError, match="scale must be float32 with 4 elements"):
        ops.linear(torch.randn(2, 8), torch.ones(4, 8, dtype=torch.int8), None, None, torch.ones(3))


def _paged_attention_case(head_dim: int, cache_dtype: torch.dtype, history: int, num_new: int):
    """A cache of `history` random keys/values on shuffled pages (6 query heads over 2 KV heads), and the fused q/k/v
    rows of `num_new` new tokens after it; rotary tables of the identity (cos 1, sin 0)."""
    generator = torch.Generator().manual_seed(head_dim + history)
    heads, kv_heads, page_size = 6, 2, 16
    num_pages = -(-(history + num_new) // page_size) + 2
    k_cache = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=generator).to(cache_dtype)
    v_cache = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=generator).to(cache_dtype)
    pages = torch.randperm(num_pages, generator=generator).to(torch.int32)  # not in pool order
    qkv = torch.randn(num_new, (heads + 2 * kv_heads) * head_dim, generator=generator)
    positions = torch.arange(history, history + num_new)
    slots = (pages.long()[positions // page_size] * page_size + positions % page_size)
    return heads, kv_heads, k_cache, v_cache, pages, qkv, positions, slots


def _attend(ops, case, rows: slice, window: int, k_cache, v_cache):
    heads, kv_heads, _, _, pages, qkv, positions, slots = case
    qkv_rows = qkv[rows].clone()
    n, head_dim = qkv_rows.shape[0], k_cache.shape[-1]
    ones, zeros = torch.ones(n, head_dim), torch.zeros(n, head_dim)
    qo_indptr, page_indptr = torch.tensor([0, n], dtype=torch.int32), torch.tensor([0, len(pages)], dtype=torch.int32)
    return ops.paged_attention(qkv_rows, ones, zeros, k_cache, v_cache, slots[rows].clone(), positions[rows].clone(),
                               qo_indptr, page_indptr, pages, heads, kv_heads, head_dim ** -0.5, window)


@pytest.mark.parametrize("head_dim", [64, 32, 16])  # 64, 32: the register tiles; 16: the portable loops
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=["fp32-cache", "bf16-cache"])
@pytest.mark.parametrize("window", [0, 50])
def test_paged_attention_matches_the_formula_and_decode_steps(ops, head_dim, cache_dtype, window):
    """Attention over a paged cache in place, for 5 new tokens after 139 cached ones (chunks of 64 keys, a partial
    last page, shuffled pages, grouped query heads, an optional sliding window), with an fp32 and a bf16 cache: the
    new K/V land in their slots rounded to the cache's dtype, the output is softmax(q K^T / sqrt(d)) V over the cache
    (within fp32 accumulation, float64 reference), and each token's row is bit-identical whether the 5 are verified
    at once or decoded one by one."""
    _check_paged_attention(ops, head_dim, cache_dtype, window)


def _check_paged_attention(ops, head_dim: int, cache_dtype: torch.dtype, window: int) -> None:
    case = _paged_attention_case(head_dim, cache_dtype, history=139, num_new=5)
    heads, kv_heads, k_cache, v_cache, pages, qkv, positions, slots = case
    verify_k, verify_v = k_cache.clone(), v_cache.clone()
    verified = _attend(ops, case, slice(0, 5), window, verify_k, verify_v)  # [5, heads * head_dim]
    step_k, step_v = k_cache.clone(), v_cache.clone()
    steps = torch.cat([_attend(ops, case, slice(t, t + 1), window, step_k, step_v) for t in range(5)])
    assert torch.equal(verified, steps)
    assert torch.equal(verify_k, step_k) and torch.equal(verify_v, step_v)

    q, k, v = qkv.view(5, heads + 2 * kv_heads, head_dim).split([heads, kv_heads, kv_heads], dim=1)
    flat_k, flat_v = verify_k.view(-1, kv_heads, head_dim), verify_v.view(-1, kv_heads, head_dim)
    assert torch.equal(flat_k[slots], k.to(cache_dtype)) and torch.equal(flat_v[slots], v.to(cache_dtype))
    for t in range(5):
        p = int(positions[t])
        keys = torch.arange(max(0, p - window + 1) if window else 0, p + 1)
        key_slots = pages.long()[keys // 16] * 16 + keys % 16
        for h in range(heads):
            g = h // (heads // kv_heads)
            scores = flat_k[key_slots, g].double() @ q[t, h].double() * head_dim ** -0.5
            expected = torch.softmax(scores, 0) @ flat_v[key_slots, g].double()
            row = verified[t, h * head_dim:(h + 1) * head_dim].double()
            torch.testing.assert_close(row, expected, rtol=1e-5, atol=1e-5)


def test_paged_attention_refuses_caches_of_mixed_or_other_dtypes(ops):
    case = _paged_attention_case(32, torch.float32, history=20, num_new=1)
    k_cache, v_cache = case[2], case[3]
    with pytest.raises(RuntimeError, match="both float32 or both bfloat16"):
        _attend(ops, case, slice(0, 1), 0, k_cache, v_cache.bfloat16())
    with pytest.raises(RuntimeError, match="both float32 or both bfloat16"):
        _attend(ops, case, slice(0, 1), 0, k_cache.half(), v_cache.half())


# ---- the decode path on a tiny Llama -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=7)


def _kernel_model(path, dtype=torch.float32):
    model = load_model(path, dtype="float32", device="cpu")
    return apply_decode_path(model, dtype, KERNEL_MAX_ROWS)


def test_the_decode_path_replaces_modules_and_leaves_the_model_as_defined(ops, tiny_dir):
    """`apply_decode_path` is a transform from outside the model: it replaces modules (no instance's class is
    rewritten), the parameters stay the same tensors under the same names, and the model's own classes carry no
    decode state; a head's decode-time pieces live in its `HeadRunner`."""
    from mtp_train.runtime.decode_runner import DecodeRMSNorm, KernelDecoderLayer, KernelDecoderLayers
    from mtp_train.runtime.model import DecoderLayer, DecoderLayers

    model = load_model(tiny_dir, dtype="float32", device="cpu")
    head = DraftHead.from_target(model, HeadConfig.for_target(model.config, kind="mtp", init="random"))
    modules = [(type(m), m) for m in (*model.modules(), *head.modules())]
    tensors = {k: v.data_ptr() for k, v in (*model.state_dict().items(), *head.state_dict().items())}
    apply_decode_path(model, torch.bfloat16, KERNEL_MAX_ROWS)
    runner = HeadRunner(head, torch.bfloat16, KERNEL_MAX_ROWS)
    assert all(type(m) is cls for cls, m in modules)
    assert {k: v.data_ptr() for k, v in (*model.state_dict().items(), *head.state_dict().items())} == tensors
    assert isinstance(model.model.layers, KernelDecoderLayers) and model.model.layers.stack is not None
    assert all(isinstance(layer, KernelDecoderLayer) for layer in (*model.model.layers, *head.layers))
    assert isinstance(model.lm_head, DecodeLinear) and isinstance(model.model.norm, DecodeRMSNorm)
    assert isinstance(head.eh_proj, DecodeLinear) and runner.fused is not None and runner.projection is not None
    assert not any("decode" in name for cls in (DecoderLayer, DecoderLayers, DraftHead) for name in vars(cls))


def _recording_ops(ops, record: dict):
    """A stand-in for the kernels' ops object: each op named in `record` calls `record[name](args)` (when not None)
    and then the real op."""
    def wrap(name, hook):
        real = getattr(ops, name)
        return staticmethod(lambda *args: (hook(args) if hook else None, real(*args))[1])
    return type("Ops", (), {name: wrap(name, hook) for name, hook in record.items()})


@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16, torch.int8], ids=["fp32", "bf16", "int8"])
def test_verify_rows_are_bit_identical_to_decode_steps(ops, tiny_dir, weights):
    """Each row is computed in the same order whatever the row count: a verify of 5 tokens gives exactly the logits of
    5 decode steps (the property that makes greedy speculation reproduce plain greedy bit for bit), whatever the
    decode weights."""
    model = _kernel_model(tiny_dir, weights)
    ids = torch.randint(2, 96, (17,), generator=torch.Generator().manual_seed(0)).tolist()
    allocator = PageAllocator(16, page_size=4)
    cache = model.new_kv_cache(allocator)
    seq = Sequence(0)
    model(torch.tensor(ids[:12]), BatchInfo.for_sequences([seq], [12], allocator), cache)
    verify = model(torch.tensor(ids[12:]), BatchInfo.for_sequences([seq], [5], allocator, advance=False), cache).logits
    steps = torch.cat([model(torch.tensor([t]), BatchInfo.for_sequences([seq], [1], allocator), cache).logits
                       for t in ids[12:]])
    assert torch.equal(verify, steps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_rows_are_bit_identical_to_decode_steps_along_each_path(ops, tiny_dir, dtype):
    """A draft tree's verify attends over the pages in place with each node's ancestors (`tree_key_tables`), keys in
    position order as a decode step takes them: every node's logits equal, bit for bit, those of decode steps feeding
    its path one token at a time (what keeps greedy tree output identical to plain greedy whatever the rounding of
    the decode path, bf16 activations included)."""
    from mtp_train.runtime.attention import ancestor_mask
    from mtp_train.runtime.cpu_decode import tree_key_tables

    model = _kernel_model(tiny_dir, dtype)
    prompt = torch.randint(2, 96, (13,), generator=torch.Generator().manual_seed(1)).tolist()
    tokens = [7, 11, 13, 17, 19, 23, 29]  # root 7, then nodes 1..6
    parents = [-1, 0, 0, 1, 1, 4, 2]
    depths = [0, 1, 1, 2, 2, 3, 2]
    allocator = PageAllocator(64, page_size=4)
    cache, seq = model.new_kv_cache(allocator), Sequence(0)
    model(torch.tensor(prompt), BatchInfo.for_sequences([seq], [len(prompt)], allocator), cache)
    start = seq.num_cached
    batch = BatchInfo.for_tree([seq], [[start + d for d in depths]], [ancestor_mask(parents)], allocator)
    assert tree_key_tables(batch) is not None  # the kernel path, not the torch fallback
    tree_logits = model(torch.tensor(tokens), batch, cache).logits
    for node in range(len(tokens)):
        path = node_path(tokens, parents, node)
        fresh_allocator = PageAllocator(64, page_size=4)
        fresh, fresh_seq = model.new_kv_cache(fresh_allocator), Sequence(0)
        model(torch.tensor(prompt), BatchInfo.for_sequences([fresh_seq], [len(prompt)], fresh_allocator), fresh)
        for token in path:
            step = model(torch.tensor([token]), BatchInfo.for_sequences([fresh_seq], [1], fresh_allocator), fresh)
        assert torch.equal(tree_logits[node], step.logits[0]), f"node {node}"


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_greedy_speculative_equals_plain_greedy_through_the_kernels(ops, tiny_dir, k, batch_size):
    target = _kernel_model(tiny_dir, torch.bfloat16)
    torch.manual_seed(0)
    head = DraftHead.from_target(target, HeadConfig.for_target(target.config, kind="mtp", init="last_layer"))
    runner = HeadRunner(head, torch.bfloat16, KERNEL_MAX_ROWS)
    assert head.layers[0].kernel is not None and isinstance(head.eh_proj, DecodeLinear) and runner.chains_in_one_call
    _, stats = run_and_compare(target, runner, make_prompts(batch_size), max_new_tokens=12, k=k)
    assert stats.accepted_tokens > 0  # a last-layer head agrees with its target now and then


@pytest.mark.parametrize("through_kernels", [True, False], ids=["kernels", "torch-attention"])
def test_a_bf16_kv_cache_keeps_greedy_speculation_exact_and_logits_within_its_rounding(ops, tiny_dir, through_kernels):
    """`kv_cache_dtype` bf16 (through the paged kernel, and through the torch attention of a model without the decode
    path): every K/V row is rounded once as it is written, decode and verify read the same rows, so greedy speculative
    output equals plain greedy; a verify's logits stay within bf16 rounding of the fp32 cache's."""
    def target_with(cache_dtype):
        model = _kernel_model(tiny_dir) if through_kernels else load_model(tiny_dir, dtype="float32", device="cpu")
        model.kv_cache_dtype = cache_dtype
        return model

    reference, target = target_with(torch.float32), target_with(torch.bfloat16)
    assert all(k.dtype == torch.bfloat16 for k, _ in target.new_kv_cache(PageAllocator(4, 4)).layers)
    fp32_logits, bf16_logits = _verify_logits(reference), _verify_logits(target)
    difference = (fp32_logits - bf16_logits).abs().max()
    assert 0 < difference <= 0.02 * fp32_logits.abs().max()
    torch.manual_seed(0)
    head = DraftHead.from_target(target, HeadConfig.for_target(target.config, kind="mtp", init="last_layer"))
    runner = HeadRunner(head, torch.float32, KERNEL_MAX_ROWS) if through_kernels else head
    _, stats = run_and_compare(target, runner, make_prompts(3), max_new_tokens=12, k=3)
    assert stats.accepted_tokens > 0


@pytest.mark.parametrize("through_kernels", [True, False], ids=["kernels", "torch-attention"])
def test_states_over_a_bf16_kv_cache_are_what_prefill_and_a_forward_without_cache_compute(ops, tiny_dir,
                                                                                          through_kernels):
    """Decode steps over a bf16 K/V cache attend over rounded keys and values. A prefill into that cache reads its own
    fresh K/V as the cache holds them, and a forward without a cache given `kv_dtype` (precompute's stored states)
    rounds them alike: both give the decode steps' hidden states up to fp32 summation order, while the unrounded
    forward differs from them by the rounding."""
    model = _kernel_model(tiny_dir) if through_kernels else load_model(tiny_dir, dtype="float32", device="cpu")
    model.kv_cache_dtype = torch.bfloat16
    ids = torch.randint(2, 96, (12,), generator=torch.Generator().manual_seed(3))
    allocator = PageAllocator(8, page_size=4)

    def cached(step: int) -> torch.Tensor:  # [12, hidden]: the sequence `step` tokens per forward over a fresh cache
        cache, seq, rows = model.new_kv_cache(allocator), Sequence(0), []
        for start in range(0, len(ids), step):
            chunk = ids[start:start + step]
            rows.append(model(chunk, BatchInfo.for_sequences([seq], [len(chunk)], allocator), cache,
                              return_hidden=True).hidden)
        seq.release(allocator)
        return torch.cat(rows)

    decoded = cached(1)
    prefilled = cached(len(ids))
    rounded = model(ids, BatchInfo.without_cache([len(ids)], kv_dtype=torch.bfloat16), return_hidden=True).hidden
    unrounded = model(ids, BatchInfo.without_cache([len(ids)]), return_hidden=True).hidden
    scale = decoded.abs().max()
    order_noise = 1e-4 * scale  # fp32 summation order (the kernels: ~1e-5 of the largest state)
    assert (prefilled - decoded).abs().max() <= order_noise
    assert (rounded - decoded).abs().max() <= order_noise
    assert (unrounded - decoded).abs().max() > 10 * order_noise  # the rounding is really there, and bigger


def _verify_logits(model) -> torch.Tensor:
    """The logits of a verify of 3 tokens after a 6-token prefill (fixed random ids), on a fresh cache."""
    ids = torch.randint(2, 96, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    allocator = PageAllocator(8, page_size=4)
    cache, seq = model.new_kv_cache(allocator), Sequence(0)
    model(torch.tensor(ids[:6]), BatchInfo.for_sequences([seq], [6], allocator), cache)
    return model(torch.tensor(ids[6:]), BatchInfo.for_sequences([seq], [3], allocator), cache).logits


def test_bf16_decode_weights_stay_within_bf16_rounding(ops, tiny_dir):
    fp32, bf16 = _kernel_model(tiny_dir), _kernel_model(tiny_dir, torch.bfloat16)
    reference, logits = _verify_logits(fp32), _verify_logits(bf16)
    difference = (reference - logits).abs().max()
    assert 0 < difference <= 0.02 * reference.abs().max()  # really the bf16 copy, and only its rounding


def test_without_kernels_the_small_row_linear_falls_back_to_torch(monkeypatch):
    monkeypatch.setattr(kernels, "_state", {"ops": None, "reason": "disabled by the test"})
    weight, bias = torch.randn(12, 16), torch.randn(12)
    small = SmallRowLinear(weight, bias, torch.bfloat16, max_rows=4)
    assert small.ops is None
    x = torch.randn(2, 16)
    expected = F.linear(x.bfloat16(), weight.bfloat16(), bias.bfloat16()).float()
    torch.testing.assert_close(small(x), expected)


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setenv(kernels.ENV_SWITCH, "0")
    assert kernels.cpu_kernels() is None
    assert kernels.ENV_SWITCH in kernels.unavailable_reason()
    assert kernels.kernels_summary().startswith("unavailable")


ZEN4_FLAGS = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16"})


@pytest.mark.parametrize("flags, requested, variant", [
    (ZEN4_FLAGS, "1", "avx512bf16"),
    (ZEN4_FLAGS - {"avx512_bf16"}, "1", "avx512"),
    (frozenset({"avx2", "fma", "f16c"}), "1", "avx2"),
    (frozenset({"sse4_2"}), "1", "generic"),
    (ZEN4_FLAGS, "avx2", "avx2"),  # the AVX2 path forced on an AVX-512 machine
])
def test_the_build_follows_the_cpu_flags_or_the_environment(monkeypatch, flags, requested, variant):
    from mtp_train.runtime import hardware

    monkeypatch.setattr(hardware, "cpu_facts", lambda: hardware.CpuFacts("cpu", "x86_64", flags))
    monkeypatch.setenv(kernels.ENV_SWITCH, requested)
    name, compiler_flags = kernels._build_flags()
    assert name == variant and compiler_flags == kernels.VARIANTS[variant][1]


def test_a_build_lock_left_by_a_killed_build_is_removed_and_a_live_one_waited_for(tmp_path, capsys):
    import os

    from mtp_train.runtime.kernels import STALE_LOCK_SECONDS, _clear_stale_build_lock

    build_dir = tmp_path / "build"
    build_dir.mkdir()
    (build_dir / "build.ninja").write_text("")
    lock = build_dir / "lock"
    now = 1_000_000.0
    os.utime(build_dir / "build.ninja", (now - 10, now - 10))

    # a live build: the lock goes after two polls; nothing is removed by us
    lock.touch()
    os.utime(lock, (now - 10, now - 10))
    polls = []

    def build_finishes(_seconds):
        polls.append(1)
        if len(polls) == 2:
            lock.unlink()

    _clear_stale_build_lock(build_dir, clock=lambda: now, sleep=build_finishes)
    assert len(polls) == 2 and "waiting for another process building" in capsys.readouterr().err

    # a killed build: nothing written for longer than the limit; the lock is removed at once
    lock.touch()
    os.utime(lock, (now - STALE_LOCK_SECONDS - 1, now - STALE_LOCK_SECONDS - 1))
    os.utime(build_dir / "build.ninja", (now - STALE_LOCK_SECONDS - 1, now - STALE_LOCK_SECONDS - 1))
    _clear_stale_build_lock(build_dir, clock=lambda: now, sleep=lambda _s: pytest.fail("no wait expected"))
    assert not lock.exists()

    # a lock that stops making progress while we wait: removed once the limit passes
    lock.touch()
    os.utime(lock, (now, now))
    os.utime(build_dir / "build.ninja", (now, now))
    clock = [now]
    _clear_stale_build_lock(build_dir, clock=lambda: clock[0], sleep=lambda s: clock.__setitem__(0, clock[0] + 60))
    assert not lock.exists() and clock[0] >= now + STALE_LOCK_SECONDS


def test_a_build_the_cpu_cannot_run_is_refused_with_what_it_lacks(monkeypatch):
    from mtp_train.runtime import hardware

    monkeypatch.setattr(hardware, "cpu_facts", lambda: hardware.CpuFacts("cpu", "x86_64", frozenset({"avx2", "fma",
                                                                                                     "f16c"})))
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setenv(kernels.ENV_SWITCH, "avx512bf16")
    assert kernels.cpu_kernels() is None  # decoding falls back to torch, with the reason
    assert "lacks avx512_bf16, avx512bw, avx512dq, avx512f, avx512vl" in kernels.unavailable_reason()


_OTHER_BUILD_CHECK = """
import torch
from mtp_train.runtime import kernels
ops = kernels.cpu_kernels()
assert ops is not None and kernels.kernels_variant() == {variant!r}, (kernels.kernels_variant(), kernels.unavailable_reason())
gen = torch.Generator().manual_seed(0)
x = torch.randn(5, 96, generator=gen)
for weight in (torch.randn(40, 96, generator=gen), torch.randn(40, 96, generator=gen).bfloat16()):
    met = x.bfloat16().double() if weight.dtype == torch.bfloat16 and ops.bf16_activations() else x.double()
    torch.testing.assert_close(ops.linear(x, weight, None, None), (met @ weight.double().T).float(), rtol=1e-5, atol=1e-4)
    rows = ops.linear(x, weight, None, None)
    assert all(torch.equal(rows[i], ops.linear(x[i:i + 1], weight, None, None)[0]) for i in range(5))
from tests.test_cpu_decode import _check_paged_attention
for head_dim in (64, 16):
    for cache_dtype in (torch.float32, torch.bfloat16):
        _check_paged_attention(ops, head_dim, cache_dtype, window=50)
print("ok", kernels.kernels_variant(), ops.bf16_activations())
"""


def test_the_other_build_of_this_cpu_computes_the_same(tmp_path):
    """The build this CPU does not pick by default, forced with MTP_TRAIN_CPU_KERNELS (AVX2 on an AVX-512 machine,
    the portable one on an AVX2 machine): built, loaded, the linear within fp32 accumulation of the reference and
    its rows bit-identical to single-row calls, the paged attention over fp32 and bf16 caches as in
    `test_paged_attention_matches_the_formula_and_decode_steps`. Run in a subprocess: a process loads one build."""
    import os
    import subprocess
    import sys

    variant = "avx2" if kernels.kernels_variant() in ("avx512bf16", "avx512") else "generic"
    env = {**os.environ, kernels.ENV_SWITCH: variant}
    result = subprocess.run([sys.executable, "-c", _OTHER_BUILD_CHECK.format(variant=variant)], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[:2] == ["ok", variant]


@pytest.mark.parametrize("native", [False, True], ids=["avx2", "native-bf16"])
def test_many_row_gemms_use_bf16_only_on_native_bf16_cpus_with_a_bf16_decode_dtype(monkeypatch, native):
    """Forwards above the kernels' rows: fp32 GEMMs (exact) unless the decode dtype is bf16 on a CPU with native bf16
    matmul, where the GEMMs read a bf16 copy (bf16 rounding, fp32 output)."""
    import mtp_train.runtime.cpu_decode as cpu_decode
    from torch import nn

    monkeypatch.setattr(cpu_decode, "_native_bf16", lambda: native)
    torch.manual_seed(0)
    q, k = nn.Linear(64, 96), nn.Linear(64, 32, bias=False)
    x = torch.randn(40, 64)
    reference = torch.cat([q(x), k(x)], dim=-1).detach()
    exact = cpu_decode.ManyRowLinear([q, k], torch.float32)(x)
    assert exact.dtype == torch.float32 and torch.allclose(exact, reference, atol=1e-5)
    decoded = cpu_decode.ManyRowLinear([q, k], torch.bfloat16)(x)
    assert decoded.dtype == torch.float32
    error = (decoded - reference).abs().max().item()
    if native:
        assert 0 < error <= 0.03 * reference.abs().max().item()  # bf16 weights and activations
    else:
        assert error <= 1e-5  # no native bf16: the fp32 GEMM


def _prefill_logits(model, ids: list[int]) -> torch.Tensor:
    allocator = PageAllocator(8, page_size=4)
    cache, seq = model.new_kv_cache(allocator), Sequence(0)
    batch = BatchInfo.for_sequences([seq], [len(ids)], allocator)
    return model(torch.tensor(ids), batch, cache).logits  # [len(ids), vocab]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3: per-head q/k norms before the rotation
@pytest.mark.parametrize("native", [False, True], ids=["avx2", "native-bf16"])
def test_prefill_runs_bf16_gemms_only_on_native_bf16_cpus_with_bf16_decode_weights(ops, tmp_path, monkeypatch,
                                                                                     native, arch):
    """A prompt's prefill (more tokens per sequence than the paged kernel takes) keeps the model's own fp32 path,
    except on a native-bf16 CPU with bf16 decode weights, where its linears are bf16 GEMMs: logits within bf16
    rounding of fp32."""
    import mtp_train.runtime.cpu_decode as cpu_decode

    monkeypatch.setattr(cpu_decode, "_native_bf16", lambda: native)
    tiny_dir = save_tiny_model(tmp_path, arch, seed=7)
    reference, bf16 = load_model(tiny_dir, dtype="float32", device="cpu"), _kernel_model(tiny_dir, torch.bfloat16)
    ids = torch.randint(2, 96, (24,), generator=torch.Generator().manual_seed(3)).tolist()  # 24 > 16 per sequence
    layer = bf16.model.layers[0].kernel
    assert layer.bf16_prefill is native
    allocator = PageAllocator(8, page_size=4)
    prefill = BatchInfo.for_sequences([Sequence(0)], [len(ids)], allocator, advance=False)
    assert layer.serves(prefill) is native
    expected, got = _prefill_logits(reference, ids), _prefill_logits(bf16, ids)
    error = (got - expected).abs().max().item()
    if native:
        assert 0 < error <= 0.03 * expected.abs().max().item()
    else:  # the model's own fp32 path; only the lm_head reads its bf16 copy (rows <= 16: none here)
        assert error <= 1e-4 * expected.abs().max().item()


def test_greedy_speculative_equals_plain_greedy_with_bf16_prefill(ops, tiny_dir, monkeypatch):
    """With the bf16-GEMM prefill (native-bf16 CPU, bf16 decode weights) the target's and the head's prefill go
    through it alike: greedy speculative output is still plain greedy's."""
    import mtp_train.runtime.cpu_decode as cpu_decode

    monkeypatch.setattr(cpu_decode, "_native_bf16", lambda: True)
    target = _kernel_model(tiny_dir, torch.bfloat16)
    torch.manual_seed(0)
    head = DraftHead.from_target(target, HeadConfig.for_target(target.config, kind="mtp", init="last_layer"))
    runner = HeadRunner(head, torch.bfloat16, KERNEL_MAX_ROWS)
    assert target.model.layers[0].kernel.bf16_prefill and head.layers[0].kernel.bf16_prefill
    prompts = [p * 6 for p in make_prompts(3)]  # longer than the paged kernel's 16 tokens per sequence
    assert min(len(p) for p in prompts) > 16
    run_and_compare(target, runner, prompts, max_new_tokens=10, k=2)


def test_norms_outside_the_decoder_layers_use_the_kernel_norm_for_few_rows(ops, tiny_dir):
    """A target's final norm and a head's norms run the kernel's rms_norm for decode-sized inputs (same values as the
    module's formula, to float rounding), the module's own formula for many rows and under autograd."""
    from mtp_train.runtime.decode_runner import DecodeRMSNorm
    from mtp_train.runtime.model import RMSNorm

    target = _kernel_model(tiny_dir)
    head = DraftHead.from_target(target, HeadConfig.for_target(target.config, kind="mtp", init="random"))
    apply_decode_path(head, torch.float32, KERNEL_MAX_ROWS)
    norms = [target.model.norm, head.enorm, head.hnorm, head.norm]
    assert all(type(norm) is DecodeRMSNorm for norm in norms)
    assert type(target.model.layers[0].input_layernorm) is RMSNorm  # inside a layer: the layer kernel's own call
    calls = []
    original = ops.rms_norm
    for norm in norms:
        norm.weight.data.uniform_(0.5, 1.5)
        norm.ops = type("Ops", (), {"rms_norm": staticmethod(lambda *a: calls.append(1) or original(*a))})
        for rows, grad in ((1, False), (KERNEL_MAX_ROWS, False), (KERNEL_MAX_ROWS + 1, False), (2, True)):
            x = torch.randn(rows, norm.weight.shape[0], requires_grad=grad)
            calls.clear()
            with torch.set_grad_enabled(grad):
                got = norm(x)
            assert len(calls) == (0 if grad or rows > KERNEL_MAX_ROWS else 1)
            assert torch.allclose(got, RMSNorm.forward(norm, x), atol=1e-6)


@pytest.mark.parametrize("arch, overrides", [
    ("llama", {}),
    ("qwen2", {}),  # q/k/v biases
    ("qwen3", {}),  # per-head q/k norms
    ("mistral", {"sliding_window": 6}),  # a window shorter than the prompt
], ids=["llama", "qwen2", "qwen3", "mistral-window"])
@pytest.mark.parametrize("weights", [torch.float32, torch.int8], ids=["fp32", "int8"])
def test_the_layer_stack_call_computes_what_the_layers_compute_one_by_one(ops, tmp_path, arch, overrides, weights):
    """`DecodeStack` runs every decoder layer in one kernel call (`decode_layers`): decode steps, a verify, a draft
    tree and the aux layers' outputs an EAGLE-3 head reads are bit-identical to the per-layer kernel path, and the
    forwards it does not serve (a prefill) keep that path."""
    from mtp_train.runtime.attention import ancestor_mask
    from mtp_train.runtime.cpu_decode import DecodeStack

    model = _kernel_model(save_tiny_model(tmp_path, arch, seed=3, num_hidden_layers=3, **overrides), weights)
    stack = model.model.layers.stack
    assert isinstance(stack, DecodeStack)
    calls = []
    original_call = DecodeStack.__call__
    ids = torch.randint(2, 96, (23,), generator=torch.Generator().manual_seed(2)).tolist()

    def run(with_stack: bool):
        model.model.layers.stack = stack if with_stack else None
        allocator = PageAllocator(32, page_size=4)
        cache, seq = model.new_kv_cache(allocator), Sequence(0)
        outputs = []

        def forward(tokens, batch):
            out = model(torch.tensor(tokens), batch, cache, return_hidden=True, aux_layers=(0, 2))
            outputs.extend([out.logits, out.hidden, out.aux_hidden[0], out.aux_hidden[2]])

        forward(ids[:18], BatchInfo.for_sequences([seq], [18], allocator))  # a prefill: the per-layer path
        for token in ids[18:20]:
            forward([token], BatchInfo.for_sequences([seq], [1], allocator))  # decode steps
        forward(ids[20:], BatchInfo.for_sequences([seq], [3], allocator, advance=False))  # a verify of 3
        start = seq.num_cached
        tree = BatchInfo.for_tree([seq], [[start, start + 1, start + 1, start + 2]], [ancestor_mask([-1, 0, 0, 1])],
                                  allocator)
        forward([5, 6, 7, 8], tree)
        return outputs

    try:
        DecodeStack.__call__ = lambda self, *a, **kw: calls.append(a[0].shape[0]) or original_call(self, *a, **kw)
        with_stack = run(True)
        without = run(False)
    finally:
        DecodeStack.__call__ = original_call
        model.model.layers.stack = stack
    assert calls == [1, 1, 3, 4]  # every forward but the prefill (more than KERNEL_MAX_ROWS rows)
    assert len(with_stack) == len(without)
    for i, (a, b) in enumerate(zip(with_stack, without)):
        assert torch.equal(a, b), f"output {i}"


def test_an_int8_head_drafts_through_the_kernels_and_greedy_output_stays_the_targets(ops, tiny_dir):
    """`precision.head_decode` int8 (`head_runner`): the head's layer, input projection and draft
    projection hold int8 weights with row scales; the target's verify keeps greedy speculative output identical to
    plain greedy; `auto` picks int8 where the kernels serve the head, `target` keeps the target's decode weights."""
    from mtp_train.runtime.precision import Precision

    target = _kernel_model(tiny_dir, torch.bfloat16)
    precision = Precision("float32", "bfloat16", KERNEL_MAX_ROWS, "test")
    config = HeadConfig.for_target(target.config, kind="mtp", init="last_layer")
    heads = {}
    for name in ("int8", "auto", "target"):
        torch.manual_seed(0)
        heads[name] = head_runner(DraftHead.from_target(target, config), precision, name)
        assert heads[name].decode_weights == ("bfloat16" if name == "target" else "int8")
    for name, dtype in (("int8", torch.int8), ("auto", torch.int8), ("target", torch.bfloat16)):
        runner = heads[name]
        assert runner.head.layers[0].kernel.qkv.dtype == dtype and runner.head.eh_proj.small.weight.dtype == dtype
        assert runner.projection.weight.dtype == dtype
    kernel = heads["int8"].head.layers[0].kernel
    assert kernel.gate_up_scale.shape == (target.config.intermediate_size, 2)
    _, stats = run_and_compare(target, heads["int8"], make_prompts(3), max_new_tokens=12, k=2)
    assert stats.accepted_tokens > 0


def test_an_int8_head_is_refused_where_the_kernels_do_not_serve_it(monkeypatch, tiny_dir):
    from mtp_train.errors import UserError
    from mtp_train.runtime.precision import Precision

    monkeypatch.setattr(kernels, "_state", {"ops": None, "reason": "disabled by the test"})
    target = load_model(tiny_dir, dtype="float32", device="cpu")
    head = DraftHead.from_target(target, HeadConfig.for_target(target.config, kind="mtp", init="random"))
    precision = Precision("float32", "float32", 0, "test")
    with pytest.raises(UserError, match="kernels are unavailable .disabled by the test.; use target"):
        head_runner(head, precision, "int8")
    assert head_runner(head, precision, "auto").decode_weights == "float32"  # auto falls back to the target's
    with pytest.raises(UserError, match="expected one of auto, target, int8"):
        head_runner(head, precision, "int4")


def test_an_int8_target_stays_within_its_quantization_and_speculates_losslessly(ops, tiny_dir):
    """`precision.decode: int8` serves the target's decode and verify matmuls from row-quantized int8 weights:
    its logits stay within the quantization error of fp32's, and greedy speculative decoding over it reproduces
    plain greedy decoding over it token for token."""
    from mtp_train.runtime.precision import resolve_precision

    fp32 = _kernel_model(tiny_dir)
    int8 = load_model(tiny_dir, device="cpu", precision=resolve_precision("auto", "int8", "cpu"))  # as stages load it
    assert int8.lm_head.small.weight.dtype == torch.int8 and int8.model.layers[0].kernel.qkv.dtype == torch.int8
    reference, logits = _verify_logits(fp32), _verify_logits(int8)
    difference = (reference - logits).abs().max()
    assert 0 < difference <= 0.05 * reference.abs().max()  # really the int8 copy, and only its rounding
    torch.manual_seed(0)
    head = DraftHead.from_target(int8, HeadConfig.for_target(int8.config, kind="mtp", init="last_layer"))
    _, stats = run_and_compare(int8, HeadRunner(head, torch.bfloat16, KERNEL_MAX_ROWS), make_prompts(3),
                               max_new_tokens=12, k=3)
    assert stats.accepted_tokens > 0


@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16, torch.int8], ids=["fp32", "bf16", "int8"])
def test_the_mtp_input_call_computes_what_the_separate_ops_compute(ops, tiny_dir, weights):
    """An MTP head's input projection in one kernel call (`DecodeMTPInput`: embedding rows, enorm, hnorm, eh_proj):
    its draft steps and catch-up rows equal, bit for bit, those of the separate norm and projection calls; rows above
    `max_rows` keep the separate path."""
    from mtp_train.runtime.cpu_decode import DecodeMTPInput

    target = _kernel_model(tiny_dir, weights)
    torch.manual_seed(0)
    head = DraftHead.from_target(target, HeadConfig.for_target(target.config, kind="mtp", init="random"))
    for norm in (head.enorm, head.hnorm):
        norm.weight.data.uniform_(0.5, 1.5)
    runner = HeadRunner(head, weights, KERNEL_MAX_ROWS)
    fused = runner.mtp_input
    assert isinstance(fused, DecodeMTPInput)
    served = []
    fused.ops = _recording_ops(ops, {"mtp_input": lambda args: served.append(args[0].numel())})
    gen = torch.Generator().manual_seed(4)

    def run():
        allocator = PageAllocator(16, page_size=4)
        cache, seq = head.new_kv_cache(allocator), Sequence(0)
        outs = []
        for rows in (KERNEL_MAX_ROWS + 2, 3, 1, 1):  # a catch-up after a prefill, a catch-up, two draft steps
            ids = torch.randint(0, 96, (rows,), generator=gen.manual_seed(rows))
            hidden = torch.randn(rows, target.config.hidden_size, generator=gen.manual_seed(rows))
            outs.append(runner(ids, hidden, BatchInfo.for_sequences([seq], [rows], allocator), cache))
        return outs

    with_fused = run()
    runner.mtp_input = None
    separate = run()
    assert served == [3, 1, 1]
    for a, b in zip(with_fused, separate):
        assert torch.equal(a, b)


@pytest.mark.parametrize("weights,draft_vocab", [(torch.float32, None), (torch.bfloat16, None), (torch.int8, 40)],
                         ids=["fp32", "bf16", "int8-draft-vocab"])
def test_the_one_call_head_forward_computes_what_the_per_op_path_computes(ops, tiny_dir, weights, draft_vocab):
    """An MTP head's cached forward and logits in one kernel call (`DecodeHeadForward`: input rows, layers, final norm,
    the projection of the rows asked for, their argmax): a two-sequence catch-up and a draft step equal, bit for bit,
    `forward` then `logits`; more than `max_rows` rows, and a draft vocabulary changed after it was built, take the
    per-op path."""
    from mtp_train.runtime.cpu_decode import DecodeHeadForward

    target = _kernel_model(tiny_dir, weights)
    torch.manual_seed(0)
    head = DraftHead.from_target(target, HeadConfig.for_target(target.config, kind="mtp", init="random",
                                                               draft_vocab_size=draft_vocab))
    if draft_vocab is not None:
        head.set_draft_vocab(torch.arange(0, 2 * draft_vocab, 2))
    for norm in (head.enorm, head.hnorm, head.norm):
        norm.weight.data.uniform_(0.5, 1.5)
    runner = HeadRunner(head, weights, KERNEL_MAX_ROWS)
    fused = runner.fused
    assert isinstance(fused, DecodeHeadForward)
    served = []
    fused.ops = _recording_ops(ops, {"mtp_head_forward": lambda args: served.append(args[0].numel())})
    gen = torch.Generator().manual_seed(4)
    d = target.config.hidden_size

    def run():
        allocator = PageAllocator(32, page_size=4)
        cache, seqs = head.new_kv_cache(allocator), [Sequence(0), Sequence(1)]
        outs = []
        # a catch-up after the prefills (above max_rows: per-op), a catch-up of 3 + 2 rows, a draft step
        for rows in ([KERNEL_MAX_ROWS + 2, 5], [3, 2], [1, 1]):
            total = sum(rows)
            ids = torch.randint(0, 96, (total,), generator=gen.manual_seed(total))
            hidden = torch.randn(total, d, generator=gen.manual_seed(total))
            batch = BatchInfo.for_sequences(seqs, rows, allocator)
            last_rows = batch.last_token_indices()
            with torch.inference_mode():
                outs.append(runner.forward_with_logits(ids, hidden, batch, cache, last_rows))
        return outs

    with_fused = run()
    runner.fused = None
    per_op = run()
    assert served == [5, 2]
    for fused_out, per_op_out in zip(with_fused, per_op):
        for a, b in zip(fused_out, per_op_out):
            assert torch.equal(a, b)
    logits = with_fused[1][1]
    assert logits.shape == (2, draft_vocab or target.config.vocab_size)
    assert torch.equal(with_fused[1][2], logits.argmax(-1))

    runner.fused = fused
    if draft_vocab is not None:  # a new draft vocabulary: the fused path's projection copy is stale, it steps aside
        head.set_draft_vocab(torch.arange(1, 2 * draft_vocab, 2))
        served.clear()
        run()
        assert served == []


@pytest.mark.parametrize("weights,draft_vocab", [(torch.float32, None), (torch.int8, 64)], ids=["fp32", "int8-vocab"])
def test_the_greedy_chain_in_one_call_drafts_what_the_step_by_step_chain_drafts(ops, tiny_dir, weights, draft_vocab):
    """The MTP chain's greedy catch-up + draft steps as one kernel call (`mtp_head_chain`, via
    `HeadRunner.greedy_chain`): speculative output stays plain greedy's, and every draft is the step-by-step chain's
    (the acceptance counters and head forwards agree with the per-op path's); batches whose sequences draft different
    numbers of tokens (the last steps) and a prefill's catch-up (above max_rows) take the step-by-step path."""
    from mtp_train.runtime.precision import Precision

    target = _kernel_model(tiny_dir, torch.bfloat16)
    torch.manual_seed(0)
    head = DraftHead.from_target(target, HeadConfig.for_target(target.config, kind="mtp", init="last_layer",
                                                               draft_vocab_size=draft_vocab))
    if draft_vocab is not None:
        head.set_draft_vocab(torch.arange(draft_vocab))
    precision = Precision("float32", "bfloat16", KERNEL_MAX_ROWS, "test")
    runner = head_runner(head, precision, "int8" if weights == torch.int8 else "target")
    fused = runner.fused
    chains = []
    fused.ops = _recording_ops(ops, {"mtp_head_forward": None,
                                     "mtp_head_chain": lambda args: chains.append(args[-2])})  # num_drafts
    prompts = make_prompts(3)
    _, chained = run_and_compare(target, runner, prompts, max_new_tokens=14, k=3)
    runner.fused = None
    _, per_op = run_and_compare(target, runner, prompts, max_new_tokens=14, k=3)
    assert chains and set(chains) <= {1, 2, 3} and 3 in chains
    assert chained.accepted_tokens > 0
    for key in ("accepted_per_position", "drafted_per_position", "draft_forwards", "target_forwards"):
        assert getattr(chained, key) == getattr(per_op, key), key
