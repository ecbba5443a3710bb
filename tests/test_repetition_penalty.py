"""The repetition penalty (`SamplingParams.repetition_penalty`, `generate --repetition-penalty`): transformers'
rule, plain decoding equal to transformers' `generate(repetition_penalty=...)`, greedy speculative decoding (chains,
target–draft, prompt lookup, trees) equal to plain decoding with the same penalty, and bad values refused. Lossless
sampling with a penalty is tested end to end by tests/test_speculative.py's χ² cases."""

from __future__ import annotations

import pytest
import torch

from mtp_train.runtime.generate import generate
from mtp_train.runtime.loader import load_model
from mtp_train.runtime.sampler import SamplingParams, penalize_repeats, seen_tokens, verify_rows_seen
from mtp_train.runtime.spec import DraftTree, PromptLookup, TreeShape
from tests.spec_helpers import make_prompts, run_and_compare
from tests.test_speculative import make_head
from tests.tiny_models import save_tiny_model

PENALTY = 1.8  # strong enough to change the tiny target's greedy output (checked below)


def test_penalty_is_transformers_rule():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=gen) * 4
    history = [[1, 2, 2, 7], [49, 0], [5, 6, 7, 8, 9, 10]]
    for penalty in (0.7, 1.3, 2.0):
        ours = penalize_repeats(logits, seen_tokens(history, 50, "cpu"), penalty)
        for row, ids in enumerate(history):
            theirs = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([ids]), logits[row : row + 1].clone())
            assert torch.equal(ours[row], theirs[0])
    assert penalize_repeats(logits, seen_tokens(history, 50, "cpu"), 1.0) is logits


def test_verify_rows_see_their_sequence_and_the_drafts_on_their_path():
    seen = seen_tokens([[1], [2]], 10, "cpu")
    input_ids = torch.tensor([1, 4, 5, 2, 6, 7, 8])  # a chain (root 1, drafts 4, 5), a tree (root 2; 6 and 7 under it,
    chain = torch.ones(3, 3, dtype=torch.bool).tril()  # 8 under 6)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    rows = verify_rows_seen(seen, input_ids, [chain, tree])
    expected = [{1}, {1, 4}, {1, 4, 5}, {2}, {2, 6}, {2, 7}, {2, 6, 8}]
    assert [set(row.nonzero().flatten().tolist()) for row in rows] == expected


def test_plain_decoding_matches_transformers_with_a_penalty(tmp_path):
    from transformers import AutoModelForCausalLM

    path = save_tiny_model(tmp_path / "target", seed=0)
    ours = load_model(path, dtype="float32", device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = make_prompts(4)
    plain, _ = generate(ours, prompts, 20)
    results, _ = generate(ours, prompts, 20, SamplingParams(repetition_penalty=PENALTY))
    assert [r.token_ids for r in results] != [r.token_ids for r in plain]  # the penalty changes the output
    for ids, result in zip(prompts, results):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False, repetition_penalty=PENALTY,
                              eos_token_id=None, pad_token_id=0)
        assert result.token_ids == ref[0, len(ids):].tolist()


@pytest.mark.parametrize("draft_kind", ["head", "last_layer_head", "target_draft", "self", "lookup", "tree",
                                        "hybrid_tree"])
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_speculative_with_a_penalty_is_plain_with_it(models, draft_kind, k):
    target = models["target"]
    draft = {
        "head": lambda: make_head(target, "random"),
        "last_layer_head": lambda: make_head(target, "last_layer"),
        "target_draft": lambda: models["noisy_copy"],
        "self": lambda: target,
        "lookup": PromptLookup,
        "tree": lambda: DraftTree(make_head(target, "last_layer"), TreeShape.parse("3x2x6")),
        "hybrid_tree": lambda: DraftTree(make_head(target, "random"), TreeShape.parse("4x3x12"), PromptLookup()),
    }[draft_kind]()
    sampling = SamplingParams(repetition_penalty=PENALTY)
    for batch_size in (1, 4):
        _, stats = run_and_compare(target, draft, make_prompts(batch_size, seed=k), 24, k, sampling=sampling)
        if draft_kind == "self":  # the target drafts unpenalized, the verify penalizes: some drafts are rejected
            assert 0 < stats.alpha < 1


def test_bad_penalties_are_refused():
    for value in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="repetition_penalty"):
            SamplingParams(repetition_penalty=value)


def test_cli_generate_takes_the_penalty_plain_and_speculative(tmp_path, capsys):
    """`generate --repetition-penalty`: the reply changes, `--draft` gives the same tokens, and 0 is refused by
    name before any model loads."""
    import json

    from mtp_train.cli import main
    from tests.pipeline_fixtures import make_tiny_target

    target_dir = make_tiny_target(tmp_path / "target")
    common = ["generate", "--target", str(target_dir), "--prompt", "hello world", "--max-new-tokens", "16",
              "--dtype", "float32", "--device", "cpu", "--json"]
    capsys.readouterr()

    def run(*extra: str) -> list[int]:
        assert main([*common, *extra]) == 0
        return json.loads(capsys.readouterr().out)["token_ids"]

    plain, penalized = run(), run("--repetition-penalty", "3")
    assert penalized != plain
    assert run("--repetition-penalty", "3", "--draft", str(target_dir), "--num-speculative-tokens", "2") == penalized
    assert main([*common, "--repetition-penalty", "0"]) == 2
    assert "--repetition-penalty must be > 0" in capsys.readouterr().err
