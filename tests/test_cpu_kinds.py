"""Every CPU path tested on every machine that can run it: `MTP_TRAIN_CPU_AS` narrows this CPU to another kind
(mtp_train/cpu_kinds.py), and the tests whose expectations depend on the CPU (marked `cpu_paths`) run again as each
kind this machine can run as, in a subprocess (torch's instruction caps are read when it loads). A kind this machine
cannot run as is skipped with the flags it lacks; the kind it already is, with that said."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mtp_train.cpu_kinds import CPU_KIND_ENV, CPU_KINDS, cpu_kind_env, forced_cpu_kind
from mtp_train.errors import UserError
from mtp_train.runtime import hardware

REPO = Path(__file__).resolve().parent.parent
ZEN4_FLAGS = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl",
                        "avx512_bf16", "avx512_vnni", "avx512vbmi"})
SAPPHIRE_RAPIDS_FLAGS = ZEN4_FLAGS | {"avx512_fp16", "amx_bf16", "amx_tile", "amx_int8", "avx_vnni"}


def _facts_as(monkeypatch, kind: str | None, flags: frozenset[str]) -> hardware.CpuFacts:
    """`cpu_facts()` on a host with `flags`, with `MTP_TRAIN_CPU_AS=kind` (unset for None)."""
    host = hardware.CpuFacts("Intel Xeon", "x86_64", flags, "AVX512", 2, family=6, model_number=143)
    monkeypatch.setattr(hardware, "_host_facts", lambda: host)
    if kind is None:
        monkeypatch.delenv(CPU_KIND_ENV, raising=False)
    else:
        monkeypatch.setenv(CPU_KIND_ENV, kind)
    hardware.cpu_facts.cache_clear()
    try:
        return hardware.cpu_facts()
    finally:
        hardware.cpu_facts.cache_clear()


def test_an_amx_cpu_runs_as_an_avx2_only_one(monkeypatch):
    facts = _facts_as(monkeypatch, "avx2", SAPPHIRE_RAPIDS_FLAGS)
    assert facts.flags == frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"})
    assert not facts.native_bf16 and facts.forced_kind == "avx2"
    assert "run as an AVX2-only CPU" in facts.describe() and f"{CPU_KIND_ENV}=avx2" in facts.describe()


def test_an_amx_cpu_runs_as_a_zen4(monkeypatch):
    facts = _facts_as(monkeypatch, "avx512bf16", SAPPHIRE_RAPIDS_FLAGS)
    assert facts.flags == ZEN4_FLAGS and facts.native_bf16  # avx512_bf16 stays, AMX and avx512_fp16 go


@pytest.mark.parametrize("value", [None, "", "host"])
def test_unset_or_host_keeps_the_cpu_as_it_is(monkeypatch, value):
    facts = _facts_as(monkeypatch, value, SAPPHIRE_RAPIDS_FLAGS)
    assert facts.flags == SAPPHIRE_RAPIDS_FLAGS and facts.forced_kind is None


def test_a_cpu_cannot_run_as_one_with_more_instructions(monkeypatch):
    avx2_only = frozenset({"avx", "avx2", "fma", "f16c"})
    with pytest.raises(UserError, match=r"lacks avx512_bf16, avx512bw, avx512dq, avx512f, avx512vl"):
        _facts_as(monkeypatch, "avx512bf16", avx2_only)


def test_an_unknown_kind_is_refused_with_the_known_ones(monkeypatch):
    with pytest.raises(UserError, match=r"MTP_TRAIN_CPU_AS=zen9: expected host or one of avx2, avx512bf16"):
        _facts_as(monkeypatch, "zen9", SAPPHIRE_RAPIDS_FLAGS)


def test_the_kinds_environment_caps_torch_onednn_and_mkl():
    env = cpu_kind_env("avx2", base={"PATH": "/bin"})
    assert env == {"PATH": "/bin", CPU_KIND_ENV: "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                   "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


@pytest.mark.slow
def test_a_process_run_as_avx2_takes_the_avx2_paths():
    """`mtp-train env` as an AVX2-only CPU: torch's own kernels capped to AVX2 (set by `import mtp_train` before
    torch loads), the flags narrowed, no native bf16, and `auto` resolved as on a Zen 3."""
    import json

    if CPU_KINDS["avx2"].needs - hardware._host_facts().flags:
        pytest.skip("this CPU lacks AVX2/FMA/F16C")
    env = {key: value for key, value in os.environ.items() if key not in dict(CPU_KINDS["avx2"].torch_env)}
    env[CPU_KIND_ENV] = "avx2"
    result = subprocess.run([sys.executable, "-m", "mtp_train", "env", "--json", "--no-measure"], env=env, cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    cpu = json.loads(result.stdout)["cpu"]
    assert cpu["torch_capability"] == "AVX2" and cpu["run_as"] == "avx2" and not cpu["native_bf16"]
    assert not any(flag.startswith(("avx512", "amx")) for flag in cpu["flags"])


def _host_kind_status(kind: str) -> str | None:
    """Why this machine does not run the `cpu_paths` tests as `kind` (None: it does)."""
    host = hardware._host_facts()
    spec = CPU_KINDS[kind]
    missing = sorted(spec.needs - host.flags) if host.is_x86 else ["x86"]
    if missing:
        return (f"the paths of an {spec.example} cannot run on this CPU ({host.describe()}): it lacks "
                f"{', '.join(missing)}")
    if spec.narrow(host.flags) == host.flags:
        return f"this CPU ({host.describe()}) is an {spec.example}: the main run covers its paths"
    return None


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(CPU_KINDS))
def test_the_cpu_dependent_tests_pass_as_every_other_cpu_kind(kind, capsys):
    """The `cpu_paths` tests (precision, decode kernels, runtime parity, greedy speculative output) rerun as `kind`:
    on an AMX Xeon both an AVX2-only CPU's and a Zen 4's paths, on a Zen 4 the AVX2 ones."""
    if forced_cpu_kind() is not None:
        pytest.skip(f"this run is itself {CPU_KIND_ENV}={os.environ[CPU_KIND_ENV]}")
    why_not = _host_kind_status(kind)
    if why_not:
        pytest.skip(why_not)
    command = [sys.executable, "-m", "pytest", "-q", "-m", "cpu_paths", "-p", "no:cacheprovider", "--timeout=900",
               str(REPO / "tests")]
    env = cpu_kind_env(kind)
    env.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    result = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=3000)
    lines = result.stdout.strip().splitlines()
    summary = lines[-1] if lines else ""
    with capsys.disabled():  # the run's outcome in the main run's output, with what it skipped and why
        print(f"\n{CPU_KIND_ENV}={kind}: {summary}")
        for line in lines:
            if line.startswith("SKIPPED"):
                print(f"  as {kind}: {line}")
    assert result.returncode == 0, f"as {kind}:\n{result.stdout[-6000:]}\n{result.stderr[-2000:]}"
    assert " passed" in summary
