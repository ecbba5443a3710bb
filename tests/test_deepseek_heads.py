"""The DeepSeek-V3 MTP head on a DeepSeek target (`head.kind: mtp`): its block is the target's MLA decoder block
(dense or MoE MLP), its cache a latent cache; `head.init: from_checkpoint` loads the MTP module a DeepSeek-V3
checkpoint ships at `model.layers.{num_hidden_layers}`, with outputs identical to transformers' own modules carrying
those weights, applied by hand (transformers has no MTP module)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from mtp_train.errors import UserError
from mtp_train.heads.config import HeadConfig
from mtp_train.heads.draft_head import DraftHead
from mtp_train.heads.io import load_head, save_head
from mtp_train.runtime.attention import BatchInfo
from mtp_train.runtime.deepseek import DeepseekDecoderLayer, LatentCache, MoE
from mtp_train.runtime.kv_cache import PageAllocator, Sequence
from mtp_train.runtime.loader import load_model
from tests.deepseek_models import save_tiny_deepseek

TOL = 1e-4
V3 = dict(n_group=4, topk_group=2, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
          "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 1.0})


def write_mtp_module(path, hf_model, seed: int = 5) -> dict[str, torch.Tensor]:
    """Append an MTP module (transformers' DeepseekV3DecoderLayer as the block + enorm, hnorm, eh_proj,
    shared_head.norm, and copies of embed_tokens / lm_head as DeepSeek ships them) at model.layers.{N} of the
    checkpoint in `path`; returns the module's tensors under their checkpoint names."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    config = hf_model.config
    n, d = config.num_hidden_layers, config.hidden_size
    torch.manual_seed(seed)
    block = DeepseekV3DecoderLayer(config, layer_idx=n)
    module = {f"model.layers.{n}.{k}": v.detach().clone() for k, v in block.state_dict().items()}
    for key, value in module.items():  # every tensor drawn here (the layer's experts start uninitialized)
        if "norm" in key:
            module[key] = 1 + 0.1 * torch.randn_like(value)
        elif "correction_bias" in key or key.endswith("mlp.gate.weight"):
            module[key] = 0.3 * torch.randn_like(value)
        else:
            module[key] = 0.15 * torch.randn_like(value)
    module[f"model.layers.{n}.enorm.weight"] = 1 + 0.1 * torch.randn(d)
    module[f"model.layers.{n}.hnorm.weight"] = 1 + 0.1 * torch.randn(d)
    module[f"model.layers.{n}.eh_proj.weight"] = 0.1 * torch.randn(d, 2 * d)
    module[f"model.layers.{n}.shared_head.norm.weight"] = 1 + 0.1 * torch.randn(d)
    weights = load_file(path / "model.safetensors")
    weights.update(checkpoint_names(module))
    weights[f"model.layers.{n}.embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
    weights[f"model.layers.{n}.shared_head.head.weight"] = weights["lm_head.weight"].clone()
    save_file(weights, path / "model.safetensors")
    return module


def checkpoint_names(module: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' in-memory expert tensors (`experts.gate_up_proj` [E, 2I, d], `experts.down_proj` [E, d, I]) as
    the per-expert tensors a checkpoint stores (what `save_pretrained` writes); other names unchanged."""
    out = {}
    for key, value in module.items():
        if key.endswith("mlp.experts.gate_up_proj"):
            base, inter = key[: -len("gate_up_proj")], value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = value[e, :inter].contiguous()
                out[f"{base}{e}.up_proj.weight"] = value[e, inter:].contiguous()
        elif key.endswith("mlp.experts.down_proj"):
            base = key[: -len("down_proj")]
            for e in range(value.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = value[e].contiguous()
        else:
            out[key] = value.contiguous()
    return out


def reference_mtp(hf_model, module: dict[str, torch.Tensor], token_ids, hidden) -> torch.Tensor:
    """transformers' modules with the checkpoint's MTP weights, applied by hand: shared_head.norm(block(eh_proj(
    cat(enorm(embed(t)), hnorm(h))))) over rows at positions 0..T-1 (causal)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3DecoderLayer, DeepseekV3RMSNorm, DeepseekV3RotaryEmbedding,
    )

    config = hf_model.config
    config._attn_implementation = "eager"
    n, d = config.num_hidden_layers, config.hidden_size
    prefix = f"model.layers.{n}."
    block = DeepseekV3DecoderLayer(config, layer_idx=n).eval()
    block.load_state_dict({k[len(prefix):]: v for k, v in module.items()
                           if k.startswith(prefix) and k[len(prefix):] in block.state_dict()}, strict=True)
    norms = {}
    for name in ("enorm", "hnorm", "shared_head.norm"):
        norms[name] = DeepseekV3RMSNorm(d, eps=config.rms_norm_eps)
        norms[name].weight.data.copy_(module[f"{prefix}{name}.weight"])
    with torch.no_grad():
        embeds = hf_model.model.embed_tokens(token_ids)
        x = torch.cat((norms["enorm"](embeds), norms["hnorm"](hidden)), dim=-1) @ module[prefix + "eh_proj.weight"].T
        T = x.shape[0]
        positions = torch.arange(T)[None]
        cos_sin = DeepseekV3RotaryEmbedding(config)(x[None], positions)
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        out = block(x[None], attention_mask=mask, position_ids=positions, position_embeddings=cos_sin)
        out = out[0] if isinstance(out, tuple) else out
        return norms["shared_head.norm"](out[0])


@pytest.fixture(scope="module")
def v3_with_mtp(tmp_path_factory):
    path = tmp_path_factory.mktemp("v3-mtp")
    hf = save_tiny_deepseek(path, "deepseek_v3", seed=3, **V3)
    module = write_mtp_module(path, hf)
    target = load_model(path, dtype="float32", device="cpu")
    return path, hf, module, target


def head_config(target, **options) -> HeadConfig:
    return HeadConfig.for_target(target.config, **options)


def test_from_checkpoint_matches_transformers_modules_by_hand(v3_with_mtp):
    path, hf, module, target = v3_with_mtp
    head = DraftHead.from_target(target, head_config(target, init="from_checkpoint", block_mlp="moe"))
    assert isinstance(head.layers[0], DeepseekDecoderLayer) and isinstance(head.layers[0].mlp, MoE)
    gen = torch.Generator().manual_seed(0)
    token_ids = torch.randint(2, 96, (17,), generator=gen)
    hidden = torch.randn(17, 64, generator=gen)
    expected = reference_mtp(hf, module, token_ids, hidden)
    with torch.no_grad():
        out = head(token_ids, hidden, BatchInfo.without_cache([17]))
    assert (out - expected).abs().max() <= TOL
    expected_logits = hf.lm_head(expected).float()
    assert (head.logits(out) - expected_logits).abs().max() <= TOL
    # the trainer's way: from the target's frozen parts only, the module read from the checkpoint files
    from mtp_train.runtime.frozen_parts import load_frozen_parts

    parts = load_frozen_parts(path, torch.float32)
    from_parts = DraftHead.from_target(parts, head_config(target, init="from_checkpoint", block_mlp="moe"))
    with torch.no_grad():
        assert torch.equal(from_parts(token_ids, hidden, BatchInfo.without_cache([17])), out)
    # through the latent cache too: a prefill of 5 rows, then one row at a time (absorbed attention)
    allocator = PageAllocator(8, page_size=4)
    cache = head.new_kv_cache(allocator)
    assert isinstance(cache, LatentCache)
    seq = Sequence(0)
    rows = [head(token_ids[:5], hidden[:5], BatchInfo.for_sequences([seq], [5], allocator), cache)]
    for i in range(5, 17):
        rows.append(head(token_ids[i:i + 1], hidden[i:i + 1], BatchInfo.for_sequences([seq], [1], allocator), cache))
    assert (torch.cat(rows) - expected).abs().max() <= TOL


def test_from_checkpoint_needs_the_module_and_a_moe_block(v3_with_mtp, tmp_path):
    _, _, _, target = v3_with_mtp
    with pytest.raises(UserError, match="block_mlp moe"):
        head_config(target, init="from_checkpoint")
    save_tiny_deepseek(tmp_path, "deepseek_v3", seed=3, **V3)  # no MTP module written
    bare = load_model(tmp_path, dtype="float32", device="cpu")
    with pytest.raises(UserError, match="model.layers.3.eh_proj.weight|model.layers.3"):
        DraftHead.from_target(bare, head_config(bare, init="from_checkpoint", block_mlp="moe"))


@pytest.mark.parametrize("block_mlp", ["dense", "moe"])
def test_head_trains_and_drafts_through_the_latent_cache(v3_with_mtp, tmp_path, block_mlp):
    """A random DeepSeek MTP head: gradients reach every parameter it owns (none reach the frozen target), the
    cached path equals the uncached one, and it saves and loads back as a native head."""
    _, _, _, target = v3_with_mtp
    config = head_config(target, block_mlp=block_mlp)
    head = DraftHead.from_target(target, config)
    assert isinstance(head.layers[0].mlp, MoE) == (block_mlp == "moe")
    gen = torch.Generator().manual_seed(1)
    token_ids, hidden = torch.randint(2, 96, (2 * 9,), generator=gen), torch.randn(18, 64, generator=gen)
    out = head(token_ids, hidden, BatchInfo.without_cache([9, 9]))
    head.logits(out).logsumexp(-1).sum().backward()
    unused = [n for n, p in head.named_parameters() if p.grad is None and ".experts." not in n]
    assert not unused
    assert target.lm_head.weight.grad is None
    with torch.no_grad():
        reference = head(token_ids, hidden, BatchInfo.without_cache([9, 9]))
        allocator = PageAllocator(8, page_size=4)
        cache = head.new_kv_cache(allocator)
        seqs = [Sequence(0), Sequence(1)]
        first = head(torch.cat([token_ids[:4], token_ids[9:13]]), torch.cat([hidden[:4], hidden[9:13]]),
                     BatchInfo.for_sequences(seqs, [4, 4], allocator), cache)
        rest = head(torch.cat([token_ids[4:9], token_ids[13:]]), torch.cat([hidden[4:9], hidden[13:]]),
                    BatchInfo.for_sequences(seqs, [5, 5], allocator), cache)
    cached = torch.cat([first[:4], rest[:5], first[4:], rest[5:]])
    assert (cached - reference).abs().max() <= TOL
    save_head(head, tmp_path / "head")
    loaded = load_head(tmp_path / "head", target)
    with torch.no_grad():
        again = loaded(token_ids, hidden, BatchInfo.without_cache([9, 9]))
    assert torch.equal(again, reference)


@pytest.mark.parametrize("options, message", [
    (dict(kind="eagle1"), "not available for a DeepSeek target"),
    (dict(init="last_layer"), "block_mlp moe"),
    (dict(block_mlp="other"), "block_mlp"),
])
def test_head_options_a_deepseek_target_refuses(v3_with_mtp, options, message):
    _, _, _, target = v3_with_mtp
    with pytest.raises(UserError, match=message):
        head_config(target, **options)


def test_block_mlp_moe_is_for_deepseek_targets_only():
    with pytest.raises(UserError, match="applies to DeepSeek targets"):
        HeadConfig(hidden_size=8, vocab_size=10, model_type="llama", block_mlp="moe")
    with pytest.raises(UserError, match="from_checkpoint"):
        HeadConfig(hidden_size=8, vocab_size=10, model_type="llama", init="from_checkpoint")


def test_init_last_layer_from_the_frozen_parts_copies_the_targets_moe_block(v3_with_mtp):
    """`head.init: last_layer` with `block_mlp: moe` (the target's last layer is MoE) as the trainer builds it, from
    the frozen parts read off the checkpoint: the head's block is the target's last layer, tensor for tensor."""
    from mtp_train.runtime.frozen_parts import load_frozen_parts

    path, _, _, target = v3_with_mtp
    parts = load_frozen_parts(path, torch.float32, last_layer=True)
    head = DraftHead.from_target(parts, head_config(target, init="last_layer", block_mlp="moe"))
    theirs = target.model.layers[-1].state_dict()
    ours = head.layers[0].state_dict()
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert torch.equal(head.norm.weight, target.model.norm.weight)
