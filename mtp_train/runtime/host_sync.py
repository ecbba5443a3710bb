"""Host↔device traffic of the decode loop: `to_device`, the one way its host-built metadata goes to the device, and
`count_host_syncs`, which counts the calls that make the host wait for the device.

On CUDA kernels run asynchronously: the host queues a forward and goes on building the next batch's metadata until
it reads a result. Every read of a device tensor (`.item()`, `.tolist()`, `.cpu()`, `bool(t)`, `int(t)`, ...) and
every blocking host→device copy (`torch.tensor(list, device=...)`, `t.to(device)` without `non_blocking`) waits for
the queue to drain, so a speculative step should have as few as its algorithm needs (one: the accepted lengths and
tokens of the whole batch).

`count_host_syncs` counts those calls on any device, the CPU included (where nothing waits), so a CPU test can pin
how many a step makes: a call counts when it is made from this package's code (torch's own internals are not
counted), whatever the tensor's device — a read of a tensor that stays on the host is written as a Python list
instead, so that every counted read is one that waits on CUDA. On a GPU, run the same loop under
`torch.cuda.set_sync_debug_mode("warn")` as well: torch then warns at each synchronizing call it knows of, which
also names those inside torch and in kernels' wrappers; the counter's `sites` say which of ours they are::

    torch.cuda.set_sync_debug_mode("warn")
    with count_host_syncs() as syncs:
        speculative_generate(target, head, prompts, max_new_tokens)
    print(syncs.count, syncs.sites.most_common())
    torch.cuda.set_sync_debug_mode("default")
"""

from __future__ import annotations

import sys
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

_PACKAGE_DIR = str(Path(__file__).resolve().parents[1])  # .../mtp_train

# Tensor methods that read a tensor's values on the host.
_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


def to_device(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A host list as a tensor on `device` without waiting for the device: on CUDA through pinned memory and a
    non-blocking copy queued on the current stream (torch keeps the pinned buffer until the copy has run); elsewhere
    the tensor itself."""
    if torch.device(device).type != "cuda":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def host_tensor_to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device` without waiting for the device (on CUDA through pinned memory, as `to_device`)."""
    device = torch.device(device)
    if device.type == "cpu" and tensor.device.type == "cpu":
        return tensor
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


class HostSyncs:
    """What `count_host_syncs` saw: `count` calls, `sites` by "file:line function kind" (file relative to the
    counted folder)."""

    def __init__(self, within: str) -> None:
        self.within = within
        self.count = 0
        self.sites: Counter[str] = Counter()

    def record(self, kind: str) -> None:
        frame = sys._getframe(2)  # the caller of the patched function
        filename = frame.f_code.co_filename
        if not filename.startswith(self.within):
            return
        self.count += 1
        where = filename[len(self.within):].lstrip("/\\")
        self.sites[f"{where}:{frame.f_lineno} {frame.f_code.co_qualname} {kind}"] += 1


def _passes_device(args: tuple, kwargs: dict) -> bool:
    """Whether a `Tensor.to(...)` call names a device and does not ask for a non-blocking copy."""
    if kwargs.get("non_blocking") or any(a is True for a in args):
        return False
    return kwargs.get("device") is not None or any(isinstance(a, (str, torch.device)) for a in args)


@contextmanager
def count_host_syncs(within: str | Path = _PACKAGE_DIR) -> Iterator[HostSyncs]:
    """Count, while inside, the calls made from code under the folder `within` (default: this package) that wait
    for the device on CUDA (see the module docstring): the `Tensor` reads `.item .tolist .cpu .numpy` and
    `bool/int/float/index` conversions, `torch.tensor` / `torch.as_tensor` with a `device`, and `Tensor.to` naming a
    device without `non_blocking=True`. Not thread-safe (it patches `torch.Tensor` and `torch` for the duration)."""
    syncs = HostSyncs(str(Path(within).resolve()))
    originals = {name: getattr(torch.Tensor, name) for name in (*_READS, "to")}
    factories = {name: getattr(torch, name) for name in ("tensor", "as_tensor")}

    def read(name):
        original = originals[name]

        def counted(self, *args, **kwargs):
            syncs.record(name)
            return original(self, *args, **kwargs)
        return counted

    def to(self, *args, **kwargs):
        if _passes_device((self, *args), kwargs):
            syncs.record("to(device)")
        return originals["to"](self, *args, **kwargs)

    def factory(name):
        original = factories[name]

        def counted(*args, **kwargs):
            if kwargs.get("device") is not None:
                syncs.record(f"{name}(device=)")
            return original(*args, **kwargs)
        return counted

    try:
        for name in _READS:
            setattr(torch.Tensor, name, read(name))
        torch.Tensor.to = to
        for name in factories:
            setattr(torch, name, factory(name))
        yield syncs
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        for name, original in factories.items():
            setattr(torch, name, original)
