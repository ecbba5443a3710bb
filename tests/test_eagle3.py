"""EAGLE-3 heads (`head.kind: eagle3`, heads/eagle3.py): the layout and forward, the draft loop against an independent
reference written after vLLM 0.32's `llama_eagle3.py` + `llm_base_proposer.py`, greedy speculative decoding, training
on a feature cache with aux layers, the `eagle3` export format, and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mtp_train.errors import UserError
from mtp_train.heads import HeadConfig, head_class
from mtp_train.runtime.attention import BatchInfo
from tests.pipeline_fixtures import RECIPE_PATH, make_tiny_target, synthetic_sharegpt, tiny_recipe_overrides
from tests.tiny_models import save_tiny_model

AUX = (0, 1, 3)  # low, middle, high of the 4-layer tiny target
DRAFT_IDS = torch.arange(0, 96, 2)  # a reduced draft vocabulary: the 48 even ids of the vocab-96 target


@pytest.fixture(scope="module")
def target4_dir(tmp_path_factory) -> Path:
    """A tiny 4-layer Llama (d=64, vocab 96) saved to disk."""
    return save_tiny_model(tmp_path_factory.mktemp("t4") / "target", "llama", seed=3, num_hidden_layers=4)


@pytest.fixture(scope="module")
def target4(target4_dir):
    """`target4_dir` loaded as a float32 CPU `CausalLM`."""
    from mtp_train.runtime.loader import load_model

    return load_model(target4_dir, dtype="float32", device="cpu")


def _head(target, draft_vocab: bool = True, seed: int = 0, scale: float = 1.0):
    """A random eagle3 head over `target` (weights scaled by `scale`, so its drafts are not all the same token)."""
    config = HeadConfig.for_target(target.config, target.fingerprint, kind="eagle3", aux_layers=AUX,
                                   draft_vocab_size=DRAFT_IDS.numel() if draft_vocab else None)
    torch.manual_seed(seed)
    head = head_class("eagle3").from_target(target, config)
    if draft_vocab:
        head.set_draft_vocab(DRAFT_IDS)
    with torch.no_grad():
        for name, param in head.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.1)
            else:
                param.mul_(scale)
    return head.eval()


# ---- layout and forward ---------------------------------------------------------------------------------------------


def test_layout_and_forward_shapes(target4):
    head = _head(target4)
    d = target4.config.hidden_size
    shapes = {name: tuple(t.shape) for name, t in head.state_dict().items()}
    assert shapes["fc.weight"] == (d, 3 * d) and "fc.bias" not in shapes
    assert shapes["layers.0.self_attn.q_proj.weight"] == (64, 2 * d)
    assert shapes["layers.0.self_attn.k_proj.weight"] == (32, 2 * d)
    assert shapes["layers.0.hidden_norm.weight"] == (d,) and shapes["norm.weight"] == (d,)
    assert shapes["d2t"] == (48,) and shapes["t2d"] == (96,)
    assert not [n for n in shapes if "embed" in n or "lm_head" in n]
    tokens = torch.tensor([5, 6, 7, 8])
    batch = BatchInfo.without_cache([4], torch.device("cpu"))
    out = head(tokens, torch.randn(4, 3 * d), batch)  # the target's aux states, fused by fc
    again = head(tokens, out, batch)  # its own output fed back
    assert out.shape == again.shape == (4, d)
    assert head.logits(out).shape == (4, 48)
    with pytest.raises(ValueError, match="reads"):
        head(tokens, torch.randn(4, 2 * d), batch)


def _vllm_reference_drafts(target, head, tokens: list[int], k: int) -> list[int]:
    """k greedy drafts after the committed `tokens`, computed as vLLM 0.32 does, with plain tensors and no KV cache:
    the target's aux states are `hidden_states + residual` captured around the layers (llama.py), the first pass
    runs rows (combine_hidden_states(aux_i), t_{i+1}) at positions i, each next pass appends the row (hidden_prenorm
    of the last row, last draft) at the next position; the midlayer keeps vLLM's residual bookkeeping
    (norm_before_residual false: the residual is the unnormalized input), `norm(hidden, residual)` returns
    (normed, prenorm), and `compute_logits` scatters the draft logits to -inf-filled target-vocabulary rows."""
    from mtp_train.runtime.model import apply_rotary

    sd = {name: t.detach().float() for name, t in head.state_dict().items()}
    c = target.config
    eps = c.rms_norm_eps

    def rms(x, weight, residual=None):  # vLLM RMSNorm: with a residual, adds it first and returns both
        if residual is not None:
            x = x + residual
            return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)), x
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    with torch.no_grad():
        out = target(torch.tensor(tokens), BatchInfo.without_cache([len(tokens)], torch.device("cpu")),
                     aux_layers=AUX, compute_logits=False)
        aux = torch.cat([out.aux_hidden[j] for j in AUX], dim=-1).float()  # [L, 3d]
        rows_hidden = list(F.linear(aux[:-1], sd["fc.weight"]))  # combine_hidden_states, rows i = 0..L-2
        rows_tokens = tokens[1:]
        drafts: list[int] = []
        for _ in range(k):
            n = len(rows_tokens)
            h = torch.stack(rows_hidden)  # [n, d]
            embeds = head.embed_weight.float()[torch.tensor(rows_tokens)]
            p = "layers.0."
            hidden_normed, residual = rms(h, sd[p + "hidden_norm.weight"]), h
            x = torch.cat([rms(embeds, sd[p + "input_layernorm.weight"]), hidden_normed], dim=-1)
            q = F.linear(x, sd[p + "self_attn.q_proj.weight"]).view(n, c.num_attention_heads, c.head_dim)
            key = F.linear(x, sd[p + "self_attn.k_proj.weight"]).view(n, c.num_key_value_heads, c.head_dim)
            v = F.linear(x, sd[p + "self_attn.v_proj.weight"]).view(n, c.num_key_value_heads, c.head_dim)
            cos, sin = head._rope(torch.arange(n), torch.float32)  # positions 0..n-1 (row i reads H_i)
            q, key = apply_rotary(q, cos, sin), apply_rotary(key, cos, sin)
            groups = c.num_attention_heads // c.num_key_value_heads
            key, v = key.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
            scores = torch.einsum("qhd,khd->hqk", q, key) * c.head_dim**-0.5
            scores = scores.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
            attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)
            attn = F.linear(attn, sd[p + "self_attn.o_proj.weight"])
            normed, residual = rms(attn, sd[p + "post_attention_layernorm.weight"], residual)
            mlp = F.linear(F.silu(F.linear(normed, sd[p + "mlp.gate_proj.weight"])) *
                           F.linear(normed, sd[p + "mlp.up_proj.weight"]), sd[p + "mlp.down_proj.weight"])
            final, prenorm = rms(mlp, sd["norm.weight"], residual)
            logits = F.linear(final[-1], head.lm_head_weight.float()[DRAFT_IDS])  # the draft lm_head
            full = torch.full((c.vocab_size,), float("-inf"))
            full[DRAFT_IDS] = logits  # compute_logits: base + draft_id_to_target_id
            drafts.append(int(full.argmax()))
            rows_hidden.append(prenorm[-1])  # hidden_prenorm fed back
            rows_tokens = rows_tokens + [drafts[-1]]
    return drafts


def test_draft_loop_matches_the_vllm_reference(target4):
    """The first speculative step's k drafts (the proposer's catch-up then k-1 draft steps through the paged cache)
    equal the reference loop's, token for token."""
    from mtp_train.runtime.generate import generate
    from mtp_train.runtime.spec import speculative_generate

    head = _head(target4, scale=8.0)
    seen: list[torch.Tensor] = []
    logits = head.logits
    head.logits = lambda out: seen.append(logits(out)) or seen[-1]  # the drafts' logits, in call order
    prompt, k = [3, 17, 42, 8, 25, 61, 9], 3
    speculative_generate(target4, head, [prompt], 8, k)
    first = generate(target4, [prompt], 1)[0][0].token_ids
    ours = [int(DRAFT_IDS[row.argmax(-1)]) for row in seen[:k]]
    assert ours == _vllm_reference_drafts(target4, head, prompt + first, k)
    assert len(set(ours)) > 1  # the drafts differ: the comparison is not vacuous


@pytest.mark.parametrize("draft_vocab", [True, False], ids=["draft-vocab", "full-vocab"])
def test_greedy_speculative_output_equals_plain_greedy(target4, draft_vocab):
    from tests.spec_helpers import make_prompts, run_and_compare

    head = _head(target4, draft_vocab=draft_vocab, scale=8.0)
    for k in (1, 3):
        run_and_compare(target4, head, make_prompts(4), 12, k)


# ---- training ---------------------------------------------------------------------------------------------------

TRAIN = {"train.micro_batch_tokens": 256, "train.warmup_steps": 2, "train.lr": 3e-3, "train.zero_stage": 2,
         "train.eval_every": 8, "train.save_every": 100, "head.kind": "eagle3",
         "precompute.aux_layers": "[0, 1, 3]", "head.draft_vocab_size": 48}


def _eagle3_pipeline(root: Path, aux_layers: str = "[0, 1, 3]", **extra) -> list[str]:
    """A tiny pipeline (4-layer target, 40 conversations) prepared and precomputed with `aux_layers`; returns the
    recipe overrides (eagle3 head)."""
    from mtp_train.data.prepare import prepare_dataset
    from mtp_train.features.precompute import run_precompute
    from mtp_train.recipe import load_recipe

    root.mkdir(parents=True, exist_ok=True)
    target = make_tiny_target(root / "target", num_hidden_layers=4)
    source = synthetic_sharegpt(root / "chats.jsonl", 40)
    overrides = tiny_recipe_overrides(root, target, source, **{**TRAIN, "precompute.aux_layers": aux_layers, **extra})
    recipe = load_recipe(RECIPE_PATH, overrides)
    prepare_dataset(recipe, show_progress=False)
    run_precompute(recipe)
    return overrides


@pytest.fixture(scope="module")
def eagle3_features(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3-train")
    return root, _eagle3_pipeline(root)


def test_training_lowers_the_loss_and_saves_an_eagle3_head(eagle3_features):
    from mtp_train.recipe import load_recipe
    from mtp_train.train.trainer import run_training

    root, overrides = eagle3_features
    run_dir = root / "run"
    recipe = load_recipe(RECIPE_PATH, overrides + [f"train.run_dir={run_dir}", "train.max_steps=24",
                                                   "train.unroll_steps=3"])
    run_training(recipe, show_progress=False)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first = sum(r["loss"] for r in rows[:4]) / 4
    last = sum(r["loss"] for r in rows[-4:]) / 4
    assert last < first * 0.9, (first, last)
    assert {"val/step1/top1", "val/step3/top1"} <= set(rows[-1])  # validation ran, test-time steps included
    config = json.loads((run_dir / "head" / "head_config.json").read_text())
    assert config["kind"] == "eagle3" and config["aux_layers"] == [0, 1, 3] and config["draft_vocab_size"] == 48


def test_cache_without_the_aux_layers_is_refused(eagle3_features, tmp_path):
    """A cache built with other aux layers than the head reads: refused before training, naming the layers and
    precompute.aux_layers."""
    from mtp_train.features.reader import FeatureReader

    root, _ = eagle3_features
    with pytest.raises(UserError, match=r"precompute\.aux_layers: \[0, 2, 3\].*precompute --force") as err:
        FeatureReader(root / "features", "train", aux_layers=(0, 2, 3))
    assert "manifest.json" in str(err.value) and "[2] not stored" in str(err.value)
    batch = FeatureReader(root / "features", "train", aux_layers=(1, 3)).load([0])
    full = FeatureReader(root / "features", "train").load([0])
    assert torch.equal(batch.aux_hidden, full.aux_hidden[:, 1:])  # the head's layers, in its order


def test_wrong_number_of_aux_layers_is_refused(target4):
    from mtp_train.recipe import load_recipe

    for layers in ((0, 3), (0, 1, 2, 3), (3, 1, 0), (1, 1, 3)):
        with pytest.raises(UserError, match="exactly 3 distinct target layers"):
            HeadConfig.for_target(target4.config, kind="eagle3", aux_layers=layers)
    with pytest.raises(UserError, match=r"out of range; the target has 4 decoder layers"):
        HeadConfig.for_target(target4.config, kind="eagle3", aux_layers=(0, 1, 4))
    with pytest.raises(UserError, match="inputs of an eagle3 head"):
        HeadConfig.for_target(target4.config, kind="mtp", aux_layers=(0, 1, 3))
    with pytest.raises(UserError, match="init 'last_layer' is not available"):
        HeadConfig.for_target(target4.config, kind="eagle3", aux_layers=AUX, init="last_layer")
    with pytest.raises(UserError, match=r"precompute\.aux_layers=\[\]"):
        load_recipe(RECIPE_PATH, ["head.kind=eagle3"])
    with pytest.raises(UserError, match=r"precompute\.aux_layers=\[1, 14\]"):
        load_recipe(RECIPE_PATH, ["head.kind=eagle3", "precompute.aux_layers=[1, 14]"])


# ---- export -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("draft_vocab", [True, False], ids=["draft-vocab", "full-vocab"])
def test_export_round_trip_loads_back_identically(target4, target4_dir, tmp_path, draft_vocab):
    from safetensors.torch import load_file

    from mtp_train.export import export_head, inspect_dir, load_any_head
    from mtp_train.export.inspection import format_report
    from mtp_train.heads import save_head

    head = _head(target4, draft_vocab=draft_vocab, scale=8.0)
    save_head(head, tmp_path / "head")
    out = export_head(tmp_path / "head", "eagle3", tmp_path / "eagle3", target4_dir, num_speculative_tokens=2)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["norm_before_residual"] is False
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]  # vLLM counts layer inputs: ours + 1
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 2
    assert config["transformer_layer_config"]["num_hidden_layers"] == 1
    assert config.get("draft_vocab_size") == (48 if draft_vocab else None)
    tensors = load_file(out / "model.safetensors")
    assert "midlayer.hidden_norm.weight" in tensors and "embed_tokens.weight" not in tensors
    rows = DRAFT_IDS if draft_vocab else torch.arange(96)
    assert torch.equal(tensors["lm_head.weight"], target4.lm_head.weight.detach()[rows])
    assert ("d2t" in tensors) == draft_vocab
    report = inspect_dir(out, target4)
    assert report.ok, format_report(report)
    loaded = load_any_head(out, target4)
    assert type(loaded) is type(head)
    original = head.state_dict()
    assert {k: v.dtype for k, v in loaded.state_dict().items()} == {k: v.dtype for k, v in original.items()}
    assert all(torch.equal(v, original[k]) for k, v in loaded.state_dict().items())
    batch = BatchInfo.without_cache([5], torch.device("cpu"))
    tokens, aux = torch.tensor([3, 4, 5, 6, 7]), torch.randn(5, 192)
    assert torch.equal(loaded.logits(loaded(tokens, aux, batch)), head.logits(head(tokens, aux, batch)))


def test_export_refusals(target, target_dir, target4, target4_dir, tmp_path):
    from mtp_train.export import export_head, load_any_head
    from mtp_train.heads import DraftHead, save_head

    mtp = DraftHead.from_target(target, HeadConfig.for_target(target.config, target.fingerprint, kind="mtp"))
    save_head(mtp, tmp_path / "mtp")
    with pytest.raises(UserError, match="format eagle3 holds EAGLE-3 heads"):
        export_head(tmp_path / "mtp", "eagle3", tmp_path / "out-mtp", target_dir)
    save_head(_head(target4), tmp_path / "e3")
    with pytest.raises(UserError, match="cannot export"):
        export_head(tmp_path / "e3", "eagle", tmp_path / "out-eagle", target4_dir)
    out = export_head(tmp_path / "e3", "eagle3", tmp_path / "out", target4_dir)
    config = json.loads((out / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [0, 1, 3]  # our ids written as vLLM's: off by one layer
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=r"vLLM captures layer i's input: expected \[1, 2, 4\]"):
        load_any_head(out, target4)


@pytest.mark.parametrize("arch, block", [("qwen2", "llama"), ("qwen3", "qwen3"), ("mistral", "llama")])
def test_draft_block_is_the_engines_not_the_targets(tmp_path, arch, block):
    """A Qwen2 target's biases and a Mistral target's window are not copied into the midlayer (vLLM's Llama EAGLE-3
    draft has neither); a Qwen3 target gets vLLM's Qwen3-style draft (q/k norms). Each exports and loads back."""
    from mtp_train.export import export_head, load_any_head
    from mtp_train.heads import save_head
    from mtp_train.runtime.loader import load_model

    overrides = {"sliding_window": 8} if arch == "mistral" else {}
    target_dir = save_tiny_model(tmp_path / "target", arch, seed=1, num_hidden_layers=4, **overrides)
    target = load_model(target_dir, dtype="float32", device="cpu")
    head = _head(target)
    names = set(head.state_dict())
    assert not any(name.endswith(".bias") for name in names)
    assert ("layers.0.self_attn.q_norm.weight" in names) == (block == "qwen3")
    save_head(head, tmp_path / "head")
    out = export_head(tmp_path / "head", "eagle3", tmp_path / "out", target_dir)
    layer = json.loads((out / "config.json").read_text())["transformer_layer_config"]
    assert layer["model_type"] == block and "sliding_window" not in layer and not layer["attention_bias"]
    loaded = load_any_head(out, target)
    assert set(loaded.state_dict()) - {"d2t", "t2d"} == names - {"d2t", "t2d"}
