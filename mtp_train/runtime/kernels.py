"""The CPU decode kernels (`csrc/cpu_kernels.cpp`): built once per machine with torch's C++ extension loader (g++ and
ninja, ~30 s), cached in torch's extension directory, registered as `torch.ops.mtp_cpu.*`.

`cpu_kernels()` returns the op namespace, or None where they cannot be built (no compiler, `MTP_TRAIN_CPU_KERNELS=0`):
the runtime then decodes through the plain torch path, with a warning saying why. The build follows the CPU's flags
(`avx512bf16`, `avx512`, `avx2`, `generic`); `MTP_TRAIN_CPU_KERNELS=<variant>` forces one (e.g. `avx2` on an AVX-512
machine, to measure what an AVX2-only CPU runs). In the `avx512bf16` build bf16 decode weights meet bf16-rounded
activations in `vdpbf16ps` (fp32 accumulation); `MTP_TRAIN_CPU_BF16_ACTIVATIONS=0` keeps them fp32.

Both variables are developer switches, for benchmarks and for the tests of the builds a machine does not pick by
itself, not recipe keys: they choose which build of the same decode path runs on one machine (its instruction set),
not a precision a run declares; the dtypes a run decodes in are the recipe's `precision` section.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"
ENV_SWITCH = "MTP_TRAIN_CPU_KERNELS"
_state: dict = {}


_AVX2 = ["-O3", "-fopenmp", "-mavx2", "-mfma", "-mf16c"]
_AVX512 = _AVX2 + ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl"]
# variant -> (CPU flags it needs, compiler flags), best first
VARIANTS = {
    "avx512bf16": ({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16"},
                   _AVX512 + ["-mavx512bf16"]),
    "avx512": ({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl"}, _AVX512),
    "avx2": ({"avx2", "fma", "f16c"}, _AVX2),
    "generic": (set(), ["-O3", "-fopenmp"]),
}


def _build_flags() -> tuple[str, list[str]]:
    """(variant, compiler flags): the best build this CPU's flags allow (AVX-512 with BF16, AVX-512, AVX2 + FMA,
    portable code), or the one `MTP_TRAIN_CPU_KERNELS=<variant>` asks for (e.g. `avx2` on an AVX-512 machine, to
    measure the path an AVX2-only CPU takes). The variant is part of the extension's name, so a cache shared by
    machines of different kinds never loads the wrong build. `-fopenmp` compiles ATen's inline `parallel_for` to
    OpenMP; the `libgomp.so.1` it links resolves to the one torch has loaded already, so the kernels share torch's
    thread pool (no second runtime competing for the cores)."""
    from mtp_train.runtime.hardware import cpu_facts

    facts = cpu_facts()
    cpu_flags = set(facts.flags) if facts.is_x86 else set()
    usable = [name for name, (needs, _) in VARIANTS.items() if needs <= cpu_flags]
    requested = os.environ.get(ENV_SWITCH, "1")
    if requested in VARIANTS:
        if requested not in usable:
            missing = sorted(VARIANTS[requested][0] - cpu_flags)
            raise RuntimeError(f"{ENV_SWITCH}={requested}: this CPU lacks {', '.join(missing)}")
        return requested, VARIANTS[requested][1]
    return usable[0], VARIANTS[usable[0]][1]


def _ensure_ninja_on_path() -> None:
    """torch's extension builder runs `ninja` from PATH; an unactivated virtualenv has the `ninja` wheel's binary
    only in its own bin directory."""
    if shutil.which("ninja"):
        return
    candidates = [str(Path(sys.executable).parent)]
    try:
        import ninja

        candidates.insert(0, ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    os.environ["PATH"] = os.pathsep.join(candidates + [os.environ.get("PATH", "")])


# A build of the kernels takes tens of seconds; torch's loader holds a `lock` file in the build directory
# meanwhile and every other loader waits for it to go, forever. A build killed midway (Ctrl-C during the first run,
# a killed job) leaves it behind: a lock with nothing in its directory written for this long is taken for such a
# leftover and removed.
STALE_LOCK_SECONDS = 300.0


def _clear_stale_build_lock(build_dir: Path, stale_after_s: float = STALE_LOCK_SECONDS, poll_s: float = 1.0,
                            clock=time.time, sleep=time.sleep) -> None:
    """Wait while another process builds the kernels (its `lock` in `build_dir`, files still being written); remove
    the lock once nothing in the directory has been written for `stale_after_s` (a build that was killed)."""
    lock = build_dir / "lock"
    announced = False
    while lock.exists():
        try:
            last_write = max(entry.stat().st_mtime for entry in build_dir.iterdir())
        except (OSError, ValueError):  # the build finished (or the directory went) between the calls
            sleep(poll_s)
            continue
        idle_s = clock() - last_write
        if idle_s >= stale_after_s:
            log.warning("removing a stale build lock of the CPU decode kernels (%s: nothing written there for %.0f s; "
                        "a build was interrupted)", lock, idle_s)
            lock.unlink(missing_ok=True)
            return
        if not announced:
            print(f"waiting for another process building the CPU decode kernels ({lock}; a lock left by an "
                  f"interrupted build is removed after {stale_after_s:.0f} s without progress)", file=sys.stderr,
                  flush=True)
            announced = True
        sleep(poll_s)


def cpu_kernels():
    """`torch.ops.mtp_cpu` once built and loaded; None when unavailable (the reason is in `unavailable_reason()`)."""
    if "ops" in _state:
        return _state["ops"]
    _state["ops"] = None
    if os.environ.get(ENV_SWITCH, "1") == "0":
        _state["reason"] = f"{ENV_SWITCH}=0"
        return None
    start = time.perf_counter()
    try:
        variant, flags = _build_flags()
        name = f"mtp_cpu_kernels_{variant}"
        from torch.utils.cpp_extension import _get_build_directory, load

        _ensure_ninja_on_path()
        build_dir = Path(_get_build_directory(name, False))
        _clear_stale_build_lock(build_dir)
        if not (build_dir / f"{name}.so").is_file():
            print(f"building the CPU decode kernels ({SOURCE.name}, {variant}; once per machine, ~30 s)",
                  file=sys.stderr, flush=True)

        load(name=name, sources=[str(SOURCE)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
             is_python_module=False, verbose=False)
    except Exception as err:  # no compiler, no ninja, a read-only cache: decode still works, only slower
        _state["reason"] = f"could not build {SOURCE.name}: {str(err).strip().splitlines()[-1] if str(err) else err!r}"
        log.warning("CPU decode kernels unavailable (%s); decoding through the plain torch path", _state["reason"])
        return None
    _state["ops"] = torch.ops.mtp_cpu
    _state["variant"] = variant
    _state["load_seconds"] = time.perf_counter() - start
    return _state["ops"]


def kernels_variant() -> str | None:
    """The loaded build's variant (`avx512bf16`, `avx512`, `avx2`, `generic`), None when none is loaded."""
    return _state.get("variant") if cpu_kernels() is not None else None


def unavailable_reason() -> str | None:
    return _state.get("reason")


def kernels_summary() -> str:
    """One line for `mtp-train env`: which build is loaded and how long loading (or building) took."""
    ops = cpu_kernels()
    if ops is None:
        return f"unavailable ({unavailable_reason()})"
    activations = "; bf16 weights meet bf16 activations (vdpbf16ps)" if ops.bf16_activations() else ""
    return f"mtp_cpu ({_state['variant']}{activations}), loaded in {_state['load_seconds']:.1f} s"
