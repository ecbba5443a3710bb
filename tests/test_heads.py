"""Draft heads: parameter layout, frozen target parts, init, native files, and agreement of the packed training
forward with the paged-cache draft path."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from mtp_train.errors import UserError
from mtp_train.heads import DraftHead, HeadConfig, load_head, read_head_config, save_head
from mtp_train.runtime.attention import BatchInfo
from mtp_train.runtime.kv_cache import PageAllocator, Sequence
from mtp_train.runtime.loader import load_model
from tests.tiny_models import save_tiny_model

LAYER_KEYS = [
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "post_attention_layernorm.weight",
]


@pytest.fixture
def target(target_dir):
    """A fresh copy of the tiny Llama (conftest's `target_dir`) per test: tests here change it (requires_grad_)."""
    return load_model(target_dir, dtype="float32", device="cpu")


def make_head(target, kind="mtp", num_layers=1, init="last_layer") -> DraftHead:
    torch.manual_seed(0)
    config = HeadConfig.for_target(target.config, kind=kind, num_layers=num_layers, init=init)
    return DraftHead.from_target(target, config)


def expected_names(kind: str, num_layers: int) -> set[str]:
    if kind == "mtp":
        names = {"enorm.weight", "hnorm.weight", "eh_proj.weight", "norm.weight"}
    else:
        names = {"fc.weight", "fc.bias"}
    for j in range(num_layers):
        names |= {f"layers.{j}.{key}" for key in LAYER_KEYS}
        if kind == "mtp" or j > 0:
            names.add(f"layers.{j}.input_layernorm.weight")
    return names


@pytest.mark.parametrize("kind", ["mtp", "eagle1"])
def test_parameter_names_and_no_frozen_tensors(target, kind):
    head = make_head(target, kind, num_layers=2)
    assert {name for name, _ in head.named_parameters()} == expected_names(kind, 2)
    assert set(head.state_dict()) == expected_names(kind, 2)  # no buffers, no embed/lm_head
    target_tensors = {target.model.embed_tokens.weight.data_ptr(), target.lm_head.weight.data_ptr()}
    assert not target_tensors & {p.data_ptr() for p in head.parameters()}


def test_frozen_target_untouched_by_training_and_dtype_moves(target):
    target.requires_grad_(True)  # even a target that would accept gradients must not receive any
    embed, lm_head = target.model.embed_tokens.weight, target.lm_head.weight
    before = embed.detach().clone(), lm_head.detach().clone()
    head = make_head(target)
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-2)
    tokens, hidden = torch.randint(0, 96, (9,)), torch.randn(9, 64)
    out = head(tokens, hidden, BatchInfo.without_cache([5, 4]))
    loss = head.logits(out).logsumexp(-1).mean() + out.pow(2).mean()
    loss.backward()
    optimizer.step()
    assert embed.grad is None and lm_head.grad is None
    assert torch.equal(embed, before[0]) and torch.equal(lm_head, before[1])
    assert all(p.grad is not None for p in head.parameters())
    head.to(torch.float64)
    assert embed.dtype == lm_head.dtype == torch.float32 and target.lm_head.weight is lm_head
    assert head.dtype == torch.float64
    assert head.logits(head(tokens, hidden.double(), BatchInfo.without_cache([9]))).dtype == torch.float32


@pytest.mark.parametrize("kind", ["mtp", "eagle1"])
def test_from_target_last_layer_init(target, kind):
    head = make_head(target, kind, num_layers=2)
    last = target.model.layers[-1].state_dict()
    for j, layer in enumerate(head.layers):
        state = layer.state_dict()
        assert ("input_layernorm.weight" in state) == (kind == "mtp" or j > 0)
        for key, value in state.items():
            assert torch.equal(value, last[key]), (j, key)
    d = target.config.hidden_size
    proj = head.eh_proj if kind == "mtp" else head.fc
    assert torch.equal(proj.weight[:, d:], torch.eye(d))
    assert 0 < proj.weight[:, :d].std() < 0.05
    if kind == "mtp":
        assert torch.equal(head.norm.weight, target.model.norm.weight)
        assert torch.equal(head.enorm.weight, torch.ones(d)) and torch.equal(head.hnorm.weight, torch.ones(d))
    else:
        assert torch.equal(head.fc.bias, torch.zeros(d)) and head.norm is None


def test_random_init(target):
    head = make_head(target, init="random")
    q = head.layers[0].self_attn.q_proj.weight
    assert abs(q.std().item() - 0.02) < 0.005
    assert not torch.equal(q, target.model.layers[-1].self_attn.q_proj.weight)
    assert torch.equal(head.layers[0].input_layernorm.weight, torch.ones(64))
    assert torch.equal(head.norm.weight, torch.ones(64))


def test_head_config_json_round_trip():
    config = HeadConfig(8, 10, "llama", kind="eagle1", num_layers=2, target_fingerprint="abc")
    assert HeadConfig.from_json(config.to_json()) == config
    with pytest.raises(UserError, match="unknown key.*bogus"):
        HeadConfig.from_json(json.dumps({**config.to_dict(), "bogus": 1}))
    with pytest.raises(UserError, match="kind 'eagle9'"):
        HeadConfig.from_json(json.dumps({**config.to_dict(), "kind": "eagle9"}))


@pytest.mark.parametrize("kind", ["mtp", "eagle1"])
def test_save_load_round_trip(target, tmp_path, kind):
    head = make_head(target, kind, num_layers=2, init="random")
    save_head(head, tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    assert set(saved) == expected_names(kind, 2)
    assert read_head_config(tmp_path) == head.head_config
    loaded = load_head(tmp_path, target)
    assert all(p.requires_grad for p in loaded.parameters())  # resumable
    tokens, hidden = torch.randint(0, 96, (10,)), torch.randn(10, 64)
    batch = BatchInfo.without_cache([6, 4])
    with torch.no_grad():
        assert torch.equal(loaded(tokens, hidden, batch), head(tokens, hidden, batch))


def test_load_errors_name_the_problem(target, target_dir, tmp_path):
    head = make_head(target)
    save_head(head, tmp_path / "good")
    state = load_file(tmp_path / "good" / "model.safetensors")

    def variant(name: str, tensors: dict, config_edit: dict | None = None):
        directory = tmp_path / name
        save_head(head, directory)
        save_file(tensors, directory / "model.safetensors")
        if config_edit:
            config = json.loads((directory / "head_config.json").read_text())
            (directory / "head_config.json").write_text(json.dumps({**config, **config_edit}))
        return directory

    with pytest.raises(UserError, match=r"embed_tokens\.weight"):
        load_head(variant("embed", {**state, "embed_tokens.weight": torch.zeros(96, 64)}), target)
    with pytest.raises(UserError, match=r"lm_head\.weight"):
        load_head(variant("lm_head", {**state, "lm_head.weight": torch.zeros(96, 64)}), target)
    missing = {k: v for k, v in state.items() if k != "layers.0.mlp.up_proj.weight"}
    with pytest.raises(UserError, match=r"missing layers\.0\.mlp\.up_proj\.weight"):
        load_head(variant("missing", missing), target)
    with pytest.raises(UserError, match=r"unexpected layers\.0\.extra\.weight"):
        load_head(variant("extra", {**state, "layers.0.extra.weight": torch.zeros(2)}), target)
    with pytest.raises(UserError, match="hidden_size=48 but the target has hidden_size=64"):
        load_head(variant("hidden", state, {"hidden_size": 48}), target)
    with pytest.raises(UserError, match="model_type='qwen2'"):
        load_head(variant("type", state, {"model_type": "qwen2"}), target)
    with pytest.raises(UserError, match="target_fingerprint 'aaa'.*'bbb'"):
        load_head(variant("fp", state, {"target_fingerprint": "aaa"}), target, target_fingerprint="bbb")
    wrong_shape = {**state, "layers.0.mlp.up_proj.weight": torch.zeros(3, 64)}
    with pytest.raises(UserError, match=r"layers\.0\.mlp\.up_proj\.weight has shape \(3, 64\)"):
        load_head(variant("shape", wrong_shape), target)
    # A head trained for a target with a different hidden size.
    other_dir = save_tiny_model(tmp_path / "other", "llama", hidden_size=48, head_dim=12)
    other = load_model(other_dir, dtype="float32", device="cpu")
    with pytest.raises(UserError, match="hidden_size=64 but the target has hidden_size=48"):
        load_head(tmp_path / "good", other)



def test_one_target_check(target):
    """`target_mismatches`, the check every loader, export and inspect use: only recorded facts are compared, an
    unknown fingerprint on either side is not, and each mismatch names the file, the key path and both values."""
    from mtp_train.heads.io import target_mismatches

    config, fingerprint = target.config, target.fingerprint
    good = {"hidden_size": 64, "vocab_size": 96, "model_type": "llama", "target_fingerprint": fingerprint}
    assert target_mismatches(good, config, fingerprint, "f.json") == []
    assert target_mismatches({"hidden_size": 64}, config, None, "f.json") == []
    assert target_mismatches({**good, "target_fingerprint": None}, config, fingerprint, "f.json") == []
    bad = {"hidden_size": 48, "vocab_size": 96, "model_type": "qwen2", "target_fingerprint": "aaa"}
    assert target_mismatches(bad, config, fingerprint, "f.json", "block.") == [
        "f.json: block.hidden_size=48 but the target has hidden_size=64",
        "f.json: block.model_type='qwen2' but the target has model_type='llama'",
        f"f.json: block.target_fingerprint 'aaa' does not match the target's {fingerprint!r} (the head was trained "
        "for a different target)",
    ]

ARCHS = {
    "llama": dict(model_type="llama"),
    "mistral-window": dict(model_type="mistral", sliding_window=5),
    "qwen3": dict(model_type="qwen3", head_dim=24),
}


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("kind", ["mtp", "eagle1"])
def test_packed_forward_equals_paged_draft_path(tmp_path, arch, kind):
    """The training forward (packed, no cache) and the speculative draft path (paged cache: ragged prefill,
    token-by-token batched decode, a uniform verify batch, a ragged verify batch) give the same outputs."""
    overrides = dict(ARCHS[arch])
    model_type = overrides.pop("model_type")
    target = load_model(save_tiny_model(tmp_path, model_type, seed=1, **overrides), dtype="float32", device="cpu")
    head = make_head(target, kind, num_layers=2, init="random")
    gen = torch.Generator().manual_seed(0)
    lengths = [13, 12]
    tokens = torch.randint(0, 96, (sum(lengths),), generator=gen)
    hidden = torch.randn(sum(lengths), 64, generator=gen)
    with torch.no_grad():
        packed = head(tokens, hidden, BatchInfo.without_cache(lengths)).split(lengths)  # per sequence [n, d]
    per_seq = list(zip(tokens.split(lengths), hidden.split(lengths)))

    allocator = PageAllocator(16, page_size=4)
    cache = head.new_kv_cache(allocator)
    seqs = [Sequence(0), Sequence(1)]
    done = [0, 0]

    def step(counts: list[int]) -> None:
        batch = BatchInfo.for_sequences(seqs, counts, allocator)
        rows = [slice(done[b], done[b] + c) for b, c in enumerate(counts)]
        out = head(
            torch.cat([per_seq[b][0][r] for b, r in enumerate(rows)]),
            torch.cat([per_seq[b][1][r] for b, r in enumerate(rows)]),
            batch,
            cache,
        )
        for b, chunk in enumerate(out.split(counts)):
            assert (chunk - packed[b][rows[b]]).abs().max() <= 1e-5, (counts, b)
            done[b] += counts[b]

    step([5, 3])  # ragged prefill
    for _ in range(3):
        step([1, 1])  # batched decode
    step([3, 3])  # uniform verify
    step([2, 3])  # ragged verify (ends both sequences)
    assert done == lengths
