"""Reduced draft vocabularies (d2t / t2d): the id maps, vocabulary selection and counting, the head's logits and
files, the restricted KL, and the speculative engine (greedy identical, lossless sampling by χ²)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from mtp_train.errors import UserError
from mtp_train.features.draft_vocab import count_next_tokens, coverage_table, load_or_count
from mtp_train.heads import DraftHead, HeadConfig, load_head, save_head
from mtp_train.heads.vocab import (
    check_d2t_t2d,
    coverage,
    d2t_from_ids,
    ids_from_d2t,
    select_draft_vocab,
    t2d_from_ids,
)
from mtp_train.runtime.attention import BatchInfo
from mtp_train.runtime.sampler import SamplingParams
from mtp_train.runtime.spec import speculative_generate
from mtp_train.train.losses import distill_sums, unrolled_losses
from tests.sampling_stats import P_VALUE_THRESHOLD, chi2_p_value
from tests.spec_helpers import (
    LOSSLESS_PROMPT,
    LOSSLESS_SAMPLES,
    SMALL_VOCAB,
    VOCAB,
    exact_first_three_tokens,
    make_prompts,
    run_and_compare,
)


def reduced_head(target, draft_ids: list[int] | torch.Tensor, init: str = "random", seed: int = 0) -> DraftHead:
    draft_ids = torch.as_tensor(draft_ids, dtype=torch.long)
    torch.manual_seed(seed)
    config = HeadConfig.for_target(target.config, kind="mtp", init=init, draft_vocab_size=int(draft_ids.numel()))
    head = DraftHead.from_target(target, config)
    head.set_draft_vocab(draft_ids)
    return head


# ---- the id maps ---------------------------------------------------------------------------------------------------


def test_d2t_t2d_round_trip():
    ids = torch.tensor([0, 3, 4, 9, 17, 18, 40])
    d2t = d2t_from_ids(ids)
    assert d2t.tolist() == [0, 2, 2, 6, 13, 13, 34]  # target id = i + d2t[i] (vLLM / SGLang convention)
    assert torch.equal(ids_from_d2t(d2t), ids)
    t2d = t2d_from_ids(ids, 50)
    assert t2d.dtype == torch.bool and t2d.sum() == 7 and t2d[ids].all()
    assert torch.equal(check_d2t_t2d(d2t, t2d), ids)
    wrong_t2d = t2d.clone()
    wrong_t2d[1] = True
    with pytest.raises(UserError, match="t2d does not mark"):
        check_d2t_t2d(d2t, wrong_t2d)
    with pytest.raises(UserError, match="strictly increasing"):
        check_d2t_t2d(torch.tensor([0, -1, 5]), t2d)  # ids 0, 0, 7
    with pytest.raises(UserError, match=r"\[0, 50\)"):
        check_d2t_t2d(torch.tensor([0, 60]), t2d)


def test_select_draft_vocab_takes_the_most_frequent_ids_lower_id_first_on_ties():
    counts = torch.tensor([5, 0, 9, 5, 1, 9, 5])
    assert select_draft_vocab(counts, 3).tolist() == [0, 2, 5]  # 9, 9, then the first 5 (id 0)
    assert select_draft_vocab(counts, 4).tolist() == [0, 2, 3, 5]
    assert select_draft_vocab(counts, 7).tolist() == list(range(7))
    assert coverage(counts, torch.tensor([2, 5])) == pytest.approx(18 / 34)
    assert [row["coverage"] for row in coverage_table(counts, [1, 7, 100])] == pytest.approx([9 / 34, 1.0, 1.0])
    with pytest.raises(UserError, match="between 1 and 7"):
        select_draft_vocab(counts, 0)


# ---- the head ------------------------------------------------------------------------------------------------------


def test_full_size_draft_vocab_gives_the_full_heads_logits(models):
    target = models["target"]
    torch.manual_seed(0)
    full = DraftHead.from_target(target, HeadConfig.for_target(target.config, kind="mtp", init="random"))
    same = reduced_head(target, torch.arange(VOCAB))
    same.load_state_dict({**full.state_dict(), "d2t": same.d2t, "t2d": same.t2d})
    token_ids = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(1))
    hidden = torch.randn(9, target.config.hidden_size, generator=torch.Generator().manual_seed(2))
    batch = BatchInfo.without_cache([4, 5])
    out_full, out_same = full(token_ids, hidden, batch), same(token_ids, hidden, batch)
    assert torch.equal(out_full, out_same)
    assert torch.equal(full.logits(out_full), same.logits(out_same))
    assert full.draft_ids is None and torch.equal(same.draft_ids, torch.arange(VOCAB))


def test_reduced_head_logits_are_the_full_logits_at_the_draft_ids(models):
    target = models["target"]
    ids = torch.tensor([1, 2, 7, 30, 31, 64, 95])
    head = reduced_head(target, ids)
    out = torch.randn(3, target.config.hidden_size)
    full_logits = F.linear(out, target.lm_head.weight).float()
    assert head.logits(out).shape == (3, 7)
    assert torch.allclose(head.logits(out), full_logits[:, ids])
    assert "d2t" in head.state_dict() and "t2d" in head.state_dict()
    assert not any("lm_head" in key or "embed" in key for key in head.state_dict())
    # A new map replaces the cached projection rows.
    head.set_draft_vocab(torch.tensor([0, 3, 5, 8, 13, 21, 34]))
    assert torch.allclose(head.logits(out), full_logits[:, [0, 3, 5, 8, 13, 21, 34]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reduced_head_save_load_round_trip(models, tmp_path, dtype):
    target = models["target"]
    ids = torch.tensor([0, 4, 9, 11, 50, 90])
    head = reduced_head(target, ids).to(dtype)
    save_head(head, tmp_path / "head")
    config = json.loads((tmp_path / "head" / "head_config.json").read_text())
    assert config["draft_vocab_size"] == 6
    loaded = load_head(tmp_path / "head", target, dtype=dtype)
    assert loaded.d2t.dtype == torch.long and loaded.t2d.dtype == torch.bool
    assert torch.equal(loaded.draft_ids, ids)
    for key, value in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    # A file whose t2d disagrees with d2t is refused, naming the file.
    from safetensors.torch import load_file, save_file

    state = load_file(tmp_path / "head" / "model.safetensors")
    state["t2d"][1] = True
    save_file(state, tmp_path / "head" / "model.safetensors")
    with pytest.raises(UserError, match="model.safetensors.*t2d does not mark"):
        load_head(tmp_path / "head", target)


def test_head_config_refuses_a_draft_vocab_larger_than_the_target():
    with pytest.raises(UserError, match="between 1 and the target's vocab_size 96"):
        HeadConfig(hidden_size=8, vocab_size=96, model_type="llama", draft_vocab_size=97)


# ---- losses --------------------------------------------------------------------------------------------------------

V, D = 40, 12


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_full_draft_ids_give_the_full_vocabulary_losses():
    weight, target = _rand(V, D, seed=0), _rand(10, D, seed=1)
    full = distill_sums(_rand(10, D, seed=2), target, weight, chunk_size=4)
    same = distill_sums(_rand(10, D, seed=2), target, weight, chunk_size=4, draft_ids=torch.arange(V))
    for name in ("kl", "top1", "top3", "alpha", "inside"):
        assert torch.allclose(getattr(full, name), getattr(same, name), atol=1e-5), name
    assert full.inside == 10


@pytest.mark.parametrize("chunk_size", [None, 1, 3, 64])
def test_reduced_kl_is_restricted_renormalized_and_masked(chunk_size):
    weight, target = _rand(V, D, seed=0) * 3, _rand(12, D, seed=1)
    p_full = F.softmax(target @ weight.T, -1)  # [12, V]
    target_top = p_full.argmax(-1)
    # Draft vocabulary: the argmax of 8 of the 12 rows plus a few others.
    ids = torch.unique(torch.cat([target_top[:8], torch.tensor([0, 1, 2])]))
    outside = ~torch.isin(target_top, ids)
    assert outside.any() and not outside.all()
    out = _rand(12, D, seed=2).requires_grad_(True)
    sums = distill_sums(out, target, weight, chunk_size=chunk_size, draft_ids=ids)
    sums.kl.backward()
    # Reference: plain autograd over the restricted, renormalized distributions, masked rows dropped.
    ref_out = _rand(12, D, seed=2).requires_grad_(True)
    p = F.softmax(target @ weight[ids].T, -1)
    log_q = F.log_softmax(ref_out @ weight[ids].T, -1)
    kl_rows = (p * (p.log() - log_q)).sum(-1)
    ref_kl = kl_rows[~outside].sum()
    ref_kl.backward()
    assert torch.allclose(sums.kl, ref_kl, atol=1e-4)
    assert torch.allclose(out.grad, ref_out.grad, atol=1e-5)
    assert out.grad[outside].abs().max() == 0  # masked rows get no gradient
    assert sums.inside == int((~outside).sum())
    q = log_q.exp().detach()
    draft_top = ids[q.argmax(-1)]
    assert sums.top1 == (draft_top == target_top).sum()  # against the full-vocabulary argmax, all rows
    assert torch.allclose(sums.alpha, torch.minimum(p_full[:, ids], q).sum(), atol=1e-5)


@pytest.mark.parametrize("chunk_size", [None, 5])
def test_a_stored_target_argmax_gives_the_same_losses_without_full_logits(chunk_size):
    weight, target = _rand(V, D, seed=0) * 3, _rand(12, D, seed=1)
    target_top = (target @ weight.T).argmax(-1)
    ids = torch.unique(torch.cat([target_top[:8], torch.tensor([0, 1, 2])]))
    results, grads = [], []
    for known in (None, target_top):
        out = _rand(12, D, seed=2).requires_grad_(True)
        sums = distill_sums(out, target, weight, chunk_size=chunk_size, draft_ids=ids, target_top=known)
        sums.kl.backward()
        results.append(sums)
        grads.append(out.grad)
    full, known = results
    for name in ("kl", "top1", "top3", "inside"):
        assert torch.allclose(getattr(full, name), getattr(known, name), atol=1e-5), name
    assert torch.allclose(grads[0], grads[1], atol=1e-6)
    assert known.alpha >= full.alpha - 1e-6  # α within the draft vocabulary bounds the full one from above


def test_unrolled_losses_report_coverage_with_a_reduced_head(models):
    target = models["target"]
    ids = torch.arange(0, VOCAB, 2)  # even ids only
    head = reduced_head(target, ids)
    token_ids = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(0))
    hidden = torch.randn(20, target.config.hidden_size, generator=torch.Generator().manual_seed(1))
    loss, metrics = unrolled_losses(head, token_ids, hidden, torch.ones(20, dtype=torch.uint8), [12, 8], 2)
    loss.backward()
    for k in (1, 2):
        assert 0.0 < float(metrics[f"step{k}/coverage"]) < 1.0
    assert head.eh_proj.weight.grad is not None


# ---- speculative engine --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_mtp_chain_with_reduced_vocab_matches_generate(models, k):
    target = models["target"]
    head = reduced_head(target, torch.arange(0, VOCAB, 3), init="last_layer")
    for batch_size in (1, 4):
        _, stats = run_and_compare(target, head, make_prompts(batch_size), 24, k)
        assert stats.drafted_tokens > 0


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_drafts_are_target_ids_from_the_draft_vocabulary(models, monkeypatch, greedy):
    """A head whose draft vocabulary holds only odd target ids drafts only odd ids and feeds only those back into its
    chain (the drafted tokens, mapped through d2t), greedy or sampled; greedy output is still plain greedy's."""
    from mtp_train.runtime.sampler import SamplingParams
    from mtp_train.runtime.spec import speculative_generate
    from mtp_train.runtime.spec.mtp_chain import MTPChainProposer

    fed_back: list[int] = []
    drafted: list[int] = []
    original_step, original_propose = MTPChainProposer.draft_step, MTPChainProposer.propose

    def recording_step(self, requests, token_ids, carried):
        fed_back.extend(token_ids.tolist())
        return original_step(self, requests, token_ids, carried)

    def recording_propose(self, *args):
        proposals = original_propose(self, *args)
        drafted.extend(t for p in proposals for t in p.draft_token_ids.tolist())
        return proposals

    monkeypatch.setattr(MTPChainProposer, "draft_step", recording_step)
    monkeypatch.setattr(MTPChainProposer, "propose", recording_propose)
    head = reduced_head(models["target"], torch.arange(1, VOCAB, 2), init="last_layer")
    if greedy:
        run_and_compare(models["target"], head, make_prompts(4), 32, 3)
    else:
        speculative_generate(models["target"], head, make_prompts(4), 32, 3, sampling=SamplingParams(temperature=1.0))
    assert fed_back and all(token % 2 == 1 for token in fed_back)
    assert drafted and all(token % 2 == 1 for token in drafted)


@pytest.mark.slow  # 2,000 sequences per χ² test: 3-4 s each
@pytest.mark.parametrize(
    "k, sampling",
    [(2, SamplingParams(temperature=1.0)), (1, SamplingParams(temperature=0.8, top_p=0.9))],
)
def test_sampling_with_a_reduced_draft_vocab_is_lossless_chi2(small_vocab_target, k, sampling):
    """Same end-to-end χ² as for the full vocabulary (tests/test_speculative.py), with a head that can propose only
    5 of the 8 tokens: q is zero elsewhere, and the joint of the first three tokens still equals plain sampling."""
    target = small_vocab_target
    head = reduced_head(target, [0, 2, 3, 5, 6], init="last_layer")
    results, stats = speculative_generate(
        target, head, [LOSSLESS_PROMPT] * LOSSLESS_SAMPLES, 4, k, sampling, seed=13, page_size=4
    )
    assert 0.05 < stats.alpha < 0.95
    tokens = torch.tensor([r.token_ids[:3] for r in results])  # [N, 3]
    cells = (tokens[:, 0] * SMALL_VOCAB + tokens[:, 1]) * SMALL_VOCAB + tokens[:, 2]
    counts = torch.bincount(cells, minlength=SMALL_VOCAB**3)
    expected = exact_first_three_tokens(target, LOSSLESS_PROMPT, sampling).flatten()
    assert chi2_p_value(counts, expected) > P_VALUE_THRESHOLD


# ---- counting, the CLI and training with a reduced vocabulary -------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_features(tmp_path_factory):
    from mtp_train.features.precompute import run_precompute
    from tests.pipeline_fixtures import tiny_pipeline

    root = tmp_path_factory.mktemp("draft-vocab")
    recipe, overrides = tiny_pipeline(
        root, num_conversations=40, **{"train.micro_batch_tokens": 256, "train.warmup_steps": 2, "train.lr": 3e-3,
                                       "train.eval_every": 4, "train.save_every": 100}
    )
    run_precompute(recipe)
    return root, recipe, overrides


def _expected_counts(features_dir, vocab_size: int, label_of) -> torch.Tensor:
    """Label counts recomputed sample by sample from the shards: `label_of(batch, rows)` gives the labels of the
    packed positions `rows` (loss positions j >= 2 of each sample)."""
    from mtp_train.features.reader import FeatureReader

    reader = FeatureReader(features_dir, "train", micro_batch_tokens=10**9)
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for positions in reader.epoch_batches(0):
        batch = reader.load(positions)
        start = 0
        for n in batch.lengths:
            mask = batch.loss_mask[start : start + n].bool().clone()
            mask[:2] = False
            counts += torch.bincount(label_of(batch, mask.nonzero().squeeze(1) + start), minlength=vocab_size)
            start += n
    return counts


def test_counts_from_data_and_target(tiny_features):
    from mtp_train.runtime.loader import load_model

    root, recipe, _ = tiny_features
    target = load_model(recipe.target.path, dtype="float32", device="cpu")
    features_dir = root / "features"
    vocab = target.config.vocab_size
    data_counts = count_next_tokens(features_dir, "data", vocab, progress=False)
    assert torch.equal(data_counts, _expected_counts(features_dir, vocab, lambda batch, rows: batch.input_ids[rows]))
    with torch.inference_mode():
        target_counts = count_next_tokens(features_dir, "target", vocab, target.lm_head.weight, progress=False)
    assert target_counts.sum() == data_counts.sum()  # one label per counted row either way
    # The target's argmax labels, recomputed directly from the stored hidden states.
    expected = _expected_counts(
        features_dir, vocab, lambda batch, rows: (batch.hidden[rows - 1] @ target.lm_head.weight.T).argmax(-1)
    )
    assert torch.equal(target_counts, expected)
    # Precompute stored the same argmax per position (from the stored hidden states).
    manifest = json.loads((features_dir / "manifest.json").read_text())
    assert manifest["target_argmax"] is True
    from mtp_train.features.reader import FeatureReader

    reader = FeatureReader(features_dir, "train", micro_batch_tokens=10**9)
    batch = reader.load(reader.epoch_batches(0)[0])
    assert torch.equal(batch.target_argmax, (batch.hidden @ target.lm_head.weight.T).argmax(-1))
    # Ranks split the samples; their counts add up to the single-process count.
    halves = [count_next_tokens(features_dir, "data", vocab, progress=False, rank=r, world_size=2) for r in (0, 1)]
    assert torch.equal(halves[0] + halves[1], data_counts) and halves[0].sum() > 0 and halves[1].sum() > 0
    # Cached: a second call reads the file.
    cached = load_or_count(features_dir, "data", vocab, progress=False)
    assert torch.equal(cached, data_counts)
    assert (features_dir / "draft_vocab" / "data-counts.safetensors").is_file()


def test_draft_vocab_cli_reads_only_the_lm_head(tiny_features, capsys, monkeypatch):
    from mtp_train.cli import main
    from mtp_train.features.draft_vocab import counts_path
    from mtp_train.runtime.loader import load_model
    from mtp_train.runtime.model import CausalLM
    from tests.pipeline_fixtures import RECIPE_PATH

    root, recipe, overrides = tiny_features
    features_dir = root / "features"
    target = load_model(recipe.target.path, dtype="float32", device="cpu")
    expected = count_next_tokens(features_dir, "target", target.config.vocab_size, target.lm_head.weight,
                                 progress=False)
    counts_path(features_dir, "target").unlink(missing_ok=True)  # counted again by the command, not read back

    def no_target(*_args, **_kwargs):
        raise AssertionError("draft-vocab built the whole target")

    monkeypatch.setattr(CausalLM, "__init__", no_target)
    sets = [a for o in overrides + ["precision.compute=float32"] for a in ("--set", o)]
    assert main(["draft-vocab", "--recipe", str(RECIPE_PATH), *sets, "--source", "target", "--sizes", "8"]) == 0
    capsys.readouterr()
    assert torch.equal(load_or_count(features_dir, "target", target.config.vocab_size, progress=False), expected)
    report = json.loads((features_dir / "draft_vocab" / "target-coverage.json").read_text())
    assert report["labels"] == int(expected.sum()) and report["distinct"] == int((expected > 0).sum())


@pytest.mark.slow
def test_draft_vocab_cli_and_training_with_a_reduced_vocab(tiny_features, capsys):
    from mtp_train.cli import main
    from mtp_train.runtime.loader import load_model
    from mtp_train.train.trainer import run_training
    from mtp_train.recipe import load_recipe
    from tests.pipeline_fixtures import RECIPE_PATH

    root, _, overrides = tiny_features
    sets = [a for o in overrides for a in ("--set", o)]
    assert main(["draft-vocab", "--recipe", str(RECIPE_PATH), *sets, "--source", "data", "--sizes", "8", "40"]) == 0
    printed = capsys.readouterr().out
    assert "coverage" in printed and (root / "features" / "draft_vocab" / "data-coverage.json").is_file()
    report = json.loads((root / "features" / "draft_vocab" / "data-coverage.json").read_text())
    assert [row["draft_vocab_size"] for row in report["coverage"]] == [8, 40]
    assert 0 < report["coverage"][0]["coverage"] < report["coverage"][1]["coverage"] <= 1

    recipe = load_recipe(RECIPE_PATH, overrides + [
        f"train.run_dir={root / 'run-reduced'}", "train.max_steps=8", "head.draft_vocab_size=40",
        "head.draft_vocab_source=data",
    ])
    run_training(recipe, show_progress=False)
    target = load_model(recipe.target.path, dtype="float32", device="cpu")
    head = load_head(root / "run-reduced" / "head", target)
    counts = load_or_count(root / "features", "data", target.config.vocab_size, progress=False)
    assert torch.equal(head.draft_ids, select_draft_vocab(counts, 40))
    summary = json.loads((root / "run-reduced" / "summary.json").read_text())
    assert summary["draft_vocab_size"] == 40
    assert summary["draft_vocab_coverage"] == pytest.approx(coverage(counts, head.draft_ids))
    assert 0 < summary["val/step1/coverage"] <= 1 and "val/step1/top1" in summary
    # The trained reduced head drafts through the engine, greedy output unchanged.
    vocab = target.config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 9)]
    run_and_compare(target, head, prompts, 16, 2)
