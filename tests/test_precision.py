"""`precision.compute: auto` (and decode, kv_cache): what it resolves to on mocked machines, the decode-weight copies, and what stages record."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from mtp_train.errors import UserError
from mtp_train.runtime.hardware import CpuFacts
from mtp_train.runtime.decode_runner import DecodeLinear, apply_decode_weights
from mtp_train.runtime.kernels import cpu_kernels
from mtp_train.runtime.precision import (
    Precision,
    decode_probe,
    decode_rows_for_bf16,
    resolve_precision,
    resolve_section,
)
from mtp_train.recipe import PrecisionSection

pytestmark = pytest.mark.cpu_paths  # its expectations depend on the CPU: rerun as other kinds (tests/test_cpu_kinds.py)

AVX2 = CpuFacts("AMD EPYC (Zen 3)", "x86_64", frozenset({"avx", "avx2", "fma", "f16c"}), "AVX2", 2)
AVX512_BF16 = CpuFacts("Intel Xeon (Cooper Lake)", "x86_64", frozenset({"avx2", "avx512f", "avx512_bf16"}), "AVX512", 2)
AMX = CpuFacts("Intel Xeon (Sapphire Rapids)", "x86_64", frozenset({"avx2", "avx512f", "amx_tile", "amx_bf16"}),
               "AVX512", 2)
ARM = CpuFacts("Neoverse", "aarch64", frozenset({"asimd"}), "DEFAULT", 2)


def _timing(bf16_faster_up_to: int) -> dict[int, dict[str, float]]:
    """A decode probe where bf16 weights cost 1 ms per row and fp32 a flat `bf16_faster_up_to` + 0.5 ms."""
    return {rows: {"float32": (bf16_faster_up_to + 0.5) * 1e-3, "bfloat16": rows * 1e-3}
            for rows in (1, 2, 3, 4, 6, 8, 12, 16)}


def _never_called(*_args, **_kwargs):
    raise AssertionError("no timing expected here")


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def test_avx2_cpu_trains_in_fp32_and_decodes_on_timed_bf16_weights():
    precision = resolve_precision("auto", "auto", "cpu", facts=AVX2, decode_timer=lambda: _timing(4),
                                  prefill_timer=_never_called)
    assert (precision.dtype, precision.decode_dtype, precision.decode_max_rows) == ("float32", "bfloat16", 4)
    assert precision.split and "AVX2" in precision.reason and "decode timed" in precision.reason
    assert "float32" in precision.describe("prefill") and "bfloat16" not in precision.describe("prefill")
    assert "decode weights bfloat16 (≤ 4 rows)" in precision.describe()


def test_avx2_stage_without_decode_does_not_time():
    precision = resolve_precision("auto", "auto", "cpu", facts=AVX2, phases=("prefill",), decode_timer=_never_called)
    assert (precision.dtype, precision.decode_dtype, precision.split) == ("float32", "float32", False)


def test_avx2_keeps_fp32_decode_when_bf16_weights_are_not_faster():
    slower = {rows: {"float32": 1e-3, "bfloat16": 2e-3} for rows in (1, 2, 4)}
    precision = resolve_precision("auto", "auto", "cpu", facts=AVX2, decode_timer=lambda: slower)
    assert (precision.dtype, precision.decode_dtype, precision.split) == ("float32", "float32", False)


def _native_timing(kernel_faster_up_to: int) -> dict[int, dict[str, float]]:
    """A decode probe on a native-bf16 CPU: the decode kernel costs 1 ms per row, torch's bf16 matmul a flat
    `kernel_faster_up_to` + 0.5 ms, fp32 always slower."""
    return {rows: {"float32": 1.0, "bfloat16": rows * 1e-3, "bfloat16_torch": (kernel_faster_up_to + 0.5) * 1e-3}
            for rows in (1, 2, 3, 4, 6, 8, 12, 16)}


@pytest.mark.parametrize("facts", [AVX512_BF16, AMX], ids=["avx512_bf16", "amx"])
def test_native_bf16_cpu_prefills_in_bf16_without_timing(facts):
    precision = resolve_precision("auto", "auto", "cpu", facts=facts, phases=("prefill",), decode_timer=_never_called,
                                  prefill_timer=_never_called)
    assert (precision.dtype, precision.decode_dtype, precision.split) == ("bfloat16", "bfloat16", False)
    assert "native bf16" in precision.reason


@pytest.mark.parametrize("facts", [AVX512_BF16, AMX], ids=["avx512_bf16", "amx"])
def test_native_bf16_cpu_decodes_through_the_kernels_where_they_win(facts):
    """The decode kernels need an fp32 model: where they beat torch's native bf16 matmul, the weights are fp32 with
    bf16 decode copies up to the row count where they win; where they lose at 1 row, bf16 everywhere."""
    kernels = resolve_precision("auto", "auto", "cpu", facts=facts, decode_timer=lambda: _native_timing(4),
                                prefill_timer=_never_called)
    assert (kernels.dtype, kernels.decode_dtype, kernels.decode_max_rows) == ("float32", "bfloat16", 4)
    assert "native bf16" in kernels.reason and "decode kernels" in kernels.reason
    torch_wins = {rows: {**times, "bfloat16": 1.0} for rows, times in _native_timing(4).items()}
    plain = resolve_precision("auto", "auto", "cpu", facts=facts, decode_timer=lambda: torch_wins,
                              prefill_timer=_never_called, reprobe=True)
    assert (plain.dtype, plain.decode_dtype, plain.split) == ("bfloat16", "bfloat16", False)
    pinned = resolve_precision("auto", "bfloat16", "cpu", facts=facts, decode_timer=_never_called)
    assert (pinned.dtype, pinned.decode_dtype, pinned.split) == ("bfloat16", "bfloat16", False)


def test_cuda_uses_bf16_where_supported_else_fp32():
    on = resolve_precision("auto", "auto", torch.device("cuda"), cuda_bf16=True, decode_timer=_never_called)
    off = resolve_precision("auto", "auto", torch.device("cuda"), cuda_bf16=False, decode_timer=_never_called)
    assert (on.dtype, on.decode_dtype) == ("bfloat16", "bfloat16") and "CUDA" in on.reason
    assert (off.dtype, off.decode_dtype) == ("float32", "float32")


def test_other_architectures_time_the_prefill_matmul():
    fast_bf16 = resolve_precision("auto", "auto", "cpu", facts=ARM, decode_timer=_never_called,
                                  prefill_timer=lambda: {"float32": 20.0, "bfloat16": 60.0})
    assert fast_bf16.dtype == "bfloat16" and "timed" in fast_bf16.reason
    slow_bf16 = resolve_precision("auto", "auto", "cpu", facts=ARM, decode_timer=lambda: _timing(2),
                                  prefill_timer=lambda: {"float32": 20.0, "bfloat16": 5.0})
    assert (slow_bf16.dtype, slow_bf16.decode_dtype, slow_bf16.decode_max_rows) == ("float32", "bfloat16", 2)


def test_explicit_dtypes_are_honoured():
    plain = resolve_precision("bfloat16", "auto", "cpu", facts=AVX2, decode_timer=_never_called)
    assert (plain.dtype, plain.decode_dtype, plain.split, plain.requested) == ("bfloat16", "bfloat16", False, "bfloat16")
    assert plain.describe().endswith("(as set)")
    mixed = resolve_precision("float32", "bfloat16", "cpu", facts=AVX2, decode_timer=_never_called)
    assert (mixed.dtype, mixed.decode_dtype, mixed.split) == ("float32", "bfloat16", True)
    pinned = resolve_precision("auto", "float32", "cpu", facts=AVX2, decode_timer=_never_called)
    assert (pinned.dtype, pinned.decode_dtype, pinned.split) == ("float32", "float32", False)
    with pytest.raises(UserError, match="precision.compute: 'fp8'"):
        resolve_precision("fp8", "auto", "cpu", facts=AVX2)


def test_the_kv_cache_follows_the_decode_weights_unless_set(tmp_path):
    """`precision.kv_cache: auto`: bf16 where decode reads bf16 or int8 weights (or the model is bf16), else the
    compute dtype; as set otherwise; anything else refused with the key's name. The loader hands it to the model."""
    from mtp_train.runtime.loader import load_model
    from tests.tiny_models import save_tiny_model

    timed = resolve_precision("auto", "auto", "cpu", facts=AVX2, decode_timer=lambda: _timing(4))
    assert timed.kv_cache_dtype == "bfloat16" and "K/V cache bfloat16" in timed.describe()
    assert "K/V cache" not in timed.describe("prefill")
    fp32 = resolve_precision("float32", "auto", "cpu", facts=AVX2, decode_timer=_never_called)
    assert fp32.kv_cache_dtype == "float32" and "K/V cache" not in fp32.describe()
    assert resolve_precision("bfloat16", "auto", "cpu", facts=AVX2).kv_cache_dtype == "bfloat16"
    pinned = resolve_precision("auto", "auto", "cpu", facts=AVX2, decode_timer=lambda: _timing(4),
                               kv_cache_dtype="float32")
    assert (pinned.decode_dtype, pinned.kv_cache_dtype) == ("bfloat16", "float32")
    assert resolve_precision("float32", "auto", "cpu", kv_cache_dtype="bfloat16").kv_cache_torch_dtype == torch.bfloat16
    with pytest.raises(UserError, match="precision.kv_cache: 'int8'"):
        resolve_precision("float32", "auto", "cpu", kv_cache_dtype="int8")
    model = load_model(save_tiny_model(tmp_path, "llama"), device="cpu", precision=timed)
    assert model.kv_cache_dtype == torch.bfloat16
    from mtp_train.runtime.kv_cache import PageAllocator

    assert all(k.dtype == v.dtype == torch.bfloat16 for k, v in model.new_kv_cache(PageAllocator(4, 4)).layers)


def test_precompute_resolves_the_served_kv_cache_without_decoding():
    """Phase "kv_cache" (precompute): the prefill's compute dtype, and the K/V cache a decoding stage resolves from
    the same section (decode timing included), in one resolution whose line and recipe values name both."""
    section = PrecisionSection()
    features = resolve_section(section, "cpu", phases=("prefill", "kv_cache"), facts=AVX2,
                               decode_timer=lambda: _timing(4))
    served = resolve_section(section, "cpu", facts=AVX2, decode_timer=lambda: _timing(4))
    assert (features.dtype, features.split, features.kv_cache_dtype) == ("float32", False, "bfloat16")
    assert served.kv_cache_dtype == features.kv_cache_dtype
    assert features.describe().startswith("compute dtype float32, K/V cache bfloat16 (auto: ")
    assert features.recipe_values() == {"compute": "float32", "kv_cache": "bfloat16"}
    assert served.recipe_values() == {"compute": "float32", "decode": "bfloat16", "kv_cache": "bfloat16"}
    training = resolve_section(section, "cpu", phases=("prefill",), facts=AVX2, decode_timer=_never_called)
    assert training.recipe_values() == {"compute": "float32"} and "K/V" not in training.describe()
    pinned = resolve_section(PrecisionSection(kv_cache="float32"), "cpu", phases=("prefill", "kv_cache"), facts=AVX2,
                             decode_timer=_never_called)  # set: nothing to time
    assert pinned.kv_cache_dtype == "float32" and pinned.describe() == "compute dtype float32 (auto: " + pinned.reason + ")"
    with pytest.raises(ValueError, match="unknown phase"):
        resolve_precision("auto", "auto", "cpu", phases=("prefill", "verify"))


def test_decode_rows_stop_at_the_first_row_count_where_bf16_loses():
    timing = _timing(4)
    timing[2]["bfloat16"] = 1.0  # a noisy loss at 2 rows ends the range there
    assert decode_rows_for_bf16(timing) == 1
    assert decode_rows_for_bf16(_timing(6)) == 6


def test_decode_probe_is_cached_per_machine(tmp_path):
    calls = []

    def timer():
        calls.append(1)
        return _timing(3)

    first = decode_probe(AVX2, timer=timer)
    again = decode_probe(AVX2, timer=timer)
    assert first == again and len(calls) == 1
    cache = json.loads((tmp_path / "cache" / "mtp_train" / "precision-probe.json").read_text())
    assert len(cache) == 1 and next(iter(cache.values()))["cpu"] == AVX2.model
    decode_probe(AVX2, timer=timer, reprobe=True)
    decode_probe(AMX, timer=timer)  # another machine: its own entry
    assert len(calls) == 3


def test_decode_probe_keeps_each_contenders_best_of_two_rounds(monkeypatch):
    """One stall of a shared machine during a single timing (seen once: 380 ms for a 4 ms pass) must not decide the
    cached choice: every row count is timed in two rounds and each contender keeps its best."""
    import mtp_train.runtime.precision as precision

    calls = []

    def fake_best_seconds(fn, budget_s):
        calls.append(fn)
        return 0.380 if len(calls) == 5 else 0.004  # round 1, rows 2: the kernels' pass stalls

    monkeypatch.setattr(precision, "best_seconds", fake_best_seconds)
    timing = precision.time_decode_matmuls(rows_list=(1, 2, 3))
    assert len(calls) == 2 * 3 * 3  # two rounds x three row counts x three contenders
    assert all(times == {"float32": 0.004, "bfloat16": 0.004, "bfloat16_torch": 0.004} for times in timing.values())


def test_best_seconds_times_at_least_min_calls():
    from mtp_train.runtime.hardware import best_seconds

    calls = []
    assert best_seconds(lambda: calls.append(1), budget_s=0.0, min_calls=3) >= 0
    assert len(calls) == 2 + 3  # two warm-up calls, then at least three timed ones whatever the budget


def test_decode_weights_serve_small_row_calls_only(monkeypatch):
    import mtp_train.runtime.cpu_decode as cpu_decode

    monkeypatch.setattr(cpu_decode, "_native_bf16", lambda: False)  # the AVX2 machine: fp32 GEMMs above the rows
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8, bias=False))
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    precision = resolve_precision("float32", "bfloat16", "cpu", facts=AVX2)
    apply_decode_weights(model, precision)
    assert all(isinstance(m, DecodeLinear) for m in model)
    assert model.state_dict().keys() == reference.keys()  # names unchanged, no extra tensors
    x_small, x_big = torch.randn(2, 16), torch.randn(64, 16)
    with torch.inference_mode():
        small, big = model(x_small), model(x_big)
    expected_big = nn.functional.linear(nn.functional.linear(x_big, reference["0.weight"], reference["0.bias"]),
                                        reference["1.weight"])
    torch.testing.assert_close(big, expected_big)  # many rows: the fp32 weights, exactly
    w0, b0, w1 = (reference[k].bfloat16() for k in ("0.weight", "0.bias", "1.weight"))
    ops = cpu_kernels()
    if ops is not None:  # bf16 weights, fp32 activations and accumulation (the kernel); fp32 bias
        # (the AVX512-BF16 build rounds the activations that meet bf16 weights to bf16: vdpbf16ps)
        met = (lambda t: t.bfloat16().float()) if ops.bf16_activations() else (lambda t: t)
        expected_small = nn.functional.linear(
            met(nn.functional.linear(met(x_small), w0.float(), reference["0.bias"])), w1.float())
    else:  # torch's bf16 matmul: activations cast to bf16, the result back
        expected_small = nn.functional.linear(nn.functional.linear(x_small.bfloat16(), w0, b0).float().bfloat16(), w1)
    assert small.dtype == torch.float32
    torch.testing.assert_close(small, expected_small.float())  # few rows: the bf16 copies


@pytest.mark.slow
def test_env_command_prints_the_facts(capsys):
    """`mtp-train env`: versions, CPU and flags, torch's capability and BLAS build, threads, CUDA, what auto picks
    and why, and the two measured ceilings."""
    from mtp_train.cli import main
    from mtp_train.runtime.environment import collect_env

    env = collect_env(measure=True)
    assert env["packages"]["torch"] == torch.__version__
    assert env["cpu"]["torch_capability"] == torch.backends.cpu.get_cpu_capability()
    assert env["auto"]["dtype"] in ("float32", "bfloat16") and env["auto"]["reason"]
    assert env["measured"]["matmul_gflops"]["float32"] > 0 and env["measured"]["matmul_gflops"]["bfloat16"] > 0
    assert env["measured"]["read_bandwidth_gbs"] > 0
    assert main(["env", "--no-measure"]) == 0
    out = capsys.readouterr().out
    for label in ("packages:", "cpu:", "cpu flags:", "torch cpu:", "threads:", "cuda:", "auto dtype:", "because:"):
        assert label in out
    assert main(["env", "--no-measure", "--json"]) == 0
    assert "measured" not in json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("native", [False, True], ids=["avx2", "native-bf16"])
def test_on_native_bf16_cpus_verifies_of_up_to_32_rows_stay_on_the_decode_path(monkeypatch, native):
    """Above the probe's rows a native-bf16 CPU runs bf16 GEMMs, which round differently from the kernels: a verify
    or a draft tree of more rows than a decode step must still read the decode path (the kernels), or greedy
    speculative output parts from plain greedy at near-ties. Elsewhere the probe's rows stand."""
    from mtp_train.runtime import cpu_decode
    from mtp_train.runtime.cpu_decode import EXACT_VERIFY_ROWS

    monkeypatch.setattr(cpu_decode, "_native_bf16", lambda: native)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32))
    apply_decode_weights(model, Precision("float32", "bfloat16", 8, "probe: 8 rows"))
    assert model[0].small.max_rows == (EXACT_VERIFY_ROWS if native else 8)


def test_int8_decode_weights_need_an_fp32_model_on_the_cpu_kernels(monkeypatch):
    """`precision.decode: int8` (the quantized serving target): an fp32 model whose decode/verify matmuls read
    row-quantized int8 copies through the CPU kernels, up to EXACT_VERIFY_ROWS rows (above them fp32 GEMMs would
    round differently from the decode steps a verify replaces); refused with the reason where that cannot run."""
    from mtp_train.runtime import kernels
    from mtp_train.runtime.cpu_decode import EXACT_VERIFY_ROWS

    if cpu_kernels() is None:
        pytest.skip("the CPU decode kernels are not built on this machine")
    for dtype in ("auto", "float32"):
        precision = resolve_precision(dtype, "int8", "cpu", facts=AVX512_BF16, decode_timer=_never_called)
        assert (precision.dtype, precision.decode_dtype, precision.split) == ("float32", "int8", True)
        assert precision.decode_torch_dtype == torch.int8
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32))
    apply_decode_weights(model, precision)
    assert model[0].small.weight.dtype == torch.int8 and model[0].small.max_rows == EXACT_VERIFY_ROWS
    x = torch.randn(3, 16)
    with torch.no_grad():
        scale = model[0].weight.abs().amax(1)
        assert ((model(x) - model[0].small.weight.float().mul(model[0].small.scale[:, None]).matmul(x.T).T
                 - model[0].bias).abs().max() < 1e-5)
        assert (model(x) - torch.nn.functional.linear(x, model[0].weight, model[0].bias)).abs().max() < (
            scale.max() / 127 * x.abs().sum(1).max())
    with pytest.raises(UserError, match="needs precision.compute float32 or auto"):
        resolve_precision("bfloat16", "int8", "cpu", facts=AVX512_BF16)
    with pytest.raises(UserError, match="on cuda use bfloat16 or float16"):
        resolve_precision("auto", "int8", "cuda", facts=AVX512_BF16)
    with pytest.raises(UserError, match="precision.compute: 'int8' is not a dtype"):
        resolve_precision("int8", "auto", "cpu", facts=AVX2)
    monkeypatch.setattr(kernels, "_state", {"ops": None, "reason": "disabled by the test"})
    with pytest.raises(UserError, match="unavailable here .disabled by the test."):
        resolve_precision("auto", "int8", "cpu", facts=AVX512_BF16)
