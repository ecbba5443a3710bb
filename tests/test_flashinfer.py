"""The FlashInfer attention backend (runtime/flashinfer_attention.py) against the torch backend.

Three layers of checks:
- on any machine: `get_backend`'s choices and errors (the head dims FlashInfer's kernels take among them), the
  custom tree mask against the torch backend's `_tree_allowed_mask`, and the `plan()` arguments built from a
  `BatchInfo` (int32 indptrs and indices on the host, pinned for a CUDA target, the page table cut to the attended
  keys, which wrapper serves which batch);
- on any machine, against `EmulatedFlashInfer`: a small torch model of the three FlashInfer wrappers as their
  documentation defines plan()/run() (index-aligned causal mask, `window_left`, row-major custom mask per request,
  NHD pages), so that the backend's own work (which wrapper, the plan arguments in FlashInfer's order, cache writes,
  planning once per batch and again when batches interleave, `kv_dtype` rounding) is checked on CPU in fp32;
- with CUDA and flashinfer-python: the same parity cases through the real kernels in bf16 (outputs within 2e-2 of
  the torch backend run in fp32 on the same bf16 values), and greedy generation by the default model with both
  backends (the same tokens). They skip, naming what is missing, elsewhere.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from mtp_train.errors import UserError
from mtp_train.runtime.attention import BatchInfo, TorchAttention, _tree_allowed_mask, ancestor_mask, get_backend
from mtp_train.runtime import flashinfer_attention
from mtp_train.runtime.flashinfer_attention import (
    HEAD_DIMS,
    FlashInferAttention,
    paged_kv_table,
    plan_for_batch,
    tree_custom_mask,
    window_left,
)
from mtp_train.runtime.kv_cache import PageAllocator, Sequence

GPU_TOLERANCE = 2e-2  # bf16 kernels against fp32 attention on the same bf16 values (outputs are O(1))
EMULATED_TOLERANCE = 1e-5  # fp32 against fp32


# ---- the cases: a batch over a cache whose earlier tokens hold random K/V ------------------------------------------


def _cached_sequences(cached: list[int], allocator: PageAllocator) -> list[Sequence]:
    """Sequences with `cached[b]` tokens already counted as cached (their K/V: whatever the cache holds)."""
    seqs = [Sequence(b) for b in range(len(cached))]
    BatchInfo.for_sequences(seqs, cached, allocator)
    return seqs


def _tree_case(allocator: PageAllocator, device) -> BatchInfo:
    """Two trees: one whose region is its own 5 nodes (W = n) after 6 cached tokens, one whose region also covers
    the 2 newest cached tokens (W = n + 2) after 9."""
    seqs = _cached_sequences([6, 9], allocator)
    parents = [-1, 0, 0, 1, 2]
    depths = [0, 1, 1, 2, 2]
    own = ancestor_mask(parents)
    wider = torch.cat([torch.tensor([[True, False]] * 5), own], dim=1)  # [5, 7]
    positions = [[6 + d for d in depths], [9 + d for d in depths]]
    return BatchInfo.for_tree(seqs, positions, [own, wider], allocator, device)


def _paged_case(cached: list[int], new: list[int]):
    def build(allocator: PageAllocator, device) -> BatchInfo:
        return BatchInfo.for_sequences(_cached_sequences(cached, allocator), new, allocator, device)
    return build


CASES = {
    "decode": _paged_case([5, 9, 1], [1, 1, 1]),
    "verify": _paged_case([6, 3], [4, 4]),  # q_len k + 1 = 4
    "ragged_chunks": _paged_case([3, 0, 8], [3, 1, 5]),
    "prefill_with_cache": _paged_case([0, 0], [7, 4]),
    "tree": _tree_case,
    "no_cache": lambda allocator, device: BatchInfo.without_cache([5, 3, 8], device),
    "no_cache_bf16_kv": lambda allocator, device: BatchInfo.without_cache([6, 2], device, kv_dtype=torch.bfloat16),
}
HEADS = [(4, 4), (8, 2), (16, 2)]  # MHA; GQA; GQA with a group above the tensor-core decode threshold
HEAD_DIM = 64
PAGE_SIZE = 4


def _check_parity(backend, case: str, heads: tuple[int, int], sliding_window: int | None, device, dtype,
                  tolerance: float) -> None:
    """`backend` and the torch backend (fp32, on the same values) attend the case's batch for two layers: the same
    outputs and the same cache contents."""
    num_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(7)
    allocator = PageAllocator(24, PAGE_SIZE)
    batch = CASES[case](allocator, device)
    reference_batch = CASES[case](PageAllocator(24, PAGE_SIZE), device)  # the same pages, its own plans
    scale = HEAD_DIM ** -0.5
    for layer in range(2):
        def rand(*shape):
            return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

        q = rand(batch.num_tokens, num_heads, HEAD_DIM)
        k, v = rand(batch.num_tokens, num_kv_heads, HEAD_DIM), rand(batch.num_tokens, num_kv_heads, HEAD_DIM)
        cache = reference_cache = None
        if batch.uses_cache:
            shape = (allocator.num_pages, PAGE_SIZE, num_kv_heads, HEAD_DIM)
            cache = (rand(*shape), rand(*shape))
            reference_cache = (cache[0].float(), cache[1].float())
        out = backend.attend(q, k, v, cache, batch, scale, sliding_window)
        expected = TorchAttention().attend(q.float(), k.float(), v.float(), reference_cache, reference_batch, scale,
                                           sliding_window)
        assert out.shape == q.shape and out.dtype == dtype
        error = (out.float() - expected).abs().max().item()
        assert error <= tolerance, (case, heads, sliding_window, layer, error)
        if cache is not None:
            assert torch.equal(cache[0].float(), reference_cache[0]) and torch.equal(cache[1].float(),
                                                                                   reference_cache[1])


# ---- get_backend --------------------------------------------------------------------------------------------------


def test_get_backend_torch_and_auto_off_cuda_are_torch():
    assert isinstance(get_backend("torch", "cpu"), TorchAttention)
    assert isinstance(get_backend("auto", "cpu", torch.bfloat16), TorchAttention)
    assert isinstance(get_backend("auto", "cuda", torch.float32), TorchAttention)  # FlashInfer has no fp32 kernels
    assert isinstance(get_backend("auto", "cuda"), TorchAttention)  # dtype unknown (training's frozen parts)


def test_get_backend_flashinfer_on_cpu_is_a_user_error_naming_the_extra():
    with pytest.raises(UserError, match=r"mtp_train\[gpu\].*CUDA"):
        get_backend("flashinfer", "cpu", torch.bfloat16)


def test_get_backend_flashinfer_in_fp32_is_a_user_error():
    with pytest.raises(UserError, match="float16/bfloat16.*precision.compute"):
        get_backend("flashinfer", "cuda", torch.float32)


def test_get_backend_unknown_name_lists_the_choices():
    with pytest.raises(UserError, match="auto, torch, flashinfer"):
        get_backend("flash", "cpu")


def test_get_backend_without_flashinfer_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # `import flashinfer` raises ImportError
    with pytest.raises(UserError, match=r"flashinfer-python.*mtp_train\[gpu\]"):
        get_backend("flashinfer", "cuda", torch.bfloat16)
    assert isinstance(get_backend("auto", "cuda", torch.bfloat16), TorchAttention)


def test_get_backend_with_a_flashinfer_that_does_not_import(monkeypatch, tmp_path, caplog):
    package = tmp_path / "flashinfer"
    package.mkdir()
    (package / "__init__.py").write_text("raise RuntimeError('built for another CUDA')\n")
    monkeypatch.delitem(sys.modules, "flashinfer", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError, match="installed but does not import.*another CUDA"):
        get_backend("flashinfer", "cuda", torch.bfloat16)
    with caplog.at_level("WARNING"):
        assert isinstance(get_backend("auto", "cuda", torch.bfloat16), TorchAttention)
    assert "attending with torch" in caplog.text


def test_load_model_passes_the_backend_through(target_dir):
    from mtp_train.runtime.loader import load_model

    with pytest.raises(UserError, match="runs on CUDA GPUs only"):
        load_model(target_dir, dtype="float32", device="cpu", backend="flashinfer")


@pytest.fixture
def flashinfer_importable(monkeypatch):
    """`import flashinfer` works (a stand-in module): `auto` would pick FlashInfer on CUDA in bf16/fp16."""
    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace())


@pytest.mark.parametrize("head_dim", [16, 32, 80, 96, 512])
def test_auto_attends_with_torch_for_a_head_dim_flashinfer_does_not_take(flashinfer_importable, head_dim):
    """gpu_check's tiny models (head_dim 16, 32) must not reach FlashInfer's kernels, whose failure would poison the
    CUDA context for every later section."""
    assert isinstance(get_backend("auto", "cuda", torch.bfloat16, head_dim), TorchAttention)
    with pytest.raises(UserError, match=rf"head_dim 64, 128, 256.*{head_dim} wide.*target.attention: torch"):
        get_backend("flashinfer", "cuda", torch.bfloat16, head_dim)


@pytest.mark.parametrize("head_dim", [*HEAD_DIMS, None])
def test_auto_picks_flashinfer_for_the_head_dims_it_takes(flashinfer_importable, head_dim):
    assert HEAD_DIMS == (64, 128, 256)
    assert isinstance(get_backend("auto", "cuda", torch.bfloat16, head_dim), FlashInferAttention)
    assert isinstance(get_backend("flashinfer", "cuda", torch.float16, head_dim), FlashInferAttention)


def test_load_model_checks_the_head_dim_before_it_builds_flashinfer(flashinfer_importable, target_dir):
    """The tiny target's attention heads are 16 wide: an explicit flashinfer is refused before anything reaches
    CUDA (the error comes before the weights are read)."""
    from mtp_train.runtime.loader import load_model

    with pytest.raises(UserError, match="head_dim 64, 128, 256; this model's attention heads are 16 wide"):
        load_model(target_dir, dtype="float16", device=torch.device("cuda"), backend="flashinfer")


def test_recipe_key_and_generate_option():
    from mtp_train.cli import build_parser
    from mtp_train.cli_options import defaults_from_args
    from mtp_train.recipe import Recipe

    assert Recipe(name="x").target.attention == "auto"
    with pytest.raises(Exception, match="attention"):
        Recipe.model_validate({"name": "x", "target": {"attention": "flash"}})
    args = build_parser().parse_args(["generate", "--prompt", "hi", "--attention", "torch"])
    assert defaults_from_args(args).target.attention == "torch"


def test_generate_passes_attention_to_the_loader(target_dir):
    from mtp_train.cli import build_parser

    args = build_parser().parse_args(["generate", "--target", str(target_dir), "--prompt", "hi", "--device", "cpu",
                                      "--dtype", "float32", "--attention", "flashinfer"])
    with pytest.raises(UserError, match="runs on CUDA GPUs only"):
        args.func(args)


# ---- the pure-Python part: masks and plan arguments ----------------------------------------------------------------


@pytest.mark.parametrize("sliding_window", [None, 4, 8])
def test_tree_custom_mask_matches_the_torch_backend(sliding_window):
    allocator = PageAllocator(24, PAGE_SIZE)
    batch = _tree_case(allocator, "cpu")
    bounds = batch.qo_indptr.tolist()
    expected = torch.cat([
        _tree_allowed_mask(batch.positions[bounds[b]:bounds[b + 1]], batch.kv_lens[b], batch.tree_masks[b],
                           sliding_window).reshape(-1)
        for b in range(batch.batch_size)])
    mask = tree_custom_mask(batch, sliding_window, "cpu")
    assert mask.dtype == torch.bool
    assert mask.shape == (sum(q * kv for q, kv in zip(batch.q_lens, batch.kv_lens)),)
    assert torch.equal(mask, expected)


def test_window_left_is_the_window_minus_the_query_itself():
    assert window_left(None) == -1
    assert window_left(4) == 3


def test_paged_kv_table_is_cut_to_the_attended_keys():
    allocator = PageAllocator(32, PAGE_SIZE)
    seqs = _cached_sequences([5, 2], allocator)
    plain = BatchInfo.for_sequences(seqs, [1, 1], allocator, advance=False)
    indptr, indices, last = paged_kv_table(plain)
    assert torch.equal(indptr, plain.kv_page_indptr) and torch.equal(indices, plain.kv_page_indices)
    assert torch.equal(last, plain.kv_last_page_len)
    ahead = BatchInfo.for_sequences(seqs, [1, 1], allocator, reserve_ahead=6)  # pages for 6 more positions
    indptr, indices, last = paged_kv_table(ahead)
    assert ahead.kv_page_indptr.tolist() == [0, 3, 6]  # the batch's own table: 12 and 9 positions
    assert indptr.tolist() == [0, 2, 3] and last.tolist() == [2, 3]  # 6 and 3 keys
    assert indices.tolist() == seqs[0].pages[:2] + seqs[1].pages[:1]
    assert {t.dtype for t in (indptr, indices, last)} == {torch.int32}
    assert {t.device.type for t in (indptr, indices, last)} == {"cpu"}


@pytest.mark.parametrize("case,kind", [("decode", "decode"), ("verify", "paged"), ("ragged_chunks", "paged"),
                                       ("tree", "tree"), ("no_cache", "ragged")])
def test_plan_arguments(case, kind):
    batch = CASES[case](PageAllocator(24, PAGE_SIZE), "cpu")
    plan = plan_for_batch(batch, 16, 2, HEAD_DIM, 0.125, 4, torch.bfloat16, torch.device("cpu"))
    assert plan.kind == kind
    tensors = [a for a in plan.args if isinstance(a, torch.Tensor)]
    assert tensors and all(t.dtype == torch.int32 and t.device.type == "cpu" for t in tensors)
    heads_at = {"decode": 3, "paged": 4, "tree": 4, "ragged": 2}[kind]  # after the indptrs and indices
    assert plan.args[heads_at:heads_at + 3] == (16, 2, HEAD_DIM)
    assert plan.kwargs["sm_scale"] == 0.125 and plan.kwargs["q_data_type"] == torch.bfloat16
    if kind == "decode":
        assert plan.use_tensor_cores  # 8 query heads per KV head
        assert plan.args[-1] == PAGE_SIZE and plan.kwargs["window_left"] == 3
    elif case == "tree":
        assert plan.kwargs["window_left"] == -1 and not plan.kwargs["causal"]  # the window is in the mask
        assert plan.kwargs["custom_mask"].shape == (sum(q * kv for q, kv in zip(batch.q_lens, batch.kv_lens)),)
    else:
        assert plan.kwargs["causal"] and plan.kwargs["window_left"] == 3
    if kind == "ragged":
        assert torch.equal(plan.args[0], batch.qo_indptr) and plan.args[1] is plan.args[0]


class _RecordingWrapper:
    """A FlashInfer wrapper that records what plan() was given."""

    planned: list = []

    def __init__(self, float_workspace_buffer, kv_layout="NHD", **options):
        pass

    def plan(self, *args, **kwargs):
        _RecordingWrapper.planned.append((args, kwargs))


@pytest.mark.parametrize("case,kind", [("decode", "decode"), ("verify", "paged"), ("tree", "tree"),
                                       ("no_cache", "ragged")])
def test_plan_keeps_the_index_tensors_on_the_host_for_a_cuda_target(monkeypatch, case, kind):
    """FlashInfer's plan() reads indptrs, page indices and last-page lengths on the host and copies them to the
    device itself: for a CUDA target they are built on the host, pinned, and reach plan() as they are (a device copy
    would be copied back, one synchronization per forward). Only a tree's custom mask is built on the device."""
    pinned = []

    def pin_memory(self, *args, **kwargs):  # this machine may have no CUDA to pin for: record the call instead
        pinned.append(self)
        return self

    mask_devices = []

    def custom_mask(batch, sliding_window, device):
        mask_devices.append(torch.device(device))
        return torch.ones(sum(q * kv for q, kv in zip(batch.q_lens, batch.kv_lens)), dtype=torch.bool)

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(flashinfer_attention, "tree_custom_mask", custom_mask)
    batch = CASES[case](PageAllocator(24, PAGE_SIZE), "cpu")
    plan = plan_for_batch(batch, 16, 2, HEAD_DIM, 0.125, None, torch.bfloat16, torch.device("cuda"))
    assert plan.kind == kind
    tensors = [a for a in plan.args if isinstance(a, torch.Tensor)]
    assert len(tensors) == {"decode": 3, "paged": 4, "tree": 4, "ragged": 2}[kind]
    for tensor in tensors:
        assert tensor.device.type == "cpu" and tensor.dtype == torch.int32
        assert any(tensor is p for p in pinned), "a CUDA target's index tensors are pinned"
    assert mask_devices == ([torch.device("cuda")] if kind == "tree" else [])
    # The backend hands them to the wrapper's plan() unchanged (the wrappers mocked; the workspace on the CPU).
    module = types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=_RecordingWrapper,
                                   BatchPrefillWithPagedKVCacheWrapper=_RecordingWrapper,
                                   BatchPrefillWithRaggedKVCacheWrapper=_RecordingWrapper)
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setattr(_RecordingWrapper, "planned", [])
    FlashInferAttention()._wrapper(plan, torch.device("cpu"))
    (args, _), = _RecordingWrapper.planned
    handed = [a for a in args if isinstance(a, torch.Tensor)]
    assert len(handed) == len(tensors) and all(a is b for a, b in zip(handed, tensors))


def test_causal_and_tree_batches_plan_separate_wrappers():
    """A wrapper may keep the kernel family of its first plan (FA3 takes no custom mask): trees get their own."""
    keys = {case: plan_for_batch(CASES[case](PageAllocator(24, PAGE_SIZE), "cpu"), 4, 2, HEAD_DIM, 0.125, None,
                                 torch.bfloat16, "cpu").wrapper_key for case in ("verify", "tree", "ragged_chunks")}
    assert keys["verify"] == keys["ragged_chunks"] != keys["tree"]


# ---- the backend against an emulation of FlashInfer's documented wrappers (CPU) -------------------------------------


def _attend_request(q, k, v, allowed, scale):
    """q [qo, H, D], k/v [kv, Hk, D], allowed [qo, kv] -> [qo, H, D] in fp32; query head h reads KV head h // group."""
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, dim=1), v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def _index_mask(qo_len: int, kv_len: int, causal: bool, window: int) -> torch.Tensor:
    """FlashInfer's masks by index: query i sits at key index kv_len - qo_len + i."""
    q_idx = torch.arange(qo_len)[:, None] + kv_len - qo_len
    kv_idx = torch.arange(kv_len)[None, :]
    allowed = kv_idx <= q_idx if causal else torch.ones(qo_len, kv_len, dtype=torch.bool)
    if window >= 0:
        allowed &= kv_idx >= q_idx - window
    return allowed


class _EmulatedWrapper:
    plans = 0  # plan() calls of every wrapper, for the planning checks

    def __init__(self, float_workspace_buffer, kv_layout="NHD", **options):
        assert kv_layout == "NHD" and float_workspace_buffer.dtype == torch.uint8
        self.options = options

    def _planned(self, qo_indptr, num_qo_heads, num_kv_heads, head_dim, tensors, q_data_type, kv_data_type):
        assert all(t.dtype == torch.int32 for t in tensors), "indptrs and indices are int32"
        assert all(t.device.type == "cpu" for t in tensors), "plan() reads indptrs and indices on the host"
        _EmulatedWrapper.plans += 1
        self.qo_indptr, self.heads = qo_indptr.tolist(), (num_qo_heads, num_kv_heads, head_dim)
        self.dtypes = (q_data_type, kv_data_type)

    def _check_run(self, q, k_dtype):
        assert (q.shape[1], q.shape[2]) == (self.heads[0], self.heads[2]) and q.is_contiguous()
        assert (q.dtype, k_dtype) == self.dtypes and q.shape[0] == self.qo_indptr[-1]


class _EmulatedPaged(_EmulatedWrapper):
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
             head_dim_qk, page_size, *, custom_mask=None, causal=False, sm_scale=None, window_left=-1,
             q_data_type="float16", kv_data_type=None):
        self._planned(qo_indptr, num_qo_heads, num_kv_heads, head_dim_qk,
                      (qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len), q_data_type,
                      kv_data_type)
        self.table = (paged_kv_indptr.tolist(), paged_kv_indices.long(), paged_kv_last_page_len.tolist(), page_size)
        self.mask, self.causal, self.scale, self.window = custom_mask, causal, sm_scale, window_left

    def _keys(self, cache, b):
        indptr, indices, last, page_size = self.table
        pages = indices[indptr[b]:indptr[b + 1]]
        kv_len = (len(pages) - 1) * page_size + last[b]
        return cache[pages].reshape(-1, *cache.shape[2:])[:kv_len]

    def run(self, q, paged_kv_cache):
        k_cache, v_cache = paged_kv_cache
        self._check_run(q, k_cache.dtype)
        out, offset = [], 0
        for b in range(len(self.qo_indptr) - 1):
            q_b = q[self.qo_indptr[b]:self.qo_indptr[b + 1]]
            k_b, v_b = self._keys(k_cache, b), self._keys(v_cache, b)
            qo_len, kv_len = q_b.shape[0], k_b.shape[0]
            if self.mask is not None:
                allowed = self.mask[offset:offset + qo_len * kv_len].view(qo_len, kv_len)
                offset += qo_len * kv_len
            else:
                allowed = _index_mask(qo_len, kv_len, self.causal, self.window)
            out.append(_attend_request(q_b, k_b, v_b, allowed, self.scale))
        if self.mask is not None:
            assert offset == self.mask.numel(), "the custom mask covers every request's whole key range"
        return torch.cat(out).to(q.dtype)


class _EmulatedDecode(_EmulatedPaged):
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
             window_left=-1, sm_scale=None, q_data_type="float16", kv_data_type=None):
        batch_size = len(indptr) - 1
        super().plan(torch.arange(batch_size + 1, dtype=torch.int32), indptr, indices, last_page_len, num_qo_heads,
                     num_kv_heads, head_dim, page_size, causal=True, sm_scale=sm_scale, window_left=window_left,
                     q_data_type=q_data_type, kv_data_type=kv_data_type)


class _EmulatedRagged(_EmulatedWrapper):
    def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, *, causal=False, window_left=-1,
             sm_scale=None, q_data_type="float16", kv_data_type=None):
        self._planned(qo_indptr, num_qo_heads, num_kv_heads, head_dim_qk, (qo_indptr, kv_indptr), q_data_type,
                      kv_data_type)
        self.kv_indptr, self.causal, self.scale, self.window = kv_indptr.tolist(), causal, sm_scale, window_left

    def run(self, q, k, v):
        self._check_run(q, k.dtype)
        out = []
        for b in range(len(self.qo_indptr) - 1):
            q_b = q[self.qo_indptr[b]:self.qo_indptr[b + 1]]
            k_b, v_b = k[self.kv_indptr[b]:self.kv_indptr[b + 1]], v[self.kv_indptr[b]:self.kv_indptr[b + 1]]
            allowed = _index_mask(q_b.shape[0], k_b.shape[0], self.causal, self.window)
            out.append(_attend_request(q_b, k_b, v_b, allowed, self.scale))
        return torch.cat(out).to(q.dtype)


@pytest.fixture
def emulated(monkeypatch):
    """FlashInferAttention over the emulated wrappers, serving CPU fp32 calls."""
    module = types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=_EmulatedDecode,
                                   BatchPrefillWithPagedKVCacheWrapper=_EmulatedPaged,
                                   BatchPrefillWithRaggedKVCacheWrapper=_EmulatedRagged)
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setattr(FlashInferAttention, "serves", staticmethod(lambda q, k, v, layer_cache: True))
    monkeypatch.setattr(_EmulatedWrapper, "plans", 0)
    return FlashInferAttention()


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("sliding_window", [None, 3])
def test_emulated_parity(emulated, case, heads, sliding_window):
    _check_parity(emulated, case, heads, sliding_window, "cpu", torch.float32, EMULATED_TOLERANCE)
    assert _EmulatedWrapper.plans == 1  # planned once for the batch, run by both layers


def test_emulated_replans_when_batches_interleave(emulated):
    """A target and its draft head share the backend: a wrapper planned for another batch in between is planned
    again for this one; a layer with another window uses its own wrapper."""
    allocator = PageAllocator(24, PAGE_SIZE)
    cache = (torch.randn(24, PAGE_SIZE, 2, 16), torch.randn(24, PAGE_SIZE, 2, 16))
    first = BatchInfo.for_sequences(_cached_sequences([5], allocator), [3], allocator)
    second = BatchInfo.for_sequences(_cached_sequences([2], allocator), [3], allocator)

    def layer(batch, window=None):
        return emulated.attend(torch.randn(3, 4, 16), torch.randn(3, 2, 16), torch.randn(3, 2, 16), cache, batch,
                               0.25, window)

    layer(first), layer(first)
    assert _EmulatedWrapper.plans == 1
    layer(second), layer(first)
    assert _EmulatedWrapper.plans == 3
    layer(first, window=2), layer(first)
    assert _EmulatedWrapper.plans == 4  # the windowed wrapper's first plan; the other is still planned for `first`


def test_emulated_greedy_generation_matches_torch(emulated, target_dir):
    """A whole model (tiny Llama, GQA, fp32) generating through the backend: the torch backend's tokens."""
    from mtp_train.runtime.generate import generate
    from mtp_train.runtime.loader import load_model

    prompts = [[3, 17, 42, 5, 9], [8, 2, 33], [60, 61, 62, 63, 64, 65, 66, 67, 68]]
    by_torch, _ = generate(load_model(target_dir, dtype="float32", device="cpu", backend="torch"), prompts, 12,
                           page_size=4)
    model = load_model(target_dir, dtype="float32", device="cpu", backend="torch")
    model.backend = emulated
    by_flashinfer, _ = generate(model, prompts, 12, page_size=4)
    assert [r.token_ids for r in by_flashinfer] == [r.token_ids for r in by_torch]
    assert _EmulatedWrapper.plans > 0


def test_emulated_tree_speculation_matches_torch_greedy(emulated, target_dir):
    """Tree drafting by an MTP head sharing the target's backend (their batches interleave on its wrappers), the
    verify through tree plans: the torch backend's plain greedy tokens."""
    from mtp_train.heads import DraftHead, HeadConfig
    from mtp_train.runtime.generate import generate
    from mtp_train.runtime.loader import load_model
    from mtp_train.runtime.spec import DraftTree, TreeShape, speculative_generate

    prompts = [[3, 17, 42, 5, 9], [60, 61, 62, 63, 64, 65, 66, 67, 68]]
    by_torch, _ = generate(load_model(target_dir, dtype="float32", device="cpu", backend="torch"), prompts, 16,
                           page_size=4)
    target = load_model(target_dir, dtype="float32", device="cpu", backend="torch")
    target.backend = emulated
    torch.manual_seed(0)
    head = DraftHead.from_target(target, HeadConfig.for_target(target.config, kind="mtp", init="last_layer"))
    assert head.backend is emulated
    results, stats = speculative_generate(target, DraftTree(head, TreeShape.parse("3x2x6")), prompts, 16, 3,
                                          page_size=4, allocator=PageAllocator(64, page_size=4))
    assert stats.schedule == "tree" and stats.verify_sequence_steps > 0
    assert "tree" in {key[1] for key in emulated._wrappers}  # (device, kind, ...): the verify ran on tree plans
    assert [r.token_ids for r in results] == [r.token_ids for r in by_torch]


def test_the_torch_backend_serves_what_flashinfer_cannot():
    q = torch.randn(3, 4, 16)
    assert not FlashInferAttention.serves(q, q[:, :2], q[:, :2], None)  # CPU, fp32
    assert not FlashInferAttention.serves(q.bfloat16(), q[:, :2].bfloat16(), q[:, :2].bfloat16(), None)  # CPU


def _cuda_like(tokens: int, heads: int, head_dim: int, dtype=torch.bfloat16):
    """What `serves` reads of a CUDA tensor (device, dtype, shape, requires_grad), on a machine without CUDA."""
    return types.SimpleNamespace(device=torch.device("cuda"), dtype=dtype, shape=(tokens, heads, head_dim),
                                 requires_grad=False)


@pytest.mark.parametrize("head_dim", [8, 16, 32, 80, 96, 192, 512])
def test_flashinfer_sends_a_head_dim_its_kernels_do_not_take_to_torch(head_dim):
    """A call of another head_dim (a draft head sharing the target's backend, say) goes to the torch backend instead
    of failing inside FlashInfer's kernels."""
    q, kv = _cuda_like(3, 4, head_dim), _cuda_like(3, 2, head_dim)
    assert not FlashInferAttention.serves(q, kv, kv, None)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_flashinfer_serves_the_head_dims_its_kernels_take(head_dim):
    q, kv = _cuda_like(3, 4, head_dim), _cuda_like(3, 2, head_dim)
    cache = (types.SimpleNamespace(dtype=torch.bfloat16),) * 2
    assert FlashInferAttention.serves(q, kv, kv, None) and FlashInferAttention.serves(q, kv, kv, cache)
    assert not FlashInferAttention.serves(q, kv, _cuda_like(3, 2, head_dim // 2), None)  # values of another width
    assert not FlashInferAttention.serves(q, kv, kv, (types.SimpleNamespace(dtype=torch.float32),) * 2)


# ---- the real kernels (CUDA + flashinfer-python) -------------------------------------------------------------------


def _require_flashinfer_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)")
    pytest.importorskip("flashinfer", reason="needs flashinfer-python (pip install 'mtp_train[gpu]')")


@pytest.fixture(scope="module")
def flashinfer_backend():
    _require_flashinfer_gpu()
    return get_backend("flashinfer", "cuda", torch.bfloat16)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("sliding_window", [None, 3])
def test_gpu_parity(flashinfer_backend, case, heads, sliding_window):
    assert isinstance(flashinfer_backend, FlashInferAttention)
    _check_parity(flashinfer_backend, case, heads, sliding_window, torch.device("cuda"), torch.bfloat16,
                  GPU_TOLERANCE)


def test_gpu_auto_picks_flashinfer_and_training_keeps_torch(flashinfer_backend):
    assert isinstance(get_backend("auto", "cuda", torch.bfloat16), FlashInferAttention)
    q = torch.randn(3, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(3, 2, 64, device="cuda", dtype=torch.bfloat16)
    assert not flashinfer_backend.serves(q, k, k, None)  # needs a backward pass: the torch backend
    batch = BatchInfo.without_cache([3], "cuda")
    flashinfer_backend.attend(q, k, k, None, batch, 0.125, None).float().sum().backward()
    assert q.grad is not None


@pytest.mark.slow
@pytest.mark.real_model
def test_gpu_greedy_generation_matches_torch(smollm2_dir):
    """The default model in bf16 on CUDA, greedy, with each backend: the same tokens at every step whose margin
    clears twice the backends' measured logit difference (bf16 near-ties may part them after that)."""
    _require_flashinfer_gpu()
    from mtp_train.evaluate.margins import clear_prefix_length, decode_logits
    from mtp_train.runtime.generate import generate
    from mtp_train.runtime.loader import load_model, load_tokenizer

    tokenizer = load_tokenizer(smollm2_dir)
    prompts = [tokenizer.encode(text) for text in (
        "The capital of France is", "def fibonacci(n):", "Speculative decoding speeds up inference by")]
    tokens, logits = {}, {}
    for name in ("torch", "flashinfer"):
        model = load_model(smollm2_dir, dtype="bfloat16", device="cuda", backend=name)
        assert model.backend.name == name
        results, _ = generate(model, prompts, 24)
        tokens[name] = [r.token_ids for r in results]
        logits[name] = [decode_logits(model, p, t) for p, t in zip(prompts, tokens["torch"])]
    for index, (ours, theirs) in enumerate(zip(tokens["torch"], tokens["flashinfer"])):
        error = float((logits["flashinfer"][index] - logits["torch"][index]).abs().max())
        clear = clear_prefix_length(logits["torch"][index], error)
        assert clear >= 1, f"prompt {index}: its first token is a near-tie (error {error:.3f}); pick another prompt"
        assert theirs[:clear] == ours[:clear], (index, clear, error)


def test_module_imports_without_flashinfer():
    """A CPU install imports the backend's module (and `get_backend`) without importing flashinfer-python."""
    import subprocess

    code = ("import sys; import mtp_train.runtime.flashinfer_attention, mtp_train.runtime.loader; "
            "from mtp_train.runtime.attention import get_backend; get_backend('auto', 'cpu', None); "
            "sys.exit('flashinfer' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
