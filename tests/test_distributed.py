"""The process group of every stage (backend from the stage's device, timeout from the recipe) and the device rule of
tensor collectives, checked on a CPU machine: `init_process_group` is captured instead of run, and a GPU host is
`torch.cuda.is_available` patched to True."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from mtp_train.features.precompute import DistEnv, run_precompute
from mtp_train.recipe import Recipe
from mtp_train.runtime.distributed import all_reduce, all_reduce_host, backend_for, check_collective_device
from mtp_train.runtime.tensor_parallel import TensorParallelGroup, init_distributed


class _Captured(Exception):
    """Raised by the captured initializer: the stage stops where the process group would start."""


@pytest.fixture
def gpu_host(monkeypatch):
    """A machine with CUDA, as far as the backend choice can tell; no process group yet; torchrun's environment of
    rank 0 of 2. Returns the kwargs of every `torch.distributed.init_process_group` call and the devices set."""
    calls: dict[str, list] = {"init": [], "set_device": []}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls["set_device"].append(index))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)

    def init(**kwargs):
        calls["init"].append(kwargs)
    monkeypatch.setattr(dist, "init_process_group", init)
    for key, value in {"RANK": "0", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(key, value)
    return calls


def test_backend_follows_the_stage_device():
    assert backend_for("cuda") == "nccl" and backend_for(torch.device("cuda", 3)) == "nccl"
    assert backend_for("cpu") == "gloo"
    with pytest.raises(ValueError, match="meta"):
        backend_for("meta")


def test_cpu_stage_on_a_gpu_host_takes_gloo_with_the_recipe_timeout(gpu_host):
    assert init_distributed("cpu", timeout_minutes=90) is dist
    assert gpu_host["init"] == [{"backend": "gloo", "timeout": timedelta(minutes=90)}]
    assert gpu_host["set_device"] == []  # a CPU stage takes no GPU


def test_cuda_stage_sets_its_local_gpu_then_takes_nccl(gpu_host):
    init_distributed(torch.device("cuda"), timeout_minutes=5)
    assert gpu_host["set_device"] == [1]
    assert gpu_host["init"] == [{"backend": "nccl", "timeout": timedelta(minutes=5)}]


def test_precompute_of_a_cpu_target_on_a_gpu_host_takes_gloo_and_the_recipe_timeout(gpu_host, monkeypatch,
                                                                                       tmp_path):
    """Before: NCCL whenever CUDA exists (a `target.device: cpu` precompute on a GPU host then reduced CPU tensors over
    NCCL), and torch's 10-minute timeout around rank 0's long manifest work."""
    def init(**kwargs):
        gpu_host["init"].append(kwargs)
        raise _Captured
    monkeypatch.setattr(dist, "init_process_group", init)
    recipe = Recipe(name="dist", target={"device": "cpu"}, distributed={"timeout_minutes": 45},
                    precompute={"output_dir": str(tmp_path / "features")})
    with pytest.raises(_Captured):
        run_precompute(recipe, env=DistEnv(0, 2, 0))
    assert gpu_host["init"] == [{"backend": "gloo", "timeout": timedelta(minutes=45)}]


def test_training_process_group_gets_the_recipe_timeout(gpu_host, monkeypatch):
    """Before: DeepSpeed's 10-minute default whatever the recipe. `target.device: cpu` on a GPU host: gloo."""
    import deepspeed

    from mtp_train.train.trainer import setup

    seen = []

    def init_distributed(**kwargs):
        seen.append(kwargs)
        raise _Captured
    monkeypatch.setattr(deepspeed, "init_distributed", init_distributed)
    with pytest.raises(_Captured):
        setup(Recipe(name="dist", target={"device": "cpu"}, distributed={"timeout_minutes": 30}))
    assert seen == [{"dist_backend": "gloo", "timeout": timedelta(minutes=30), "verbose": False}]
    assert gpu_host["set_device"] == []


def test_timeout_default_is_longer_than_torchs():
    assert Recipe(name="dist").distributed.timeout_minutes == 60
    with pytest.raises(ValueError, match="timeout_minutes"):
        Recipe(name="dist", distributed={"timeout_minutes": 0})


def _backend(monkeypatch, name: str) -> list:
    """Every group's backend is `name`; returns the tensors `torch.distributed.all_reduce` was given."""
    reduced = []
    monkeypatch.setattr(dist, "get_backend", lambda group=None: name)
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, op=None, group=None: reduced.append(tensor))
    return reduced


def test_nccl_collective_refuses_a_cpu_tensor(monkeypatch):
    """NCCL reduces CUDA tensors only: the wrapper names the mismatch before NCCL fails inside the first step."""
    reduced = _backend(monkeypatch, "nccl")
    with pytest.raises(RuntimeError, match="cpu tensor on a nccl process group"):
        all_reduce(torch.ones(3))
    with pytest.raises(RuntimeError, match="cpu tensor on a nccl process group"):
        TensorParallelGroup(size=2, rank=0).all_reduce(torch.ones(3))
    assert reduced == []


def test_gloo_collective_reduces_cpu_tensors_and_refuses_others(monkeypatch):
    reduced = _backend(monkeypatch, "gloo")
    counts = torch.arange(4)
    assert all_reduce(counts) is counts and reduced == [counts]
    check_collective_device(torch.zeros(1))
    with pytest.raises(RuntimeError, match="meta tensor on a gloo process group"):
        check_collective_device(torch.zeros(1, device="meta"))


def test_host_bookkeeping_is_reduced_on_the_backends_device(monkeypatch):
    """`all_reduce_host` hands the backend a tensor on `collective_device()` (under NCCL: the GPU) and returns the
    sums on the CPU."""
    reduced = _backend(monkeypatch, "gloo")
    sums = all_reduce_host(torch.tensor([1.0, 2.0], dtype=torch.float64))
    assert len(reduced) == 1 and reduced[0].device.type == "cpu" and sums.device.type == "cpu"
    assert sums.tolist() == [1.0, 2.0]
