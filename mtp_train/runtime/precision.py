"""Which dtype each phase computes in: the recipe's `precision` section (`compute`, `decode`, `kv_cache`) with its
`auto` values resolved by the hardware, once per stage.

Two phases meet the weights differently:
- **prefill** (precompute, training, prompt prefill): many rows per weight, compute-bound. It runs in `dtype`, which is
  also the dtype the weights are held in.
- **decode** (decode steps, verify of k + 1 tokens, head draft steps): a few rows per weight, memory-bound. Matmuls with
  at most `decode_max_rows` rows read a second copy of the weights in `decode_dtype` (half the bytes in bf16), when
  that differs from `dtype` (`decode_runner.apply_decode_weights`).

`auto` resolves as follows (the reason is kept in `Precision.reason` and printed by every stage):
- CUDA: bf16 where the GPU supports it, else fp32.
- CPU with native bf16 matmul (AVX512-BF16 or AMX): bf16 for prefill. A stage that decodes times the decode path
  too: bf16 weights through the CPU decode kernels (fused layers, paged attention in place; they need an fp32 model)
  against torch's native bf16 matmuls. Where the kernels win at 1 row, the weights are held in fp32 with bf16 decode copies up to the largest row count where they win,
  as on AVX2-only CPUs, and a prompt's prefill still runs bf16 GEMMs (on bf16 copies of the layers' weights,
  `cpu_decode.DecoderLayerKernel.bf16_prefill`); otherwise bf16 everywhere.
- Other CPUs (AVX2-only x86 and most laptops): the flags are conclusive for prefill when they are x86 without those
  instructions: bf16 GEMMs fall back to slow kernels there (several times slower than fp32), so fp32. Elsewhere (other
  architectures) a many-row matmul is timed in both dtypes. Decode is always timed: one weight set larger than the
  last-level cache is multiplied by 1..16 rows in fp32 and with bf16 weights; bf16 weights are used up to the largest
  row count where they stay faster. The timing is cached per machine, torch version and thread count
  (`~/.cache/mtp_train/precision-probe.json`), so repeated runs make the same choice (`mtp-train env --reprobe`
  measures again).

An explicit `compute` dtype is honoured for both phases unless `decode` is set explicitly too. The K/V cache
(`kv_cache`) follows the decode weights (`resolve_kv_cache_dtype`); precompute, which never decodes, resolves the
decode weights only to learn which cache the served target holds (phase "kv_cache").
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from mtp_train.errors import UserError
from mtp_train.fileio import write_json_atomic
from mtp_train.runtime.hardware import CpuFacts, best_seconds, cpu_facts, measure_matmul_gflops
from mtp_train.runtime.kernels import cpu_kernels, kernels_variant, unavailable_reason

log = logging.getLogger(__name__)

DTYPE_NAMES = ("float32", "bfloat16", "float16")
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Decode weights may also be weight-only int8 (one scale per output row, `cpu_decode.quantize_rows`): a quarter of
# fp32's bytes, through the CPU decode kernels only (they read an fp32 model); never a compute dtype.
DECODE_ONLY_DTYPES = {"int8": torch.int8}
PROBE_ROWS = (1, 2, 3, 4, 6, 8, 12, 16)
PROBE_FORMAT_VERSION = 5  # 3: bf16 timed through the CPU decode kernels where built; 4: + torch's bf16 matmul;
#                           5: best of two rounds


@dataclass(frozen=True)
class Precision:
    """The resolved dtypes of one stage (names, as in recipes)."""

    dtype: str  # weights and every many-row matmul (prefill, precompute, training)
    decode_dtype: str  # weights of matmuls with ≤ decode_max_rows rows (decode, verify, draft steps)
    decode_max_rows: int
    reason: str
    requested: str = "auto"
    kv_cache_dtype: str = ""  # the target's paged K/V cache ("" = `dtype`); see `resolve_kv_cache_dtype`
    phases: tuple[str, ...] = ("prefill", "decode")  # what the stage resolved it for (see `resolve_precision`)

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.kv_cache_dtype or self.dtype]

    @property
    def decode_torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES.get(self.decode_dtype) or DECODE_ONLY_DTYPES[self.decode_dtype]

    @property
    def split(self) -> bool:
        """True when decode reads its own weight copy."""
        return self.decode_dtype != self.dtype and self.decode_max_rows > 0

    def describe(self, phase: str | None = None) -> str:
        """One line for a stage's first output, e.g. `compute dtype float32 (auto: ...)`: what the stage resolved
        (`phases`; `phase="prefill"` shows the compute dtype only)."""
        phases = ("prefill",) if phase == "prefill" else self.phases
        if "decode" not in phases or not self.split:
            what = f"compute dtype {self.dtype}"
        else:
            what = f"compute dtype {self.dtype}, decode weights {self.decode_dtype} (≤ {self.decode_max_rows} rows)"
        if ({"decode", "kv_cache"} & set(phases)) and self.kv_cache_dtype and self.kv_cache_dtype != self.dtype:
            what += f", K/V cache {self.kv_cache_dtype}"
        return f"{what} ({self.requested}: {self.reason})" if self.requested == "auto" else f"{what} (as set)"

    def recipe_values(self) -> dict[str, str]:
        """The recipe's `precision` keys this resolution decided (`auto` replaced): `compute` always; `decode` where
        the stage decodes; `kv_cache` where it decodes or rounds to the cache (precompute). For recipe.resolved.yaml
        (`recipe.with_precision`)."""
        values = {"compute": self.dtype}
        if "decode" in self.phases:
            values["decode"] = self.decode_dtype
        if {"decode", "kv_cache"} & set(self.phases):
            values["kv_cache"] = self.kv_cache_dtype or self.dtype
        return values

    def as_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------------------------------------------------------
# timing probes (separate functions so tests can replace them)
# ---------------------------------------------------------------------------------------------------------------


def time_decode_matmuls(rows_list=PROBE_ROWS, budget_s: float = 0.08) -> dict[int, dict[str, float]]:
    """{rows: {"float32": s, "bfloat16": s}}: one pass of `rows` fp32 activations through a set of 576×1536 weights
    totalling 170 MB in fp32 (larger than any last-level cache, so the weights stream from memory as in a decode step),
    with fp32 weights and with bf16 weights, each as the decode path would run it: fp32 through torch's `F.linear`
    (what forwards above `decode_max_rows` rows keep), bf16 through the CPU decode kernel (fp32 activations and
    accumulation) when it is built, else through `F.linear` (activations cast to bf16, the result back). Also
    `"bfloat16_torch"`: bf16 activations and weights through `F.linear` (a bf16 model's own path; native on CPUs with
    AVX512-BF16 or AMX)."""

    ops = cpu_kernels()
    generator = torch.Generator().manual_seed(0)
    weights32 = [torch.randn(1536, 576, generator=generator) for _ in range(48)]
    weights16 = [w.to(torch.bfloat16) for w in weights32]
    inputs = {rows: torch.randn(rows, 576, generator=generator) for rows in rows_list}
    inputs16 = {rows: x.to(torch.bfloat16) for rows, x in inputs.items()}
    result: dict[int, dict[str, float]] = {rows: {} for rows in rows_list}
    # Two rounds over every row count, keeping each contender's best: the decision is cached for the machine, and one
    # stall of a shared machine during a single timing (once seen: 380 ms for a 4 ms pass at 2 rows, which capped the
    # bf16 decode weights at 1 row and sent every verify to the fp32 weights) must not decide it.
    for _ in range(2):
        for rows in rows_list:
            x, x16 = inputs[rows], inputs16[rows]
            times = {"float32": best_seconds(lambda: [F.linear(x, w) for w in weights32], budget_s)}
            if ops is not None:
                times["bfloat16"] = best_seconds(lambda: [ops.linear(x, w, None, None) for w in weights16], budget_s)
            else:
                times["bfloat16"] = best_seconds(lambda: [F.linear(x.to(torch.bfloat16), w).float() for w in weights16],
                                                budget_s)
            times["bfloat16_torch"] = best_seconds(lambda: [F.linear(x16, w) for w in weights16], budget_s)
            for name, seconds in times.items():
                result[rows][name] = min(seconds, result[rows].get(name, float("inf")))
    return result


def time_prefill_matmul(budget_s: float = 0.2) -> dict[str, float]:
    """{"float32": GFLOP/s, "bfloat16": GFLOP/s} of a 256-row matmul (the shape of prefill and training)."""
    return {name: measure_matmul_gflops(TORCH_DTYPES[name], budget_s=budget_s) for name in ("float32", "bfloat16")}


def _cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "mtp_train" / "precision-probe.json"


def _probe_key(facts: CpuFacts) -> str:

    text = json.dumps([PROBE_FORMAT_VERSION, facts.model, facts.family, facts.model_number, sorted(facts.flags),
                       facts.capability, torch.__version__, torch.get_num_threads(), cpu_kernels() is not None,
                       kernels_variant()])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def decode_probe(facts: CpuFacts, reprobe: bool = False, timer=None) -> dict[int, dict[str, float]]:
    """The decode timing for this machine and thread count: from the cache file, or measured (and cached)."""
    timer = timer or time_decode_matmuls
    path, key = _cache_path(), _probe_key(facts)
    cached: dict = {}
    if path.is_file():
        try:
            cached = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:  # a damaged cache: measured again
            log.warning("ignoring the precision probe cache %s (%s); timing the decode path again", path,
                        type(err).__name__)
            cached = {}
        if not isinstance(cached, dict):
            cached = {}
    if not reprobe and key in cached:
        return {int(rows): times for rows, times in cached[key]["decode"].items()}
    measured = timer()
    cached[key] = {"cpu": facts.describe(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                   "decode": {str(rows): times for rows, times in measured.items()}}
    try:
        write_json_atomic(path, cached)
    except OSError as err:  # a read-only home: the choice is still made, only not remembered
        log.debug("could not cache the precision probe in %s: %s", path, err)
    return measured


def decode_rows_for_bf16(timing: dict[int, dict[str, float]], margin: float = 1.05) -> int:
    """The largest row count up to which bf16 weights beat fp32 by `margin` at every measured count (0: never)."""
    best = 0
    for rows in sorted(timing):
        if timing[rows]["float32"] >= margin * timing[rows]["bfloat16"]:
            best = rows
        else:
            break
    return best


def decode_rows_for_kernels(timing: dict[int, dict[str, float]], margin: float = 1.05) -> int:
    """On a CPU with native bf16 matmul: the largest row count up to which bf16 weights through the decode kernels
    beat torch's bf16 matmul by `margin` at every measured count (0: never, or a probe without that timing)."""
    best = 0
    for rows in sorted(timing):
        torch_bf16 = timing[rows].get("bfloat16_torch")
        if torch_bf16 is not None and torch_bf16 >= margin * timing[rows]["bfloat16"]:
            best = rows
        else:
            break
    return best


# ---------------------------------------------------------------------------------------------------------------
# resolution
# ---------------------------------------------------------------------------------------------------------------


PHASES = ("prefill", "decode", "kv_cache")


def resolve_precision(
    dtype: str = "auto",
    decode_dtype: str = "auto",
    device: str | torch.device = "cpu",
    facts: CpuFacts | None = None,
    cuda_bf16: bool | None = None,
    phases: tuple[str, ...] = ("prefill", "decode"),
    reprobe: bool = False,
    decode_timer=None,
    prefill_timer=None,
    kv_cache_dtype: str = "auto",
) -> Precision:
    """Resolve the recipe's `precision.compute` (`dtype`) / `precision.decode` (`decode_dtype`) /
    `precision.kv_cache` (`kv_cache_dtype`) for `device`. `phases` names what the stage runs: "prefill" (many-row
    forwards), "decode" (decode, verify, draft steps), "kv_cache" (no decode, but the K/V cache the served target
    decodes over: precompute rounds its keys and values to it, so `auto` resolves the decode weights as a decoding
    stage would, timing included). A stage that never decodes (training) skips the decode timing."""
    unknown = [phase for phase in phases if phase not in PHASES]
    if unknown:
        raise ValueError(f"unknown phase(s) {unknown}; expected some of {PHASES}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise UserError(f"precision.kv_cache: {kv_cache_dtype!r}; expected one of {', '.join(KV_CACHE_DTYPES)}")
    weights = ("prefill", "decode") if "decode" in phases else ("prefill",)
    precision = _resolve_weights(dtype, decode_dtype, device, facts, cuda_bf16, weights, reprobe, decode_timer,
                                 prefill_timer)
    served = precision
    if "kv_cache" in phases and "decode" not in phases and kv_cache_dtype == "auto":
        served = _resolve_weights(dtype, decode_dtype, device, facts, cuda_bf16, ("prefill", "decode"), reprobe,
                                  decode_timer, prefill_timer)
    return replace(precision, kv_cache_dtype=resolve_kv_cache_dtype(kv_cache_dtype, served), phases=tuple(phases))


def resolve_section(section, device: str | torch.device, phases: tuple[str, ...] = ("prefill", "decode"),
                    **options) -> Precision:
    """`resolve_precision` of a recipe's `precision` section (its `compute`, `decode` and `kv_cache`); `options`
    as resolve_precision's (reprobe, timers, facts)."""
    return resolve_precision(section.compute, section.decode, device, phases=phases,
                             kv_cache_dtype=section.kv_cache, **options)


KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")


def resolve_kv_cache_dtype(requested: str, precision: Precision) -> str:
    """The target's K/V cache dtype: as set, or (`auto`) bf16 where decode already reads bf16 or int8 weights (or the
    model is bf16: the cache then keeps the model's dtype), else the compute dtype. The cache is what a decode step
    reads besides the weights, and at long context it rivals them, so a bf16 cache halves a large part of a step's
    bytes (its rounding is that of a bf16 model's cache; decode and verify read the same cache, so greedy speculative
    output stays identical to plain greedy). Measured in docs/benchmarks.md."""
    if requested != "auto":
        return requested
    if precision.dtype == "bfloat16" or precision.decode_dtype in ("bfloat16", "int8"):
        return "bfloat16"
    return precision.dtype


def _resolve_weights(dtype, decode_dtype, device, facts, cuda_bf16, phases, reprobe, decode_timer,
                     prefill_timer) -> Precision:
    for name, value, allowed in (("precision.compute", dtype, DTYPE_NAMES),
                                 ("precision.decode", decode_dtype, DTYPE_NAMES + tuple(DECODE_ONLY_DTYPES))):
        if value != "auto" and value not in allowed:
            raise UserError(f"{name}: {value!r} is not a dtype; expected auto, {', '.join(allowed)}")
    device = torch.device(device) if isinstance(device, str) else device
    if decode_dtype in DECODE_ONLY_DTYPES:
        return _int8_decode(dtype, decode_dtype, device)
    if dtype != "auto":
        chosen = decode_dtype if decode_dtype != "auto" else dtype
        rows = _explicit_rows(dtype, chosen)
        return Precision(dtype, chosen, rows, "set in the recipe", requested=dtype)

    if device.type == "cuda":
        bf16 = torch.cuda.is_bf16_supported() if cuda_bf16 is None else cuda_bf16
        name = "bfloat16" if bf16 else "float32"
        reason = "CUDA device with bf16 support" if bf16 else "CUDA device without bf16 support"
        return _with_decode(name, decode_dtype, reason)

    facts = facts or cpu_facts()
    if facts.native_bf16:
        native = ", ".join(flag for flag in ("avx512_bf16", "amx_bf16") if flag in facts.flags)
        reason = f"CPU has native bf16 matmul ({native})"
        if decode_dtype != "auto" or "decode" not in phases:
            return _with_decode("bfloat16", decode_dtype, reason)
        timing = decode_probe(facts, reprobe=reprobe, timer=decode_timer)
        rows = decode_rows_for_kernels(timing)
        if rows == 0:
            return Precision("bfloat16", "bfloat16", 0, reason + "; decode timed: torch's bf16 matmuls as fast as "
                             "the decode kernels")
        one = timing[min(timing)]
        return Precision("float32", "bfloat16", rows,
                         reason + f"; decode timed: bf16 weights through the decode kernels "
                         f"{one['bfloat16_torch'] / one['bfloat16']:.1f}× faster than torch's bf16 matmul at 1 row, "
                         f"faster up to {rows} rows (the kernels read an fp32 model: weights held in fp32, "
                         "prefills as bf16 GEMMs on bf16 copies)")
    if facts.is_x86:
        prefill, reason = "float32", (f"{facts.capability} CPU without avx512_bf16/amx_bf16: bf16 GEMMs fall back to "
                                      "slow kernels, fp32 for many rows")
    else:
        gflops = (prefill_timer or time_prefill_matmul)()
        prefill = "bfloat16" if gflops["bfloat16"] > 1.05 * gflops["float32"] else "float32"
        reason = (f"{facts.arch} CPU, 256-row matmul timed: fp32 {gflops['float32']:.1f} GFLOP/s, bf16 "
                  f"{gflops['bfloat16']:.1f} GFLOP/s")
    if prefill == "bfloat16" or decode_dtype != "auto" or "decode" not in phases:
        return _with_decode(prefill, decode_dtype, reason)
    timing = decode_probe(facts, reprobe=reprobe, timer=decode_timer)
    rows = decode_rows_for_bf16(timing)
    if rows == 0:
        return Precision(prefill, prefill, 0, reason + "; decode timed: fp32 weights as fast as bf16")
    one = timing[min(timing)]
    return Precision(prefill, "bfloat16", rows,
                     reason + f"; decode timed: bf16 weights {one['float32'] / one['bfloat16']:.1f}× faster at 1 row, "
                     f"faster up to {rows} rows")


def _int8_decode(dtype: str, decode_dtype: str, device: torch.device) -> Precision:
    """`precision.decode: int8`: an fp32 model (what the CPU decode kernels read) whose decode and verify matmuls
    read row-quantized int8 copies of the weights; prefills, precompute and training keep fp32."""

    if device.type != "cpu":
        raise UserError(f"precision.decode: {decode_dtype} runs through the CPU decode kernels; on {device.type} "
                        "use bfloat16 or float16")
    if dtype not in ("auto", "float32"):
        raise UserError(f"precision.decode: {decode_dtype} needs precision.compute float32 or auto (the CPU decode "
                        f"kernels read an fp32 model), not {dtype}")
    if cpu_kernels() is None:
        raise UserError(f"precision.decode: {decode_dtype} runs through the CPU decode kernels, which are "
                        f"unavailable here ({unavailable_reason()})")
    return Precision("float32", decode_dtype, max(PROBE_ROWS), "set in the recipe: weight-only int8 decode weights "
                     "(a scale per row) through the CPU decode kernels, fp32 model", requested=dtype)


def _explicit_rows(dtype: str, decode_dtype: str) -> int:
    """A decode dtype set explicitly (and different from `dtype`) serves every decode and verify of up to 16 rows."""
    return 0 if decode_dtype == dtype else max(PROBE_ROWS)


def _with_decode(dtype: str, decode_dtype: str, reason: str) -> Precision:
    if decode_dtype == "auto" or decode_dtype == dtype:
        return Precision(dtype, dtype, 0, reason)
    return Precision(dtype, decode_dtype, _explicit_rows(dtype, decode_dtype), reason + "; decode dtype as set")
