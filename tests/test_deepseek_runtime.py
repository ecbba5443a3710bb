"""Logits parity of the DeepSeek-V2/V3 runtime (`runtime/deepseek.py`) with transformers' DeepseekV2/V3 models in
fp32 on tiny random configs (YaRN and plain rope, greedy / group-limited / noaux_tc routing with the correction bias,
q_lora_rank set and unset): prefill without a cache, ragged prefill through the paged latent cache, token-by-token
decode (absorbed attention), verify of 1-5 tokens then truncation, ragged verify, long cached forwards (expanded
attention over cached latents), serving-size batches; the latent cache's size; and the decode path left to this
module by `apply_decode_weights`."""

from __future__ import annotations

import json

import pytest
import torch

from mtp_train.errors import UserError
from mtp_train.runtime.attention import BatchInfo
from mtp_train.runtime.config import load_config
from mtp_train.runtime.deepseek import ABSORB_MAX_QUERY, DeepseekDecoderLayer, DeepseekForCausalLM, LatentCache
from mtp_train.runtime.kv_cache import PageAllocator, Sequence
from mtp_train.runtime.loader import load_model
from mtp_train.runtime.decode_runner import KernelDecoderLayer, apply_decode_weights
from mtp_train.runtime.precision import Precision
from tests.deepseek_models import ARCHS, save_tiny_deepseek
from tests.paged_checks import check_decode_token_by_token, check_ragged_verify, check_verify_batch

TOL = 1e-4


@pytest.fixture(scope="module", params=list(ARCHS))
def arch(request, tmp_path_factory):
    model_type, overrides = ARCHS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_deepseek(path, model_type, seed=len(request.param), **overrides)
    model = load_model(path, dtype="float32", device="cpu")
    gen = torch.Generator().manual_seed(1)
    sequences = [torch.randint(2, 96, (n,), generator=gen).tolist() for n in (23, 5, 14)]
    with torch.no_grad():
        references = [hf(torch.tensor([ids])).logits[0].float() for ids in sequences]
    return model, hf, sequences, references


def test_builds_the_deepseek_family(arch):
    model, hf, _, _ = arch
    assert isinstance(model, DeepseekForCausalLM)
    o = model.config.deepseek
    assert [layer.is_moe for layer in model.model.layers] == [i >= o.first_k_dense_replace for i in range(3)]
    # the checkpoint's names are ours: the loader accepted exactly its tensors (it rejects missing and unexpected
    # names), among them every routed expert and, for V3, the correction bias
    from safetensors import safe_open

    with safe_open(f"{model.source_dir}/model.safetensors", "pt") as f:
        assert set(f.keys()) == set(model.state_dict())
    assert "model.layers.2.mlp.experts.7.down_proj.weight" in model.state_dict()
    has_bias = "model.layers.2.mlp.gate.e_score_correction_bias" in model.state_dict()
    assert has_bias == (model.config.model_type == "deepseek_v3")


def test_prefill_without_cache(arch):
    model, _, sequences, references = arch
    for ids, ref in zip(sequences, references):
        out = model(torch.tensor(ids), BatchInfo.without_cache([len(ids)]))
        assert (out.logits - ref).abs().max() <= TOL


def test_ragged_prefill_matches_single_sequences(arch):
    model, _, sequences, references = arch
    flat = torch.tensor([t for ids in sequences for t in ids])
    ragged = model(flat, BatchInfo.without_cache([len(s) for s in sequences])).logits
    allocator = PageAllocator(32, page_size=4)
    cache = model.new_kv_cache(allocator)
    seqs = [Sequence(i) for i in range(len(sequences))]
    paged = model(flat, BatchInfo.for_sequences(seqs, [len(s) for s in sequences], allocator), cache).logits
    assert (ragged - torch.cat(references)).abs().max() <= TOL
    assert (paged - torch.cat(references)).abs().max() <= TOL


def test_latent_cache_holds_the_compressed_latent_only(arch):
    model, _, _, _ = arch
    c, o = model.config, model.config.deepseek
    allocator = PageAllocator(8, page_size=4)
    cache = model.new_kv_cache(allocator)
    assert isinstance(cache, LatentCache) and len(cache.layers) == c.num_hidden_layers
    per_token_per_layer = o.kv_lora_rank + o.qk_rope_head_dim
    for layer in cache.layers:
        assert tuple(layer.shape) == (8, 4, per_token_per_layer)
    assert cache.nbytes() == c.num_hidden_layers * 8 * 4 * per_token_per_layer * 4  # fp32
    # not the expanded per-head keys and values
    assert per_token_per_layer < c.num_attention_heads * (o.qk_head_dim + o.v_head_dim)


def test_decode_token_by_token_through_paged_cache(arch):
    model, _, sequences, references = arch
    check_decode_token_by_token(model, sequences, references, TOL)


@pytest.mark.parametrize("verify_len", [1, 2, 3, 4, 5])
def test_verify_batches(arch, verify_len):
    model, _, sequences, references = arch
    check_verify_batch(model, sequences, references, verify_len, TOL)


def test_ragged_verify_mixed_lengths(arch):
    model, _, sequences, references = arch
    check_ragged_verify(model, sequences, references, TOL)


def test_long_cached_forward_uses_the_expanded_form_over_cached_latents(arch):
    """A second prompt chunk longer than ABSORB_MAX_QUERY attends to the latents cached by the first (expanded
    form), in a ragged batch and a uniform one."""
    model, _, _, _ = arch
    from transformers import AutoModelForCausalLM

    gen = torch.Generator().manual_seed(7)
    sequences = [torch.randint(2, 96, (n,), generator=gen).tolist() for n in (4 + ABSORB_MAX_QUERY + 2,) * 2]
    hf = AutoModelForCausalLM.from_pretrained(model.source_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        references = [hf(torch.tensor([ids])).logits[0].float() for ids in sequences]
    allocator = PageAllocator(32, page_size=4)
    cache = model.new_kv_cache(allocator)
    seqs = [Sequence(0), Sequence(1)]
    model(torch.tensor(sequences[0][:4] + sequences[1][:3]), BatchInfo.for_sequences(seqs, [4, 3], allocator), cache)
    rest = [len(sequences[0]) - 4, len(sequences[1]) - 4]
    logits = model(torch.tensor(sequences[0][4:] + sequences[1][3:]),
                   BatchInfo.for_sequences(seqs, [rest[0], rest[1] + 1], allocator), cache).logits
    assert (logits - torch.cat([references[0][4:], references[1][3:]])).abs().max() <= TOL
    # uniform: both sequences bring the same long chunk
    seqs = [Sequence(2), Sequence(3)]
    model(torch.tensor(sequences[0][:4] + sequences[1][:4]), BatchInfo.for_sequences(seqs, [4, 4], allocator), cache)
    logits = model(torch.tensor(sequences[0][4:] + sequences[1][4:]),
                   BatchInfo.for_sequences(seqs, rest, allocator), cache).logits
    assert (logits - torch.cat([references[0][4:], references[1][4:]])).abs().max() <= TOL


@pytest.mark.parametrize("batch_size", [8])
def test_batched_decode_and_verify_with_ragged_lengths(arch, batch_size):
    from transformers import AutoModelForCausalLM

    model, _, _, _ = arch
    gen = torch.Generator().manual_seed(batch_size)
    lengths = torch.randint(8, 30, (batch_size,), generator=gen).tolist()
    sequences = [torch.randint(2, 96, (n,), generator=gen).tolist() for n in lengths]
    hf = AutoModelForCausalLM.from_pretrained(model.source_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        references = [hf(torch.tensor([ids])).logits[0].float() for ids in sequences]
    allocator = PageAllocator(sum(-(-n // 4) for n in lengths) + batch_size, page_size=4)
    cache = model.new_kv_cache(allocator)
    seqs = [Sequence(i) for i in range(batch_size)]
    prompt_lens = [n - 7 for n in lengths]
    model(torch.tensor([t for ids, p in zip(sequences, prompt_lens) for t in ids[:p]]),
          BatchInfo.for_sequences(seqs, prompt_lens, allocator), cache)
    done = list(prompt_lens)

    def step(counts: list[int]) -> None:
        new = [t for ids, d, c in zip(sequences, done, counts) for t in ids[d : d + c]]
        logits = model(torch.tensor(new), BatchInfo.for_sequences(seqs, counts, allocator), cache).logits
        expected = torch.cat([ref[d : d + c] for ref, d, c in zip(references, done, counts)])
        assert (logits - expected).abs().max() <= TOL, counts
        for b, c in enumerate(counts):
            done[b] += c

    step([1] * batch_size)
    step([3] * batch_size)
    for b, seq in enumerate(seqs):
        keep = 1 + b % 2
        seq.truncate(seq.num_cached - 3 + keep, allocator)
        done[b] -= 3 - keep
    step([1 + b % 3 for b in range(batch_size)])


def test_hidden_states_and_aux_layers(arch):
    model, hf, sequences, _ = arch
    ids = sequences[0]
    out = model(torch.tensor(ids), BatchInfo.without_cache([len(ids)]), return_hidden=True, aux_layers=(1,))
    with torch.no_grad():
        hf_out = hf(torch.tensor([ids]), output_hidden_states=True)
    assert (out.hidden - hf_out.hidden_states[-1][0]).abs().max() <= TOL
    assert (out.aux_hidden[1] - hf_out.hidden_states[2][0]).abs().max() <= TOL


def test_decode_weights_leave_deepseek_layers_to_their_module(arch):
    """`apply_decode_weights` (what every stage calls) gives no DeepSeek layer a Llama decode kernel; decode through
    the result still matches transformers."""
    _, _, sequences, references = arch
    model = load_model(arch[0].source_dir, device="cpu",
                       precision=Precision("float32", "float32", 0, "test", requested="float32"))
    apply_decode_weights(model, Precision("float32", "float32", 0, "test", requested="float32"))
    assert all(isinstance(layer, DeepseekDecoderLayer) and not isinstance(layer, KernelDecoderLayer)
               for layer in model.model.layers)
    allocator = PageAllocator(16, page_size=4)
    cache = model.new_kv_cache(allocator)
    seq = Sequence(0)
    ids = sequences[1]
    model(torch.tensor(ids[:2]), BatchInfo.for_sequences([seq], [2], allocator), cache)
    for pos in range(2, len(ids)):
        logits = model(torch.tensor([ids[pos]]), BatchInfo.for_sequences([seq], [1], allocator), cache).logits
        assert (logits[0] - references[1][pos]).abs().max() <= TOL


def test_mtp_layer_in_the_checkpoint_is_not_a_target_layer(tmp_path):
    """A checkpoint carrying its MTP module at model.layers.{N} (num_nextn_predict_layers: 1) loads as the target
    without it; a stray layer beyond that is still an unexpected tensor."""
    from safetensors.torch import load_file, save_file

    save_tiny_deepseek(tmp_path, "deepseek_v3", n_group=2, topk_group=1)
    weights = load_file(tmp_path / "model.safetensors")
    weights["model.layers.3.enorm.weight"] = torch.ones(64)
    save_file(weights, tmp_path / "model.safetensors")
    assert load_config(tmp_path).deepseek.num_nextn_predict_layers == 1
    load_model(tmp_path, dtype="float32", device="cpu")
    weights["model.layers.4.enorm.weight"] = torch.ones(64)
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(UserError, match="unexpected tensor"):
        load_model(tmp_path, dtype="float32", device="cpu")


@pytest.mark.parametrize("key, value, message", [
    ("topk_method", "noaux_tc", "topk_method"),
    ("scoring_func", "sigmoid", "scoring_func"),
    ("norm_topk_prob", True, "norm_topk_prob"),
    ("moe_layer_freq", 2, "moe_layer_freq"),
])
def test_unsupported_v2_options_are_user_errors(tmp_path, key, value, message):
    save_tiny_deepseek(tmp_path, "deepseek_v2", num_hidden_layers=1)
    config = json.loads((tmp_path / "config.json").read_text())
    config[key] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=message):
        load_config(tmp_path)


def test_bf16_target_keeps_its_router_in_fp32(arch):
    """As transformers does (`_keep_in_fp32_modules_strict`): routing reads fp32 router weights and correction bias
    in a bf16 model, and they keep the checkpoint's values exactly."""
    from safetensors import safe_open

    model = load_model(arch[0].source_dir, dtype="bfloat16", device="cpu")
    layer = model.model.layers[2]
    assert layer.self_attn.kv_b_proj.weight.dtype == torch.bfloat16
    assert layer.mlp.gate.weight.dtype == torch.float32
    with safe_open(f"{model.source_dir}/model.safetensors", "pt") as f:
        assert torch.equal(layer.mlp.gate.weight, f.get_tensor("model.layers.2.mlp.gate.weight"))
        if model.config.model_type == "deepseek_v3":
            bias = layer.mlp.gate.e_score_correction_bias
            assert bias.dtype == torch.float32
            assert torch.equal(bias, f.get_tensor("model.layers.2.mlp.gate.e_score_correction_bias"))
            layer.mlp.to(torch.bfloat16)  # a head cast to bf16 keeps the bias fp32 too
            assert layer.mlp.gate.e_score_correction_bias.dtype == torch.float32
    allocator = PageAllocator(8, page_size=4)
    ids = torch.tensor(arch[2][1])
    out = model(ids, BatchInfo.for_sequences([Sequence(0)], [len(ids)], allocator), model.new_kv_cache(allocator))
    assert torch.isfinite(out.logits).all()
