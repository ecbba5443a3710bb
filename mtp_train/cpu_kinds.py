"""Running as another kind of CPU: `MTP_TRAIN_CPU_AS=avx2` makes an AVX-512/AMX machine take every path an AVX2-only
CPU takes, so one machine can test (and time) the paths of the others.

These machines come as AVX2-only x86 (AMD EPYC Zen 3), AVX-512 with avx512_bf16 (Zen 4) and AVX-512 with AMX (Intel
Xeon). What the code does on each keys on the CPU's flags (`hardware.CpuFacts`): what `precision.compute: auto` picks,
which build of the decode kernels loads, whether the GEMMs above the decode rows run in bf16. A kind narrows the
flags the code sees and caps the instructions torch's own kernels (`ATEN_CPU_CAPABILITY`), oneDNN
(`ONEDNN_MAX_CPU_ISA`) and MKL (`MKL_ENABLE_INSTRUCTIONS`) use; those three are read when torch loads, so this module
imports nothing heavy and `mtp_train/__init__.py` applies them before anything imports torch. A CPU can run as a
kind with fewer instructions only: the kind's `needs` must be among its flags.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

CPU_KIND_ENV = "MTP_TRAIN_CPU_AS"


@dataclass(frozen=True)
class CpuKind:
    name: str
    example: str  # the machine of this kind the project runs on
    needs: frozenset[str]  # /proc/cpuinfo flags the host must have to run as this kind
    drops: tuple[str, ...]  # prefixes of the flags this kind lacks
    torch_env: tuple[tuple[str, str], ...]  # instruction caps for torch, oneDNN and MKL

    def narrow(self, flags: frozenset[str]) -> frozenset[str]:
        return frozenset(flag for flag in flags if not flag.startswith(self.drops))


_AVX2 = frozenset({"avx2", "fma", "f16c"})
CPU_KINDS = {
    "avx2": CpuKind("avx2", "AVX2-only CPU (AMD EPYC Zen 3)", _AVX2,
                    ("avx512", "amx", "avx_vnni", "avx_ne_convert", "avx_ifma", "avx10"),
                    (("ATEN_CPU_CAPABILITY", "avx2"), ("ONEDNN_MAX_CPU_ISA", "AVX2"),
                     ("MKL_ENABLE_INSTRUCTIONS", "AVX2"))),
    "avx512bf16": CpuKind("avx512bf16", "AVX-512 CPU with avx512_bf16 and no AMX (AMD EPYC Zen 4)",
                          _AVX2 | {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16"},
                          ("amx", "avx512_fp16", "avx_vnni", "avx_ne_convert", "avx10"),
                          (("ATEN_CPU_CAPABILITY", "avx512"), ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16"),
                           ("MKL_ENABLE_INSTRUCTIONS", "AVX512"))),
}


def forced_cpu_kind() -> CpuKind | None:
    """The kind `MTP_TRAIN_CPU_AS` names; None when it is unset, empty or `host`. Any other name raises ValueError."""
    name = os.environ.get(CPU_KIND_ENV, "").strip()
    if name in ("", "host"):
        return None
    if name not in CPU_KINDS:
        raise ValueError(f"{CPU_KIND_ENV}={name}: expected host or one of {', '.join(CPU_KINDS)}")
    return CPU_KINDS[name]


def run_as_note(kind: str) -> str:
    """`run as an AVX2-only CPU (AMD EPYC Zen 3) by MTP_TRAIN_CPU_AS=avx2`, for reports."""
    return f"run as an {CPU_KINDS[kind].example} by {CPU_KIND_ENV}={kind}"


def cpu_kind_env(kind: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a process that runs as `kind` (from `base`, os.environ by default): `MTP_TRAIN_CPU_AS`
    and the instruction caps, which a process must have before it loads torch."""
    env = dict(os.environ if base is None else base)
    env[CPU_KIND_ENV] = kind
    env.update(dict(CPU_KINDS[kind].torch_env))
    return env


def apply_cpu_kind_env() -> None:
    """Set the instruction caps of the kind `MTP_TRAIN_CPU_AS` names, where not set already. Effective only before
    torch loads; after that `hardware.cpu_facts` still narrows the flags and reports the capability torch runs with."""
    try:
        kind = forced_cpu_kind()
    except ValueError:
        return  # refused with its message where the facts are read
    if kind is not None:
        for key, value in kind.torch_env:
            os.environ.setdefault(key, value)
