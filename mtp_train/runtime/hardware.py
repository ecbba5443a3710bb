"""What the machine really has: CPU model and the flags that decide matmul speed, CUDA devices, and two measured
ceilings (matmul GFLOP/s per dtype, memory read bandwidth) that a stage's speed can be judged by.

`CpuFacts` is read once per process from /proc/cpuinfo and torch, narrowed to another CPU kind where
`MTP_TRAIN_CPU_AS` names one (`cpu_kinds.py`); `measure_*` time small kernels for a fraction of a
second (`mtp-train env`, the dtype probe of `precision.py`, the fraction-of-peak figures of
scripts/bench_precompute.py and bench_train.py; the stages themselves run no probe).
"""

from __future__ import annotations

import os
import platform
import re
import time
from dataclasses import dataclass, field, replace
from functools import lru_cache

import torch

from mtp_train.errors import UserError
from mtp_train.cpu_kinds import CPU_KIND_ENV, forced_cpu_kind, run_as_note

# Flags that give a CPU native bf16 matmul (oneDNN then runs bf16 GEMMs at or above fp32 speed).
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# Flags worth printing in `mtp-train env` (the ones that change which kernels run).
REPORTED_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_bf16",
                  "amx_tile", "avx_vnni", "asimd", "sve", "bf16")


@dataclass(frozen=True)
class CpuFacts:
    model: str
    arch: str
    flags: frozenset[str] = field(default_factory=frozenset)
    capability: str = "unknown"  # torch.backends.cpu.get_cpu_capability(): DEFAULT, AVX2, AVX512, ...
    cores: int = 1
    family: int | None = None  # x86 /proc/cpuinfo `cpu family` and `model` (a VM's model name may say only
    model_number: int | None = None  # "AMD EPYC": these tell a Zen 3 from a Zen 4)
    forced_kind: str | None = None  # the `CpuKind` this CPU runs as (`MTP_TRAIN_CPU_AS`), None: as itself

    @property
    def generation(self) -> str | None:
        """The core generation where the family/model numbers name one for sure (AMD Zen 2-5), else None."""
        return cpu_generation(self.model, self.family, self.model_number)

    def detail(self) -> str:
        """What the model name lacks to tell this CPU apart: its generation (`Zen 3`), else its family/model numbers
        (`family 6 model 143`); empty where the name says it already or the numbers are unknown."""
        if self.family is None or self.model_number is None:
            return ""
        detail = self.generation or f"family {self.family} model {self.model_number}"
        return "" if detail in self.model else detail

    def describe(self) -> str:
        """The model name with `detail()`, e.g. `AMD EPYC (Zen 3)`, and the kind it runs as where forced."""
        detail = self.detail()
        text = f"{self.model} ({detail})" if detail else self.model
        return f"{text}, {run_as_note(self.forced_kind)}" if self.forced_kind else text

    @property
    def native_bf16(self) -> bool:
        """True when the CPU multiplies bf16 matrices in hardware (AVX512-BF16 or AMX on x86)."""
        return any(flag in self.flags for flag in NATIVE_BF16_FLAGS)

    @property
    def is_x86(self) -> bool:
        return self.arch in ("x86_64", "amd64", "i686")

    def reported_flags(self) -> list[str]:
        return [flag for flag in REPORTED_FLAGS if flag in self.flags]


# AMD's core generation by (cpu family, model range), as the Linux kernel's arch/x86/kernel/cpu/amd.c tells them.
_AMD_GENERATIONS = (
    (0x17, range(0x00, 0x30), "Zen/Zen+"),
    (0x17, range(0x30, 0x100), "Zen 2"),
    (0x19, range(0x00, 0x10), "Zen 3"),
    (0x19, range(0x10, 0x20), "Zen 4"),
    (0x19, range(0x20, 0x60), "Zen 3"),
    (0x19, range(0x60, 0x80), "Zen 4"),
    (0x19, range(0xA0, 0xB0), "Zen 4"),
    (0x1A, range(0x00, 0x100), "Zen 5"),
)


def cpu_generation(model_name: str, family: int | None, model_number: int | None) -> str | None:
    """`Zen 3` for an AMD CPU of family 0x19 model 0x01, etc.; None where the numbers name no generation here
    (other vendors: their family/model numbers are reported as they are)."""
    if family is None or model_number is None or "AMD" not in model_name.upper():
        return None
    for fam, models, name in _AMD_GENERATIONS:
        if family == fam and model_number in models:
            return name
    return None


def _read_cpuinfo(path: str = "/proc/cpuinfo") -> tuple[str, frozenset[str], int | None, int | None]:
    """(model name, flags, cpu family, model number) of the first processor in /proc/cpuinfo."""
    model, flags, family, model_number = "", frozenset(), None, None
    try:
        with open(path, encoding="utf-8", errors="replace") as stream:
            for line in stream:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key in ("model name", "hardware", "cpu model") and not model:
                    model = value.strip()
                elif key in ("flags", "features") and not flags:
                    flags = frozenset(value.split())
                elif key == "cpu family" and family is None and value.strip().isdigit():
                    family = int(value)
                elif key == "model" and model_number is None and value.strip().isdigit():
                    model_number = int(value)
    except OSError:
        pass
    return model, flags, family, model_number


def _host_facts() -> CpuFacts:
    model, flags, family, model_number = _read_cpuinfo()
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except Exception:  # older torch
        capability = "unknown"
    return CpuFacts(model=model or platform.processor() or "unknown", arch=platform.machine().lower(),
                    flags=flags, capability=capability, cores=os.cpu_count() or 1, family=family,
                    model_number=model_number)


@lru_cache(maxsize=1)
def cpu_facts() -> CpuFacts:
    """This CPU's facts, narrowed to the kind `MTP_TRAIN_CPU_AS` names (refused where the CPU lacks that kind's
    flags: a CPU can only run as one with fewer instructions)."""
    facts = _host_facts()
    try:
        kind = forced_cpu_kind()
    except ValueError as err:
        raise UserError(str(err)) from None
    if kind is None:
        return facts
    missing = sorted(kind.needs - facts.flags) if facts.is_x86 else sorted(kind.needs)
    if missing:
        raise UserError(f"{CPU_KIND_ENV}={kind.name}: this CPU ({facts.describe()}) lacks {', '.join(missing)}, so it "
                        f"cannot run as an {kind.example}")
    return replace(facts, flags=kind.narrow(facts.flags), forced_kind=kind.name)


@dataclass(frozen=True)
class CudaDevice:
    index: int
    name: str
    memory_gib: float
    capability: tuple[int, int]
    bf16: bool


def cuda_devices() -> list[CudaDevice]:
    if not torch.cuda.is_available():
        return []
    devices = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        devices.append(CudaDevice(index, props.name, props.total_memory / 2**30, (props.major, props.minor),
                                  bool(torch.cuda.is_bf16_supported())))
    return devices


def best_seconds(fn, budget_s: float, min_calls: int = 3) -> float:
    """Best-of seconds per call of `fn` within about `budget_s`, over at least `min_calls` timed calls (two warm-up
    calls first)."""
    fn()
    fn()
    best = float("inf")
    deadline = time.perf_counter() + budget_s
    calls = 0
    while True:
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
        calls += 1
        if calls >= min_calls and time.perf_counter() >= deadline:
            return best


def measure_matmul_gflops(dtype: torch.dtype, rows: int = 256, inner: int = 1024, cols: int = 2048,
                          budget_s: float = 0.3, device: str | torch.device = "cpu") -> float:
    """GFLOP/s of `[rows, inner] @ [inner, cols]` in `dtype` (the many-row matmul of prefill and training)."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(rows, inner, generator=generator).to(device=device, dtype=dtype)
    b = torch.randn(cols, inner, generator=generator).to(device=device, dtype=dtype)

    def call() -> None:
        torch.nn.functional.linear(a, b)
        if a.device.type == "cuda":
            torch.cuda.synchronize()

    return 2 * rows * inner * cols / best_seconds(call, budget_s) / 1e9


def measure_read_bandwidth_gbs(megabytes: int = 256, budget_s: float = 0.3) -> float:
    """GB/s of reading a buffer much larger than the caches (a sum over it), with the current threads."""
    buffer = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32)
    return buffer.numel() * 4 / best_seconds(buffer.sum, budget_s) / 1e9


def blas_summary() -> str:
    """torch's BLAS and oneDNN builds in a few words (from `torch.__config__.show()`), e.g. `MKL 2024.2; oneDNN 3.12.0`."""
    config = torch.__config__.show()
    parts = []
    mkl = re.search(r"Math Kernel Library Version ([0-9.]+)", config)
    if mkl:
        parts.append(f"MKL {mkl.group(1)}")
    onednn = re.search(r"(?:MKL-DNN|oneDNN) v?([0-9][0-9.]*)", config)
    if onednn:
        parts.append(f"oneDNN {onednn.group(1)}")
    blas = re.search(r"BLAS_INFO=([A-Za-z0-9_]+)", config)
    if blas and not mkl:
        parts.append(f"BLAS {blas.group(1)}")
    return "; ".join(parts) or "unknown"


def machine_fields(compute_dtype: str) -> str:
    """`key=value` fields naming the machine for a benchmark's `RESULT` line: torch's CPU capability (or the CUDA
    device), the CPU model, its family/model numbers and generation where known, and the compute dtype the figures
    were measured in."""
    facts = cpu_facts()
    fields = [f"cpu_capability={facts.capability}", f"cpu={facts.model.replace(' ', '_') or 'unknown'}"]
    if facts.family is not None and facts.model_number is not None:
        fields.append(f"cpu_family={facts.family} cpu_model={facts.model_number}")
    if facts.generation:
        fields.append(f"cpu_generation={facts.generation.replace(' ', '_')}")
    fields.append(f"native_bf16={int(facts.native_bf16)}")
    if facts.forced_kind:
        fields.append(f"cpu_as={facts.forced_kind}")
    if torch.cuda.is_available():
        fields.append(f"cuda={torch.cuda.get_device_name(0).replace(' ', '_')}")
    fields.append(f"compute_dtype={compute_dtype}")
    return " ".join(fields)


def machine_name(device: torch.device | None = None) -> str:
    """The machine in a few words for reports: the CUDA device, or torch's CPU capability and the CPU model."""
    if device is not None and device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    facts = cpu_facts()
    detail = facts.detail()
    forced = f", as {facts.forced_kind}" if facts.forced_kind else ""
    return f"{facts.capability} ({facts.model}{', ' + detail if detail else ''}{forced})"
