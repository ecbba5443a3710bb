"""Speculative decoding (`runtime/spec/`): greedy output token-identical to plain `generate()` for the MTP
chain and the target–draft schedules, page accounting, stop tokens / max_new_tokens, statistics, lossless sampling
end to end (χ²), input validation, the `generate --head/--draft` CLI, and the real SmolLM2.

χ² tests are seeded (deterministic) and fail when the p-value is below `P_VALUE_THRESHOLD` = 1e-3 (see
tests/sampling_stats.py for the helper and the threshold's rationale). The models are fixtures of tests/conftest.py;
the prompts and the greedy comparison are in tests/spec_helpers.py.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from mtp_train.errors import UserError
from mtp_train.heads import DraftHead, HeadConfig, save_head
from mtp_train.runtime.generate import generate
from mtp_train.runtime.kv_cache import PageAllocator
from mtp_train.runtime.loader import load_model
from mtp_train.runtime.sampler import SamplingParams
from mtp_train.runtime.spec import HybridDraft, PromptLookup, SpecStats, speculative_generate
from mtp_train.runtime.spec.mtp_chain import MTPChainProposer
from mtp_train.runtime.spec.prompt_lookup import PromptLookupProposer, ngram_next_token
from mtp_train.runtime.spec.target_draft import TargetDraftProposer
from tests.margin_checks import assert_clear_decode_margins
from tests.sampling_stats import P_VALUE_THRESHOLD, chi2_p_value
from tests.spec_helpers import (
    LOSSLESS_PROMPT,
    LOSSLESS_SAMPLES,
    PENALTY_PROMPT,
    SMALL_VOCAB,
    exact_first_three_tokens,
    make_prompts,
    run_and_compare,
)
from tests.tiny_models import save_tiny_model


def make_head(target, init: str) -> DraftHead:
    torch.manual_seed(0)
    return DraftHead.from_target(target, HeadConfig.for_target(target.config, kind="mtp", init=init))


# ---- greedy: token-identical to plain generate -----------------------------------------------------------------------


@pytest.mark.parametrize("init", ["random", "last_layer"])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_greedy_mtp_chain_matches_generate(models, init, k):
    target = models["target"]
    head = make_head(target, init)
    for batch_size in (1, 4):
        _, stats = run_and_compare(target, head, make_prompts(batch_size), 24, k)
        assert stats.schedule == MTPChainProposer.schedule
        assert stats.drafted_tokens <= k * stats.verify_sequence_steps  # each verify checks <= k drafts


@pytest.mark.parametrize("draft_name", ["other_seed", "noisy_copy", "self"])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_greedy_target_draft_matches_generate(models, draft_name, k):
    target = models["target"]
    draft = target if draft_name == "self" else models[draft_name]
    for batch_size in (1, 4):
        _, stats = run_and_compare(target, draft, make_prompts(batch_size, seed=k), 24, k)
        assert stats.schedule == TargetDraftProposer.schedule
        if draft_name == "noisy_copy" and batch_size == 4:  # both catch-up paths: partial and full acceptance
            assert 0 < stats.alpha < 1


def test_mtp_chain_with_a_last_layer_head_accepts_some_drafts(models):
    """The last-layer initialized head is a (weak) predictor of the target: some drafts are accepted, so the
    rebuild-after-partial-acceptance path runs in the identity tests above."""
    _, stats = run_and_compare(models["target"], make_head(models["target"], "last_layer"), make_prompts(4), 24, 3)
    assert 0 < stats.alpha < 1 and stats.tau > 1


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_target_as_its_own_draft_accepts_everything(models, k):
    target = models["target"]
    steps = 3
    max_new_tokens = 1 + steps * (k + 1)  # the prefill's token, then `steps` full steps
    _, stats = run_and_compare(target, target, make_prompts(1), max_new_tokens, k)
    assert stats.alpha == 1.0 and stats.acceptance_per_position == [1.0] * k
    assert stats.drafted_per_position == [steps] * k
    # Cost: one target forward per step; draft: a catch-up forward before each step (after the prefill: prompt +
    # first token; after a verify: d_k + bonus) and k-1 single-token steps.
    assert stats.target_forwards == 1 + steps
    assert stats.draft_forwards == steps * (1 + (k - 1))
    assert stats.committed_per_verify == k + 1
    assert math.isclose(stats.tau, max_new_tokens / (1 + steps))  # τ counts the prefill's forward and token


def test_an_allocator_passed_again_brings_its_caches(models, monkeypatch):
    """A caller decoding batch after batch over one allocator (the eval's `PagePool`) builds the target's and the
    draft's K/V caches on its first call only; the outputs are those of fresh caches (a reused slot is written
    before it is read), and the target drafting for itself gets a draft cache of its own."""
    from mtp_train.runtime.model import CausalLM

    target = models["target"]
    head = make_head(target, "last_layer")
    allocator = PageAllocator(64, page_size=4)
    built = []
    for cls in (CausalLM, DraftHead):
        original = cls.new_kv_cache

        def counting(self, pages, original=original):
            if pages is allocator:
                built.append(type(self).__name__)
            return original(self, pages)
        monkeypatch.setattr(cls, "new_kv_cache", counting)
    for seed in range(3):
        prompts = make_prompts(3, seed=seed)
        plain, _ = generate(target, prompts, 20, page_size=4)
        for draft in (head, target):
            fresh, _ = speculative_generate(target, draft, prompts, 20, 3, page_size=4)
            reused, _ = speculative_generate(target, draft, prompts, 20, 3, allocator=allocator)
            assert [r.token_ids for r in reused] == [r.token_ids for r in fresh] == [r.token_ids for r in plain]
        again, _ = generate(target, prompts, 20, allocator=allocator)
        assert [r.token_ids for r in again] == [r.token_ids for r in plain]
        assert allocator.num_free == allocator.num_pages
    # the target's cache, the head's, and the target's own as its draft: once each over three rounds of calls
    assert sorted(built) == ["CausalLM", "CausalLM", "DraftHead"]


def test_stats_definitions():
    stats = SpecStats(MTPChainProposer.schedule, 2, target_forwards=4, target_sequence_forwards=4,
                      verify_sequence_steps=3, new_tokens=7, prefill_tokens=1, drafted_tokens=6, accepted_tokens=3,
                      drafted_per_position=[3, 3], accepted_per_position=[2, 1], prefill_seconds=0.5,
                      decode_seconds=1.25)
    assert stats.tau == 7 / 4  # the prefill's forward and token count
    assert stats.committed_per_verify == 2.0
    assert stats.alpha == 0.5
    assert stats.acceptance_per_position == [2 / 3, 1 / 3]  # unconditional: accepted at j / drafted at j
    assert stats.tokens_per_s == 7 / 1.75
    assert stats.to_dict()["acceptance_per_position"] == [0.6667, 0.3333]
    # Summing calls (what the evaluation does) adds every counter; the rates are those of the summed counters.
    total = SpecStats(MTPChainProposer.schedule, 2)
    total.add(stats)
    total.add(SpecStats(MTPChainProposer.schedule, 2, target_sequence_forwards=2, verify_sequence_steps=1, new_tokens=3,
                        prefill_tokens=1, drafted_tokens=2, accepted_tokens=1, drafted_per_position=[1, 1],
                        accepted_per_position=[1, 0]))
    assert (total.tau, total.committed_per_verify, total.alpha) == (10 / 6, 8 / 4, 4 / 8)
    assert total.drafted_per_position == [4, 4] and total.accepted_per_position == [3, 1]
    with pytest.raises(ValueError, match="cannot add"):
        total.add(SpecStats(MTPChainProposer.schedule, 3))


# ---- stop tokens, max_new_tokens, pages ----------------------------------------------------------------------------


@pytest.mark.parametrize("draft_name", ["self", "mtp_last_layer"])
def test_stop_tokens_cut_the_committed_block(models, draft_name):
    """A stop token in the middle of an accepted block ends the sequence there; later tokens are dropped."""
    target = models["target"]
    draft = target if draft_name == "self" else make_head(target, "last_layer")
    prompts = make_prompts(4)
    reference, _ = generate(target, prompts, 24, page_size=4)
    stop = reference[1].token_ids[6]  # a token sequence 1 emits mid-way
    results, stats = run_and_compare(target, draft, prompts, 24, 4, stop_token_ids=(stop,))
    assert results[1].finish_reason == "stop" and results[1].token_ids[-1] == stop
    assert len(results[1].token_ids) <= 7
    assert stats.new_tokens < sum(len(r.token_ids) for r in reference)


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 6, 7])
def test_max_new_tokens_is_never_exceeded(models, max_new_tokens):
    target = models["target"]
    for draft in (target, make_head(target, "last_layer")):
        results, _ = run_and_compare(target, draft, make_prompts(4), max_new_tokens, 4)
        assert all(len(r.token_ids) == max_new_tokens and r.finish_reason == "length" for r in results)


def test_finished_sequences_free_their_pages_at_once(models):
    """Sequence 0 (a long prompt) stops on its first token: while sequence 1 keeps decoding, only its own pages are
    in use (shared by target and draft, never more than its prompt + max_new_tokens need)."""
    target = models["target"]
    page_size = 4
    prompts = make_prompts(2)
    prompts[0] = prompts[0] * 8  # 40 tokens: 10 pages
    first_token = generate(target, prompts[:1], 1)[0][0].token_ids[0]
    pages_for_seq1 = -(-(len(prompts[1]) + 16) // page_size)
    allocator = PageAllocator(64, page_size=page_size)
    used_while_seq1_runs = []

    def on_tokens(seq_index: int, _ids: list[int]) -> None:
        if seq_index == 1:
            used_while_seq1_runs.append(allocator.num_used)

    for draft in (target, make_head(target, "random")):
        used_while_seq1_runs.clear()
        results, _ = speculative_generate(
            target, draft, prompts, 16, 3, stop_token_ids=(first_token,), page_size=page_size, allocator=allocator,
            on_tokens=on_tokens,
        )
        assert results[0].token_ids == [first_token] and results[0].finish_reason == "stop"
        assert len(results[1].token_ids) == 16 and len(used_while_seq1_runs) > 2
        assert max(used_while_seq1_runs) <= pages_for_seq1  # seq 0's 10 pages were freed when it stopped
        assert allocator.num_free == allocator.num_pages


def test_the_default_allocator_is_enough(models):
    """Without an explicit allocator the engine sizes one for prompts + max_new_tokens: no out-of-pages error."""
    target = models["target"]
    for draft in (target, models["noisy_copy"], make_head(target, "last_layer")):
        results, _ = speculative_generate(target, draft, make_prompts(4), 30, 8, page_size=4)
        assert all(len(r.token_ids) == 30 for r in results)


# ---- lossless sampling end to end ----------------------------------------------------------------------------------


@pytest.mark.slow  # 2,000 sequences per χ² test: 3-4 s each
@pytest.mark.parametrize(
    "schedule, k, sampling, batch_size",
    [
        ("mtp_chain", 2, SamplingParams(temperature=1.0), LOSSLESS_SAMPLES),
        ("mtp_chain", 1, SamplingParams(temperature=1.0, top_k=3), LOSSLESS_SAMPLES),
        ("mtp_chain", 2, SamplingParams(temperature=0.8, top_p=0.8), LOSSLESS_SAMPLES),
        ("target_draft", 1, SamplingParams(temperature=1.0, top_k=5), LOSSLESS_SAMPLES),
        ("prompt_lookup", 2, SamplingParams(temperature=1.0), LOSSLESS_SAMPLES),
        ("mtp_chain", 2, SamplingParams(temperature=1.0), 4),
        ("hybrid", 2, SamplingParams(temperature=1.0), LOSSLESS_SAMPLES),
        ("hybrid", 3, SamplingParams(temperature=0.8, top_p=0.9), LOSSLESS_SAMPLES),
        ("mtp_chain", 2, SamplingParams(temperature=1.0, repetition_penalty=2.0), LOSSLESS_SAMPLES),
        ("target_draft", 2, SamplingParams(temperature=1.0, repetition_penalty=1.5), LOSSLESS_SAMPLES),
    ],
)
def test_speculative_sampling_is_lossless_chi2(small_vocab_target, schedule, k, sampling, batch_size):
    """The joint distribution of the first three generated tokens equals plain sampling's. t1 comes from the prefill;
    with k=2, t2 and t3 are the first step's drafts d_1, d_2 (accepted or corrected), or t3 comes from a second step
    after a rejection; with k=1, t3 is the first step's bonus token when d_1 is accepted. 2,000 sequences in one
    batch (or in batches of 4, each call seeded on its own), χ² against the exact joint (512 cells, sparse ones
    pooled), threshold 1e-3. At this size, sampling the
    correction from p instead of norm(max(0, p - q)), or the bonus from the wrong row, gives p-values < 1e-30."""
    target = small_vocab_target
    if schedule == "mtp_chain":
        draft = make_head(target, "last_layer")
    elif schedule == "prompt_lookup":  # one-hot draft distributions (the greedy path proposes ids without them)
        draft = PromptLookup()
    elif schedule == "hybrid":  # the head's chain or the context's copy, chosen per sequence and step
        draft = HybridDraft(make_head(target, "last_layer"), min_ngram=1)
    else:
        draft = load_model(target.source_dir, dtype="float32", device="cpu")  # a perturbed copy of the target
        with torch.no_grad():
            draft.lm_head.weight.mul_(15)
            for param in draft.parameters():
                param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(1)) * 0.3)
    # With a repetition penalty, a prompt of few distinct ids, so that the drafts on a verify row's path change what
    # that row has seen (a row penalized for its sequence's tokens alone fails here: p 1e-44 and 7e-25).
    # (the hybrid: a prompt of repeats, so that the first step copies from the context after some first tokens)
    prompt = PENALTY_PROMPT if sampling.penalizes or schedule == "hybrid" else LOSSLESS_PROMPT
    if batch_size == LOSSLESS_SAMPLES:
        results, stats = speculative_generate(
            target, draft, [prompt] * LOSSLESS_SAMPLES, 4, k, sampling, seed=11, page_size=4
        )
    else:  # serving-size batches, each call with its own seed
        results, stats = [], SpecStats(schedule, k)
        for call in range(LOSSLESS_SAMPLES // batch_size):
            batch_results, batch_stats = speculative_generate(
                target, draft, [prompt] * batch_size, 4, k, sampling, seed=1000 + call, page_size=4
            )
            results += batch_results
            stats.add(batch_stats)
    assert 0.05 < stats.alpha < 0.95  # drafts are both accepted and rejected
    if schedule == "hybrid":  # both drafters drafted
        assert min(stats.steps_by_source.get(source, 0) for source in ("head", "context")) > LOSSLESS_SAMPLES // 20
    tokens = torch.tensor([r.token_ids[:3] for r in results])  # [N, 3]
    cells = (tokens[:, 0] * SMALL_VOCAB + tokens[:, 1]) * SMALL_VOCAB + tokens[:, 2]
    counts = torch.bincount(cells, minlength=SMALL_VOCAB**3)
    expected = exact_first_three_tokens(target, prompt, sampling).flatten()
    assert chi2_p_value(counts, expected) > P_VALUE_THRESHOLD


# ---- validation ----------------------------------------------------------------------------------------------------


def test_bad_inputs_are_user_errors(models, tmp_path):
    target = models["target"]
    prompts = make_prompts(1)
    for k in (0, 9):
        with pytest.raises(UserError, match=r"num_speculative_tokens must be an integer in 1\.\.8"):
            speculative_generate(target, target, prompts, 4, k)
    small = load_model(save_tiny_model(tmp_path / "v80", vocab_size=80), dtype="float32", device="cpu")
    with pytest.raises(UserError, match="vocab_size=80 differs from the target's vocab_size=96"):
        speculative_generate(target, small, prompts, 4, 2)
    with pytest.raises(UserError, match="draft must be a CausalLM .* or a draft head"):
        speculative_generate(target, object(), prompts, 4, 2)
    with pytest.raises(UserError, match="exceeds the model's maximum"):
        speculative_generate(target, target, prompts, 300, 2)


# ---- CLI -----------------------------------------------------------------------------------------------------------


def test_cli_generate_with_head_and_draft(tmp_path, capsys):
    from mtp_train.cli import main
    from mtp_train.runtime.loader import load_tokenizer
    from tests.conftest_data import build_tokenizer
    from tests.pipeline_fixtures import make_tiny_target

    target_dir = make_tiny_target(tmp_path / "target")
    target = load_model(target_dir, dtype="float32", device="cpu")
    head_dir = save_head(make_head(target, "last_layer"), tmp_path / "head")
    common = ["generate", "--target", str(target_dir), "--prompt", "hello world", "--max-new-tokens", "12"]
    common += ["--dtype", "float32", "--device", "cpu", "--json"]
    capsys.readouterr()  # what building the models printed (a first `import deepspeed` logs to stdout)

    def run(*extra: str) -> dict:
        assert main([*common, *extra]) == 0
        return json.loads(capsys.readouterr().out)

    plain = run()
    assert "stats" not in plain
    with_head = run("--head", str(head_dir), "--num-speculative-tokens", "2")
    assert with_head["token_ids"] == plain["token_ids"]
    assert with_head["stats"]["schedule"] == MTPChainProposer.schedule
    assert len(with_head["stats"]["acceptance_per_position"]) == 2
    assert {"tau", "alpha", "target_forwards", "tokens_per_s"} <= set(with_head["stats"])
    # Any export format loads through the same loader as `eval --head`: the same head drafts the same tokens.
    from mtp_train.export.exporter import export_head

    exported = export_head(head_dir, "deepseek-mtp", tmp_path / "export", target_dir)
    capsys.readouterr()
    from_export = run("--head", str(exported), "--num-speculative-tokens", "2")
    assert from_export["token_ids"] == plain["token_ids"]
    assert from_export["stats"]["accepted_per_position"] == with_head["stats"]["accepted_per_position"]
    self_draft = run("--draft", str(target_dir), "--num-speculative-tokens", "3")
    assert self_draft["token_ids"] == plain["token_ids"]
    assert self_draft["stats"]["alpha"] == 1.0

    other_dir = tmp_path / "other"
    shutil.copytree(target_dir, other_dir)
    other_tokenizer = build_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|other|>"], vocab_size=500)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (other_dir / name).unlink(missing_ok=True)
    other_tokenizer.save_pretrained(str(other_dir))
    assert load_tokenizer(other_dir).get_vocab() != load_tokenizer(target_dir).get_vocab()
    assert main([*common, "--draft", str(other_dir)]) == 2
    assert "its tokenizer differs from the target's" in capsys.readouterr().err
    assert main([*common, "--head", str(head_dir), "--num-speculative-tokens", "9"]) == 2
    assert "--num-speculative-tokens must be in 1..8" in capsys.readouterr().err


def test_cli_generate_several_prompts_in_batches(tmp_path, capsys):
    """`generate --prompts-file F --batch-size 2` (three prompts: batches of 2 and 1) prints one JSON line per prompt in
    prompt order; plain and speculative replies are token-identical, and each equals the prompt decoded alone."""
    from mtp_train.cli import main
    from tests.pipeline_fixtures import make_tiny_target

    target_dir = make_tiny_target(tmp_path / "target")
    target = load_model(target_dir, dtype="float32", device="cpu")
    head_dir = save_head(make_head(target, "last_layer"), tmp_path / "head")
    prompts = ["hello world", "the model drafts tokens", "data cache"]
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text(prompts[0] + "\n\n" + json.dumps({"prompt": prompts[1]}) + "\n"
                            + json.dumps({"turns": [prompts[2], "later"]}) + "\n")
    common = ["generate", "--target", str(target_dir), "--max-new-tokens", "10", "--dtype", "float32", "--device",
              "cpu", "--json"]
    capsys.readouterr()

    def run(*extra: str) -> list[dict]:
        assert main([*common, *extra]) == 0
        return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]

    plain = run("--prompts-file", str(prompts_file), "--batch-size", "2")
    assert [row["index"] for row in plain] == [0, 1, 2] and [row["prompt"] for row in plain] == prompts
    speculative = run("--prompts-file", str(prompts_file), "--batch-size", "2", "--head", str(head_dir))
    assert [row["token_ids"] for row in speculative] == [row["token_ids"] for row in plain]
    for row in plain:
        alone = run("--prompt", row["prompt"])
        assert alone[0]["token_ids"] == row["token_ids"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"turns": []}) + "\n")
    assert main([*common, "--prompts-file", str(bad)]) == 2
    assert f"{bad}:2: no user message" in capsys.readouterr().err
    assert main([*common, "--prompt", "hi", "--batch-size", "0"]) == 2
    assert "--batch-size must be in 1..256, got 0" in capsys.readouterr().err


# ---- the real model ------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.real_model
def test_real_smollm2_greedy_mtp_chain_matches_generate(smollm2_dir):
    from mtp_train.runtime.chat import encode_chat
    from mtp_train.runtime.loader import load_tokenizer

    target = load_model(smollm2_dir, dtype="float32", device="cpu")
    tokenizer = load_tokenizer(smollm2_dir)
    prompts = [
        encode_chat(tokenizer, [{"role": "user", "content": text}])
        for text in ("What is the capital of France?", "Write a haiku about the sea.")
    ]
    head = make_head(target, "last_layer")
    reference, _ = generate(target, prompts, 32)
    for ids, plain in zip(prompts, reference):  # a verify rounds unlike a decode step, both fp32: clear of 2 × 1e-3
        assert_clear_decode_margins(target, ids, plain.token_ids, 1e-3, "plain fp32 greedy")
    allocator = PageAllocator(64, page_size=16)
    results, stats = speculative_generate(target, head, prompts, 32, 3, allocator=allocator)
    assert [r.token_ids for r in results] == [r.token_ids for r in reference]
    assert allocator.num_free == allocator.num_pages
    # An untrained last-layer head mostly re-predicts the current token, so drafts are rarely accepted here; the
    # accepted-draft paths are covered on tiny models above.
    assert stats.drafted_tokens > 0 and stats.target_forwards <= 32


def test_ngram_lookup_finds_latest_longest_match():
    assert ngram_next_token([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]) == 7  # latest occurrence of (1, 2, 3)
    assert ngram_next_token([4, 2, 3, 8, 5, 2, 3]) == 8  # falls back to the 2-gram (2, 3)
    assert ngram_next_token([1, 2, 3, 4]) is None


def test_ngram_lookup_skips_matches_that_straddle_token_ids():
    """The search runs over the ids packed as 4-byte ints: a byte match across two ids is not a token match."""
    # little-endian: 1 is 01 00 00 00, which 256 (00 01 00 00) then 0 (00 00 00 00) hold from their second byte
    assert ngram_next_token([256, 0, 1]) is None
    assert ngram_next_token([1, 5, 256, 0, 1]) == 5  # the latest match straddles 256 and 0; the real one is id 0
    assert ngram_next_token([65536, 2, 131073, 65536]) == 2  # 65536 (00 00 01 00) straddles 2 and 131073 too


def test_prompt_lookup_proposals_follow_the_ngram_chain_greedy_or_sampled(tmp_path):
    """Greedy proposals are the looked-up ids (no vocabulary rows); sampled ones the same ids with one-hot draft
    distributions, so rejection sampling sees q = 1 on the drafted token."""
    from mtp_train.runtime.spec.proposer import Request
    from mtp_train.runtime.spec.prompt_lookup import PromptLookupState

    target = load_model(save_tiny_model(tmp_path / "t", seed=3), dtype="float32", device="cpu")
    proposer = PromptLookupProposer(target, PromptLookup(), allocator=None)
    for sampling in (SamplingParams(), SamplingParams(temperature=1.0)):
        requests = [Request(0, [5, 6, 7, 8, 5, 6, 7], [], PromptLookupState()),
                    Request(1, [9, 4], [], PromptLookupState())]
        proposer.catch_up(requests)
        first, second = proposer.propose(requests, [3, 2], sampling, torch.Generator().manual_seed(0))
        assert first.draft_token_ids.tolist() == [8, 5, 6]  # (5,6,7) -> 8, then (6,7,8) -> 5, (7,8,5) -> 6
        assert second.draft_token_ids.tolist() == [4, 4]  # no match: the last token again
        if sampling.greedy:
            assert first.draft_probs is None and second.draft_probs is None
        else:
            assert first.draft_probs.shape == (3, target.config.vocab_size)
            assert torch.equal(first.draft_probs.argmax(-1), first.draft_token_ids)
            assert torch.equal(first.draft_probs.sum(-1), torch.ones(3))


@pytest.mark.parametrize("k", [1, 3])
def test_prompt_lookup_greedy_identical_and_accepts_repetitions(tmp_path, k):
    target = load_model(save_tiny_model(tmp_path / "t", seed=3), dtype="float32", device="cpu")
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], [9, 10, 11, 12, 13]]
    plain, _ = generate(target, prompts, 24)
    spec, stats = speculative_generate(target, PromptLookup(), prompts, 24, k)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert stats.schedule == PromptLookupProposer.schedule and stats.draft_forwards == 0
    assert stats.tau >= 1.0


def test_a_new_proposer_is_one_subclass_with_its_own_state(models):
    """The extension point for later proposers (tree drafting): a `Proposer` subclass with its own `DraftState`
    registers itself. This one drafts the last committed token again and again; greedy output is still plain's."""
    from dataclasses import dataclass

    from mtp_train.runtime.spec.proposer import DraftState, Proposer

    class RepeatLast:  # the draft object the new proposer accepts
        pass

    @dataclass
    class RepeatState(DraftState):
        last_committed: int = -1

    class RepeatProposer(Proposer):
        schedule = "repeat_last"
        state_class = RepeatState

        @classmethod
        def accepts(cls, draft) -> bool:
            return isinstance(draft, RepeatLast)

        def __init__(self, target, draft, allocator):
            super().__init__(target, allocator)
            self.vocab_size = target.config.vocab_size

        def _one_hot(self, token_ids: list[int]) -> torch.Tensor:  # [m, vocab]
            return torch.nn.functional.one_hot(torch.tensor(token_ids), self.vocab_size).float()

        def catch_up(self, requests):
            for req in requests:
                req.draft.last_committed = req.token_ids[-1]
                req.draft.next_logits = self._one_hot([req.draft.last_committed])[0]

        def draft_step(self, requests, token_ids, carried):
            return self._one_hot([req.draft.last_committed for req in requests]), None

    _, stats = run_and_compare(models["target"], RepeatLast(), make_prompts(4), 24, 3)
    assert stats.schedule == "repeat_last" and stats.drafted_tokens > 0 and stats.draft_forwards == 0
