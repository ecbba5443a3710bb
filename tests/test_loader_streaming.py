"""The loaders stream: `load_model` and `load_model_tensor_parallel` read one tensor (or one rank's slice) at a time,
convert it onto its device and drop the host copy before reading the next, so host memory never holds the model; the
weights they load are bit for bit the checkpoint's tensors (or the rank's slices of them) in the requested dtype, as
the loaders that first built a whole host state dict gave."""

from __future__ import annotations

import weakref

import pytest
import torch
from safetensors.torch import load_file

import mtp_train.runtime.loader as loader_module
import mtp_train.runtime.tensor_parallel as tp_module
from mtp_train.errors import UserError
from mtp_train.runtime.loader import load_model
from mtp_train.runtime.tensor_parallel import TensorParallelGroup, load_model_tensor_parallel, shard_model
from tests.tiny_models import save_tiny_model

MODELS = {  # name -> (model_type, overrides)
    "llama": ("llama", {}),
    "llama_tied": ("llama", {"tie_word_embeddings": True}),
    "qwen2_bias": ("qwen2", {"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 96,
                             "intermediate_size": 100}),  # q/k/v biases; KV groups and MLP columns split unevenly
}


class HostCopies:
    """Wraps `safe_open` where the loaders call it and counts the tensors read from it that are still alive."""

    def __init__(self):
        self.live = self.peak = self.read = 0

    def track(self, tensor: torch.Tensor) -> torch.Tensor:
        self.live += 1
        self.read += 1
        self.peak = max(self.peak, self.live)
        weakref.finalize(tensor, self._released)
        return tensor

    def _released(self) -> None:
        self.live -= 1

    def safe_open(self, real):
        copies = self

        class Slice:
            def __init__(self, part):
                self.part = part

            def get_shape(self):
                return self.part.get_shape()

            def __getitem__(self, index):
                return copies.track(self.part[index])

        class File:
            def __init__(self, *args, **kwargs):
                self.handle = real(*args, **kwargs)

            def __enter__(self):
                self.f = self.handle.__enter__()
                return self

            def __exit__(self, *exc):
                return self.handle.__exit__(*exc)

            def keys(self):
                return self.f.keys()

            def get_tensor(self, key):
                return copies.track(self.f.get_tensor(key))

            def get_slice(self, key):
                return Slice(self.f.get_slice(key))

        return File


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("streaming")
    return {name: save_tiny_model(root / name, model_type, seed=5, **overrides)
            for name, (model_type, overrides) in MODELS.items()}


@pytest.fixture
def host_copies(monkeypatch) -> HostCopies:
    copies = HostCopies()
    real = loader_module.safe_open
    monkeypatch.setattr(loader_module, "safe_open", copies.safe_open(real))
    monkeypatch.setattr(tp_module, "safe_open", copies.safe_open(real), raising=False)  # where it read its own
    return copies


# The device stands in for a GPU: "meta" holds no data, so every host copy that stays alive after its tensor was
# assigned (a whole state dict built on the host first) shows up in the count.
DEVICE = torch.device("meta")


@pytest.mark.parametrize("rank", [None, 0, 1])
def test_host_memory_holds_one_tensor_at_a_time(tiny_dirs, host_copies, rank):
    path = tiny_dirs["qwen2_bias"]
    if rank is None:
        model = load_model(path, dtype="float32", device=DEVICE)
    else:  # loading sends nothing: the group only names the rank's share
        model = load_model_tensor_parallel(path, TensorParallelGroup(size=2, rank=rank), dtype="float32", device=DEVICE)
    assert all(t.is_meta for t in model.state_dict().values())
    assert host_copies.read >= len(load_file(str(path / "model.safetensors"))) - 2  # leader-only biases: not read
    assert host_copies.peak == 1 and host_copies.live == 0, vars(host_copies)


@pytest.mark.parametrize("name", list(MODELS))
def test_load_model_holds_one_host_tensor_at_a_time_and_loads_the_checkpoint_exactly(tiny_dirs, host_copies, name):
    path = tiny_dirs[name]
    # fp32 checkpoint -> bf16 weights: every host copy read is a tensor of its own, freed once converted.
    model = load_model(path, dtype="bfloat16", device="cpu")
    checkpoint = load_file(str(path / "model.safetensors"))
    state = model.state_dict()
    assert host_copies.read == len(checkpoint) and host_copies.peak == 1, vars(host_copies)
    assert host_copies.live == 0
    for key, stored in checkpoint.items():  # the old loader's result: each stored tensor .to(dtype)
        assert state[key].dtype == torch.bfloat16 and torch.equal(state[key], stored.to(torch.bfloat16)), key
    assert set(state) == set(checkpoint) | {"lm_head.weight"}
    assert not any(t.is_meta for t in state.values()) and not any(p.requires_grad for p in model.parameters())
    if name == "llama_tied":
        assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("name", list(MODELS))
def test_tensor_parallel_loader_holds_one_host_slice_at_a_time_and_equals_the_split_model(tiny_dirs, host_copies,
                                                                                        name, rank):
    path = tiny_dirs[name]
    group = TensorParallelGroup(size=2, rank=rank)  # loading sends nothing: the group only names the rank's share
    sharded = load_model_tensor_parallel(path, group, dtype="bfloat16", device="cpu")
    assert host_copies.read > 0 and host_copies.peak == 1 and host_copies.live == 0, vars(host_copies)
    expected = shard_model(load_model(path, dtype="bfloat16", device="cpu"), TensorParallelGroup(size=2, rank=rank))
    got, want = sharded.state_dict(), expected.state_dict()
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key
    linear = sharded.model.layers[0].mlp.down_proj
    assert (linear.out_features, linear.in_features) == tuple(linear.weight.shape)


def test_shape_checks_run_before_any_tensor_is_read(tiny_dirs, host_copies, tmp_path):
    from safetensors.torch import save_file

    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json",):
        (broken / name).write_bytes((tiny_dirs["llama"] / name).read_bytes())
    tensors = load_file(str(tiny_dirs["llama"] / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1].clone()
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(UserError, match=r"tensor model.norm.weight has shape \(63,\), config implies \(64,\)"):
        load_model(broken, dtype="float32", device="cpu")
    with pytest.raises(UserError, match=r"tensor model.norm.weight has shape \(63,\), config implies \(64,\)"):
        load_model_tensor_parallel(broken, TensorParallelGroup(size=2, rank=0), dtype="float32", device="cpu")
    assert host_copies.read == 0
