"""The default process group of every stage, and tensor collectives on the device of their backend.

One rule for all stages (precompute, train, eval): the backend follows the device the stage computes on, not the
machine. CUDA -> NCCL, after `torch.cuda.set_device(LOCAL_RANK)` so NCCL and the object collectives
(`broadcast_object_list`, `all_gather_object`) use this rank's GPU; CPU -> gloo, also on a GPU host (a `target.device:
cpu` run there must not need NCCL). A stage whose process only coordinates (the vLLM backend: the engines own the
GPUs) asks for gloo by passing the CPU device. The collective timeout is the recipe's `distributed.timeout_minutes`:
torch's 10-minute default is shorter than a barrier while rank 0 verifies a large cache or a rank finishes a long
shard.

NCCL reduces CUDA tensors only and gloo (as we use it) CPU tensors only; `all_reduce` refuses a tensor on the other
device with an error naming both, instead of NCCL's crash at the first step. Host-side bookkeeping (metric sums, token
and flop counts, draft-vocabulary counts) goes through `all_reduce_host`, which copies the tensor to the backend's
device, reduces, and returns it on the CPU: one small copy per call, against a gloo side group that would be one more
communicator to create on every rank (collectively, in the same order) and keep alive for a handful of numbers.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

# The backend a device's tensors are reduced with, and the device type each backend reduces.
BACKEND_OF_DEVICE = {"cuda": "nccl", "cpu": "gloo"}
DEVICE_OF_BACKEND = {"nccl": "cuda", "gloo": "cpu"}


def backend_for(device: torch.device | str) -> str:
    """The backend of a stage computing on `device`: "nccl" for CUDA, "gloo" for the CPU (whatever the machine has)."""
    device_type = torch.device(device).type
    if device_type not in BACKEND_OF_DEVICE:
        raise ValueError(f"no process-group backend for device {device_type!r}; expected cuda or cpu")
    return BACKEND_OF_DEVICE[device_type]


def init_process_group(device: torch.device | str, timeout_minutes: float,
                       init: Callable[[str, timedelta], None] | None = None) -> str:
    """Initialize the default process group for a stage on `device` (if not already), with collectives timing out
    after `timeout_minutes`; returns the group's backend. `init(backend, timeout)` replaces
    `torch.distributed.init_process_group` where a library wraps it (DeepSpeed's `init_distributed`). Reads the
    torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT)."""
    if dist.is_initialized():
        return dist.get_backend()
    backend = backend_for(device)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    timeout = timedelta(minutes=timeout_minutes)
    if init is None:
        dist.init_process_group(backend=backend, timeout=timeout)
    else:
        init(backend, timeout)
    return backend


def collective_device(group=None) -> torch.device:
    """The device whose tensors `group`'s backend reduces (NCCL: this rank's current GPU; gloo: the CPU)."""
    backend = str(dist.get_backend(group))
    if backend not in DEVICE_OF_BACKEND:
        raise RuntimeError(f"process-group backend {backend!r} is none of {', '.join(DEVICE_OF_BACKEND)}")
    if DEVICE_OF_BACKEND[backend] == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_collective_device(tensor: torch.Tensor, group=None) -> None:
    """Raise when `tensor` is not on the device type `group`'s backend reduces (a CPU tensor under NCCL, a CUDA
    tensor under gloo)."""
    backend = str(dist.get_backend(group))
    expected = DEVICE_OF_BACKEND.get(backend)
    if expected is not None and tensor.device.type != expected:
        raise RuntimeError(
            f"all_reduce: a {tensor.device.type} tensor on a {backend} process group, which reduces {expected} "
            f"tensors; move it with .to(collective_device()) or reduce it through all_reduce_host"
        )


def all_reduce(tensor: torch.Tensor, group=None, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Reduce `tensor` over `group` in place (sum by default); returns it. The tensor must be on the backend's
    device (`check_collective_device`)."""
    check_collective_device(tensor, group)
    dist.all_reduce(tensor, op=op, group=group)
    return tensor


def all_reduce_host(tensor: torch.Tensor, group=None, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """The reduction of a host tensor (bookkeeping: sums, counts) over `group`, returned on the CPU: reduced on the
    backend's device, so it works under NCCL as under gloo."""
    on_device = tensor.to(collective_device(group))
    all_reduce(on_device, group=group, op=op)
    return on_device.cpu()
