"""The facts a bug report or a speed figure needs (`mtp-train env` prints them) (as `accelerate env`, `ds_report` and
`vllm collect-env` give them): package versions, CPU model and the flags that decide matmul speed, torch's CPU
capability and BLAS/oneDNN build, threads, CUDA devices, what `target.dtype: auto` resolves to and why, whether the CPU
decode kernels are built, and two ceilings
measured in about two seconds: matmul GFLOP/s in fp32 and bf16, and memory read bandwidth."""

from __future__ import annotations

import os
import platform
import re
import sys
from importlib import metadata

import torch

from mtp_train.cpu_kinds import run_as_note
from mtp_train.errors import UserError
from mtp_train.runtime.hardware import (
    blas_summary,
    cpu_facts,
    cuda_devices,
    measure_matmul_gflops,
    measure_read_bandwidth_gbs,
)
from mtp_train.runtime.kernels import kernels_summary
from mtp_train.runtime.precision import resolve_precision

# The oldest torch the package runs on (pyproject.toml's floor, and the Makefile's TORCH_SPEC note for GPU users):
# scaled_dot_product_attention's `enable_gqa` (2.5) in runtime/attention.py, and resuming a checkpoint loads
# DeepSpeed's files weights-only with `torch.serialization.safe_globals` and names what a refused file needs with
# `get_unsafe_globals_in_checkpoint` (train/checkpoints.py), the weights-only loading that 2.6 made torch.load's
# default and the one this package's checkpoints are checked with.
TORCH_FLOOR = (2, 6)


def check_torch_version(version: str) -> None:
    """Refuse a torch older than TORCH_FLOOR (`version` as torch.__version__ gives it, e.g. "2.5.1+cu124"), saying
    what to install; a torch installed before this package (a CUDA build) is not upgraded by pip's range."""
    match = re.match(r"(\d+)\.(\d+)", str(version))
    if match is None or (int(match[1]), int(match[2])) < TORCH_FLOOR:
        floor = ".".join(map(str, TORCH_FLOOR))
        raise UserError(f"torch {version} is older than {floor}, which mtp-train needs (scaled_dot_product_attention's "
                        f"enable_gqa, weights-only checkpoint loading with safe_globals); install torch>={floor}: "
                        f"`make setup TORCH_SPEC='torch>={floor}'`, or your CUDA build with `pip install "
                        f"'torch>={floor}' --index-url https://download.pytorch.org/whl/<cuda tag>`")


PACKAGES = ("mtp_train", "torch", "transformers", "deepspeed", "datasets", "safetensors", "accelerate",
            "flashinfer-python", "wandb")


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def collect_env(measure: bool = True, reprobe: bool = False) -> dict:
    """The facts `mtp-train env` prints; refuses a torch older than TORCH_FLOOR first."""
    check_torch_version(torch.__version__)
    facts = cpu_facts()
    devices = cuda_devices()
    device = torch.device("cuda" if devices else "cpu")
    precision = resolve_precision("auto", "auto", device, reprobe=reprobe)
    env = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": {name: _version(name) for name in PACKAGES},
        "cpu": {
            "model": facts.model, "generation": facts.generation, "family": facts.family,
            "model_number": facts.model_number,
            "arch": facts.arch, "cores": facts.cores, "flags": facts.reported_flags(), "native_bf16": facts.native_bf16,
            "torch_capability": facts.capability, "blas": blas_summary(), "run_as": facts.forced_kind,
        },
        "threads": {"torch": torch.get_num_threads(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")},
        "cuda": [{"index": d.index, "name": d.name, "memory_gib": round(d.memory_gib, 1),
                  "capability": ".".join(map(str, d.capability)), "bf16": d.bf16} for d in devices],
        "auto": {"device": device.type, **precision.as_dict()},
        "decode_kernels": kernels_summary() if device.type == "cpu" else "not used on CUDA",
    }
    if measure:
        env["measured"] = {
            "matmul_gflops": {name: round(measure_matmul_gflops(dtype, device=device), 1)
                              for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16))},
            "matmul_shape": "[256, 1024] @ [1024, 2048]",
            "read_bandwidth_gbs": round(measure_read_bandwidth_gbs(), 1) if device.type == "cpu" else None,
        }
    return env


def format_env(env: dict) -> str:
    cpu, auto = env["cpu"], env["auto"]
    lines = [
        f"mtp_train {env['packages']['mtp_train']}   python {env['python']}   {env['platform']}",
        "packages:   " + ", ".join(f"{k} {v}" for k, v in env["packages"].items() if k != "mtp_train"),
        f"cpu:        {cpu['model']}" + (f" ({cpu['generation']})" if cpu.get("generation") else "")
        + f", {cpu['arch']}, {cpu['cores']} cores"
        + (f" (cpu family {cpu['family']}, model {cpu['model_number']})" if cpu.get("family") is not None else ""),
        f"cpu flags:  {' '.join(cpu['flags']) or '-'}; native bf16 matmul: {'yes' if cpu['native_bf16'] else 'no'}",
        *([f"            {run_as_note(cpu['run_as'])}: the flags above are narrowed to it"] if cpu.get("run_as") else []),
        f"torch cpu:  capability {cpu['torch_capability']}; {cpu['blas']}",
        f"threads:    torch {env['threads']['torch']} (OMP_NUM_THREADS={env['threads']['OMP_NUM_THREADS'] or 'unset'})",
        "cuda:       " + ("; ".join(f"{d['index']}: {d['name']}, {d['memory_gib']} GiB, sm {d['capability']}, "
                                    f"bf16 {'yes' if d['bf16'] else 'no'}" for d in env["cuda"]) or "none"),
        f"auto dtype: compute {auto['dtype']}, decode weights {auto['decode_dtype']}"
        + (f" (≤ {auto['decode_max_rows']} rows)" if auto["decode_dtype"] != auto["dtype"] else "")
        + f", K/V cache {auto.get('kv_cache_dtype') or auto['dtype']} on {auto['device']}",
        f"  because:  {auto['reason']}",
        f"decode kernels: {env['decode_kernels']}",
    ]
    measured = env.get("measured")
    if measured:
        mm = measured["matmul_gflops"]
        lines.append(f"measured:   matmul {measured['matmul_shape']}: fp32 {mm['float32']} GFLOP/s, bf16 "
                     f"{mm['bfloat16']} GFLOP/s (fp32/bf16 {mm['float32'] / max(mm['bfloat16'], 1e-9):.1f}×)")
        if measured["read_bandwidth_gbs"] is not None:
            lines.append(f"            memory read bandwidth {measured['read_bandwidth_gbs']} GB/s")
    return "\n".join(lines)
