"""Tree drafting (`runtime/spec/tree.py`): greedy output token-identical to plain `generate()` at batch 1 and 4 for
several tree shapes (random and last-layer heads, hybrid trees, through the CPU decode kernels too), every page back
after a run, the tree attention mask, the compaction of the accepted path, the tree acceptance rules, lossless tree
sampling end to end (χ², temperature / top-k / top-p, hybrid), and the shape's validation.

χ² tests are seeded (deterministic) and fail when the p-value is below `P_VALUE_THRESHOLD` = 1e-3 (tests/
sampling_stats.py). The models are fixtures of tests/conftest.py; prompts and the greedy comparison are in
tests/spec_helpers.py."""

from __future__ import annotations

import pytest
import torch

from mtp_train.errors import UserError
from mtp_train.heads import DraftHead, HeadConfig
from mtp_train.runtime.attention import BatchInfo, ancestor_mask
from mtp_train.runtime.generate import generate
from mtp_train.runtime.kv_cache import PageAllocator, Sequence
from mtp_train.runtime.rejection import greedy_accept_trees, rejection_sample_trees
from mtp_train.runtime.sampler import SamplingParams
from mtp_train.runtime.spec import DraftTree, PromptLookup, SpecStats, TreeShape, speculative_generate
from mtp_train.runtime.spec.proposer import compact_accepted_path
from mtp_train.runtime.spec.tree import TreeProposer
from tests.sampling_stats import P_VALUE_THRESHOLD, chi2_p_value
from tests.spec_helpers import (
    LOSSLESS_PROMPT,
    LOSSLESS_SAMPLES,
    SMALL_VOCAB,
    exact_first_three_tokens,
    make_prompts,
    node_path,
    run_and_compare,
)

pytestmark = pytest.mark.cpu_paths  # its expectations depend on the CPU: rerun as other kinds (tests/test_cpu_kinds.py)

SHAPES = ["1x1x1", "3x1x3", "3x2x6", "4x3x12", "2x4x20"]


def make_head(target, init: str) -> DraftHead:
    torch.manual_seed(0)
    return DraftHead.from_target(target, HeadConfig.for_target(target.config, kind="mtp", init=init))


# ---- greedy: token-identical to plain generate -----------------------------------------------------------------------


@pytest.mark.parametrize("init", ["random", "last_layer"])
@pytest.mark.parametrize("shape", SHAPES)
def test_greedy_tree_matches_generate(models, init, shape):
    target = models["target"]
    tree = DraftTree(make_head(target, init), TreeShape.parse(shape))
    for batch_size in (1, 4):
        _, stats = run_and_compare(target, tree, make_prompts(batch_size), 24, 3)
        assert stats.schedule == "tree" and stats.num_speculative_tokens == tree.shape.depth
        assert stats.drafted_tokens <= tree.shape.nodes * stats.verify_sequence_steps
        assert stats.draft_forwards <= stats.verify_sequence_steps + 1 + stats.verify_sequence_steps * (
            tree.shape.depth - 1)


@pytest.mark.parametrize("shape", ["3x2x6", "4x3x12"])
def test_greedy_hybrid_tree_matches_generate_and_beats_the_head_alone(models, shape):
    """The prompt-lookup branch beside the head's: identical output, and on these repetitive-enough prompts more
    tokens per step than the head's tree alone (the random head is rarely right, the n-gram branch often)."""
    target = models["target"]
    head = make_head(target, "random")
    _, alone = run_and_compare(target, DraftTree(head, TreeShape.parse(shape)), make_prompts(4), 24, 3)
    _, hybrid = run_and_compare(target, DraftTree(head, TreeShape.parse(shape), PromptLookup()), make_prompts(4), 24, 3)
    assert hybrid.schedule == "tree_hybrid"
    assert hybrid.tau > alone.tau


def test_a_one_wide_tree_is_the_chain(models):
    """topk 1 and N = depth drafts exactly the chain: the same accepted tokens, forwards and τ as k = depth."""
    target = models["target"]
    head = make_head(target, "last_layer")
    for depth in (1, 3):
        _, chain = run_and_compare(target, head, make_prompts(4), 24, depth)
        _, tree = run_and_compare(target, DraftTree(head, TreeShape(depth, 1, depth)), make_prompts(4), 24, depth)
        assert chain.accepted_tokens > 0
        assert (tree.accepted_tokens, tree.target_forwards, tree.tau) == (chain.accepted_tokens,
                                                                        chain.target_forwards, chain.tau)
        assert tree.accepted_per_position == chain.accepted_per_position


def test_a_wider_tree_accepts_at_least_as_much_as_the_chain(models):
    """Greedy with a dynamic tree that contains the chain's drafts (its top-1 path) accepts at least as many tokens
    per step on the same prompts; measured with the last-layer head (sometimes right)."""
    target = models["target"]
    head = make_head(target, "last_layer")
    _, chain = run_and_compare(target, head, make_prompts(4), 24, 3)
    _, tree = run_and_compare(target, DraftTree(head, TreeShape(3, 3, 15)), make_prompts(4), 24, 3)
    assert tree.tau >= chain.tau and tree.committed_per_verify > chain.committed_per_verify


def test_stop_tokens_and_max_new_tokens_with_trees(models):
    target = models["target"]
    tree = DraftTree(make_head(target, "last_layer"), TreeShape(4, 2, 8), PromptLookup())
    prompts = make_prompts(4)
    reference, _ = generate(target, prompts, 24, page_size=4)
    stop = reference[1].token_ids[6]
    results, _ = run_and_compare(target, tree, prompts, 24, 3, stop_token_ids=(stop,))
    assert results[1].finish_reason == "stop" and results[1].token_ids[-1] == stop
    for max_new_tokens in (1, 2, 5):
        results, _ = run_and_compare(target, tree, prompts, max_new_tokens, 3)
        assert all(len(r.token_ids) == max_new_tokens for r in results)


def test_default_allocator_holds_the_tree(models):
    """Without an allocator the engine sizes one with room for the N + 1 tree slots past each sequence's end."""
    target = models["target"]
    results, _ = speculative_generate(target, DraftTree(make_head(target, "random"), TreeShape(8, 8, 64)),
                                      make_prompts(4), 30, page_size=4)
    assert all(len(r.token_ids) == 30 for r in results)


def test_eagle3_head_drafts_trees(tmp_path):
    """An EAGLE-3 head (aux layer states in its catch-up, its own pre-norm outputs down the tree, a reduced draft
    vocabulary) drafts trees with the same greedy identity."""
    from mtp_train.heads.eagle3 import Eagle3Head
    from mtp_train.runtime.loader import load_model
    from tests.tiny_models import save_tiny_model

    target = load_model(save_tiny_model(tmp_path / "t4", seed=0, num_hidden_layers=4), dtype="float32", device="cpu")
    config = HeadConfig.for_target(target.config, kind="eagle3", init="random", aux_layers=[0, 1, 3],
                                   draft_vocab_size=48)
    torch.manual_seed(0)
    head = Eagle3Head.from_target(target, config)
    head.set_draft_vocab(torch.arange(0, 96, 2))
    with torch.no_grad():
        for param in head.parameters():
            param.mul_(8.0)  # sharper drafts than the tiny init's near-uniform ones
    for batch_size in (1, 4):
        run_and_compare(target, DraftTree(head, TreeShape(3, 2, 6)), make_prompts(batch_size), 16, 3)


# ---- the CPU decode kernels: the tree's attention runs in torch with the mask, the linears stay the kernels' ---------


@pytest.mark.parametrize("decode_dtype", [torch.float32, torch.bfloat16])
def test_greedy_tree_through_the_decode_kernels(tmp_path, decode_dtype):
    from mtp_train.runtime import kernels
    from mtp_train.runtime.cpu_decode import KERNEL_MAX_ROWS
    from mtp_train.runtime.decode_runner import HeadRunner, apply_decode_path
    from mtp_train.runtime.loader import load_model
    from tests.tiny_models import save_tiny_model

    if kernels.cpu_kernels() is None:
        pytest.skip(f"CPU decode kernels unavailable: {kernels.unavailable_reason()}")
    target = load_model(save_tiny_model(tmp_path / "t", "llama", seed=7), dtype="float32", device="cpu")
    apply_decode_path(target, decode_dtype, KERNEL_MAX_ROWS)
    head = HeadRunner(make_head(target, "last_layer"), decode_dtype, KERNEL_MAX_ROWS)
    for shape in ("3x2x6", "4x4x28"):  # 28 nodes: the verify rows exceed the kernels' 16 per sequence
        for batch_size in (1, 4):
            run_and_compare(target, DraftTree(head, TreeShape.parse(shape), PromptLookup()),
                            make_prompts(batch_size), 16, 3)


@pytest.mark.slow
@pytest.mark.real_model
def test_real_smollm2_greedy_trees_match_generate(smollm2_dir):
    """SmolLM2 in fp32 on its decode path (the kernels' linears, the tree's attention in torch): greedy trees, plain
    with the prompt-lookup branch, at batch 2 give plain greedy's tokens, and every page comes back."""
    from mtp_train.runtime.chat import encode_chat
    from mtp_train.runtime.loader import load_model, load_tokenizer
    from mtp_train.runtime.decode_runner import head_runner
    from mtp_train.runtime.precision import resolve_precision
    from tests.margin_checks import assert_clear_decode_margins

    precision = resolve_precision("float32", "auto", "cpu")
    target = load_model(smollm2_dir, device="cpu", precision=precision)
    tokenizer = load_tokenizer(smollm2_dir)
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": text}])
               for text in ("What is the capital of France?", "Write a haiku about the sea.")]
    head = head_runner(make_head(target, "last_layer"), precision, "target")
    reference, _ = generate(target, prompts, 16)
    for ids, plain in zip(prompts, reference):  # a tree's verify rounds unlike a decode step: clear of 2 × 1e-3
        assert_clear_decode_margins(target, ids, plain.token_ids, 1e-3, "plain fp32 greedy")
    for tree in (DraftTree(head, TreeShape(5, 3, 16), PromptLookup()),):
        allocator = PageAllocator(64, page_size=16)
        results, _ = speculative_generate(target, tree, prompts, 16, allocator=allocator)
        assert [r.token_ids for r in results] == [r.token_ids for r in reference]
        assert allocator.num_free == allocator.num_pages


# ---- the tree mask, the compaction, the acceptance rules -------------------------------------------------------------


def test_ancestor_mask():
    mask = ancestor_mask([-1, 0, 0, 1, 3, 2])
    assert mask[4].tolist() == [True, True, False, True, True, False]
    assert mask[5].tolist() == [True, False, True, False, False, True]
    assert mask.diagonal().all()
    with pytest.raises(ValueError, match="parents must come before"):
        ancestor_mask([-1, 2, 0])


def test_tree_verify_rows_equal_the_chain_rows_of_each_path(models):
    """One forward over a tree gives, at each node, the logits of the sequence prefix + that node's path (computed
    causally, one path at a time); after compacting an accepted path the cache holds what a causal forward of that
    path writes."""
    target = models["target"]
    prompt = make_prompts(1)[0]
    tokens = [7, 11, 13, 17, 19, 23]  # root 7, then nodes 1..5
    parents = [-1, 0, 0, 1, 1, 4]
    allocator = PageAllocator(32, page_size=4)
    cache, seq = target.new_kv_cache(allocator), Sequence(0)
    target(torch.tensor(prompt), BatchInfo.for_sequences([seq], [len(prompt)], allocator), cache)
    start = seq.num_cached
    depths = [0, 1, 1, 2, 2, 3]
    batch = BatchInfo.for_tree([seq], [[start + d for d in depths]], [ancestor_mask(parents)], allocator)
    tree_logits = target(torch.tensor(tokens), batch, cache).logits
    for node in range(len(tokens)):
        path = node_path(tokens, parents, node)
        causal = target(torch.tensor(prompt + path), BatchInfo.without_cache([len(prompt) + len(path)])).logits[-1]
        torch.testing.assert_close(tree_logits[node], causal, rtol=1e-5, atol=1e-5)
    # Accept nodes 1 -> 4 -> 5 (tokens 11, 19, 23): compacted to the 3 positions after the root.
    compact_accepted_path(cache, seq, start, [1, 4, 5])
    seq.num_cached = start + 4
    fresh_allocator = PageAllocator(32, page_size=4)
    fresh, fresh_seq = target.new_kv_cache(fresh_allocator), Sequence(0)
    accepted = prompt + [7, 11, 19, 23]
    target(torch.tensor(accepted), BatchInfo.for_sequences([fresh_seq], [len(accepted)], fresh_allocator), fresh)
    page_size = 4

    def rows(kv, view, count):
        slots = [view.pages[p // page_size] * page_size + p % page_size for p in range(count)]
        return torch.stack([kv.view(-1, *kv.shape[2:])[s] for s in slots])

    for (k_tree, v_tree), (k_ref, v_ref) in zip(cache.layers, fresh.layers):
        torch.testing.assert_close(rows(k_tree, seq, len(accepted)), rows(k_ref, fresh_seq, len(accepted)),
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(rows(v_tree, seq, len(accepted)), rows(v_ref, fresh_seq, len(accepted)),
                                   rtol=1e-5, atol=1e-5)


def test_greedy_accept_trees_walks_each_trees_argmax_path_in_one_batch():
    """Three copies of one tree in one batch, each against other target choices: a path to a leaf (its argmax is the
    bonus), a path stopped inside, none accepted; and an empty tree (a plain step)."""
    tokens = [0, 5, 6, 7, 8, 9]  # root, then 1: 5, 2: 6 (root's children), 3: 7, 4: 8 (children of 2), 5: 9 (of 4)
    parents = [0, 0, 2, 2, 4]
    argmaxes = [[6, 1, 8, 1, 9, 4], [6, 1, 3, 1, 9, 4], [1, 0, 0, 0, 0, 0], [7]]
    input_ids = torch.tensor(tokens * 3 + [3])
    results = greedy_accept_trees(input_ids, torch.tensor(sum(argmaxes, [])), [parents] * 3 + [[]])
    assert [(r.path, r.token_ids) for r in results] == [([2, 4, 5], [6, 8, 9, 4]), ([2], [6, 3]), ([], [1]),
                                                        ([], [7])]


def test_greedy_accept_trees_takes_the_first_matching_child():
    """Two children with the argmax token (a hybrid tree's lookup branch beside the head's): the first in node order
    is followed."""
    results = greedy_accept_trees(torch.tensor([0, 4, 4, 5]), torch.tensor([4, 6, 5, 1]), [[0, 0, 2]])
    assert (results[0].path, results[0].token_ids) == ([1], [4, 6])


def test_sibling_rejection_sampling_is_lossless_with_draws_without_replacement():
    """One level: 3 candidates drawn without replacement from q, tested in order against p; the emitted first token
    is distributed as p (χ²), including tokens q never proposes and p-mass on rejected candidates. The 10,000 trees
    are verified in one batch, as the speculative step does."""
    vocab, num_trees = 6, 10_000
    p = torch.tensor([0.05, 0.3, 0.1, 0.25, 0.0, 0.3])
    q = torch.tensor([0.4, 0.1, 0.3, 0.05, 0.15, 0.0])
    gen = torch.Generator().manual_seed(3)
    input_ids, draft_probs = [], []
    for _ in range(num_trees):
        drawn, rows, remaining = [], [], q.clone()
        for _ in range(3):
            row = remaining / remaining.sum()
            token = int(torch.multinomial(row, 1, generator=gen))
            drawn.append(token)
            rows.append(row)
            remaining[token] = 0
        input_ids += [99 % vocab, *drawn]
        draft_probs.append(torch.stack(rows))
    results = rejection_sample_trees(torch.tensor(input_ids), draft_probs, p.expand(4 * num_trees, vocab),
                                     [[0, 0, 0]] * num_trees, gen)
    counts = torch.bincount(torch.tensor([r.token_ids[0] for r in results]), minlength=vocab).float()
    assert chi2_p_value(counts, p) > P_VALUE_THRESHOLD


def test_rejection_sample_trees_follows_certain_acceptances_down_the_tree():
    """Drafts the target is sure of are accepted down to the leaf, whose row gives the bonus; a child q proposes but
    p rules out is never accepted, its sibling then is; shapes are checked."""
    vocab = 4
    one_hot = torch.eye(vocab)
    # root -> 1 (token 1, p = 0) and 2 (token 2, certain); 2 -> 3 (token 3, certain); leaf 3's row: token 0
    input_ids = torch.tensor([0, 1, 2, 3])
    target_probs = torch.stack([torch.tensor([0.0, 0.0, 1.0, 0.0]), one_hot[0], one_hot[3], one_hot[0]])
    draft_probs = [torch.stack([one_hot[1], torch.tensor([0.0, 0.0, 1.0, 0.0]), one_hot[3]])]
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        (result,) = rejection_sample_trees(input_ids, draft_probs, target_probs, [[0, 0, 2]], gen)
        assert (result.path, result.token_ids) == ([2, 3], [2, 3, 0])
    with pytest.raises(ValueError, match=r"tree 0: expected draft_probs of shape \[3, 4\]"):
        rejection_sample_trees(input_ids, [draft_probs[0][:2]], target_probs, [[0, 0, 2]], gen)


# ---- lossless tree sampling end to end -------------------------------------------------------------------------------


@pytest.mark.slow  # 2,000 sequences per χ² test
@pytest.mark.parametrize(
    "shape, sampling, hybrid",
    [
        ("2x2x4", SamplingParams(temperature=1.0), False),
        ("3x2x5", SamplingParams(temperature=1.0, top_k=3), False),
        ("2x3x7", SamplingParams(temperature=0.8, top_p=0.8), False),
        ("2x2x4", SamplingParams(temperature=1.0), True),
    ],
)
def test_tree_sampling_is_lossless_chi2(small_vocab_target, shape, sampling, hybrid):
    """The joint distribution of the first three generated tokens equals plain sampling's: t1 from the prefill, t2
    and t3 from one tree step (a path of two accepted nodes, or one + the bonus, or a corrected token and a second
    step). 2,000 sequences in one batch; χ² against the exact joint (512 cells, sparse ones pooled), threshold 1e-3.
    The hybrid tree's prompt repeats itself, so the n-gram branch (tested first, one-hot) is drafted too."""
    target = small_vocab_target
    head = make_head(target, "last_layer")
    prompt = LOSSLESS_PROMPT + [5, 3] if hybrid else LOSSLESS_PROMPT
    tree = DraftTree(head, TreeShape.parse(shape), PromptLookup() if hybrid else None)
    results, stats = speculative_generate(target, tree, [prompt] * LOSSLESS_SAMPLES, 4, sampling=sampling, seed=11,
                                          page_size=4)
    assert stats.accepted_tokens > 0.05 * stats.verify_sequence_steps  # drafts are accepted, and
    assert stats.committed_per_verify < tree.shape.depth + 1  # rejected
    tokens = torch.tensor([r.token_ids[:3] for r in results])  # [N, 3]
    cells = (tokens[:, 0] * SMALL_VOCAB + tokens[:, 1]) * SMALL_VOCAB + tokens[:, 2]
    counts = torch.bincount(cells, minlength=SMALL_VOCAB**3)
    expected = exact_first_three_tokens(target, prompt, sampling).flatten()
    assert chi2_p_value(counts, expected) > P_VALUE_THRESHOLD


def test_tree_sampling_in_small_batches_frees_every_page(small_vocab_target):
    target = small_vocab_target
    tree = DraftTree(make_head(target, "last_layer"), TreeShape(3, 2, 6), PromptLookup())
    allocator = PageAllocator(64, page_size=4)
    total = SpecStats("tree_hybrid", 3)
    for call in range(5):
        results, stats = speculative_generate(target, tree, [LOSSLESS_PROMPT] * 4, 12,
                                              sampling=SamplingParams(temperature=1.0), seed=call, page_size=4,
                                              allocator=allocator)
        assert all(len(r.token_ids) == 12 for r in results)
        assert allocator.num_free == allocator.num_pages
        total.add(stats)
    assert total.accepted_tokens > 0


# ---- validation ------------------------------------------------------------------------------------------------------


def test_tree_shapes_are_validated():
    assert TreeShape.parse("4x2x8") == TreeShape(4, 2, 8) and TreeShape(4, 2, 8).label == "4x2x8"
    assert TreeShape(3, 2, 10).max_nodes == 10
    for text, message in (("4x2", "expected DEPTHxTOPKxNODES"), ("0x2x2", "depth must be an integer in 1..8"),
                          ("3x9x9", "topk must be an integer in 1..8"), ("3x2x11", "at most 10 nodes"),
                          ("8x8x65", "nodes must be an integer in 1..64")):
        with pytest.raises(UserError, match=message):
            TreeShape.parse(text)


def test_the_tree_proposer_takes_a_draft_tree(models):
    from mtp_train.runtime.spec.proposer import make_proposer

    target = models["target"]
    proposer = make_proposer(target, DraftTree(make_head(target, "random"), TreeShape(2, 2, 4)), PageAllocator(8, 4))
    assert isinstance(proposer, TreeProposer) and proposer.schedule == "tree"


# ---- eval --tree -----------------------------------------------------------------------------------------------------


@pytest.mark.slow  # a tiny pipeline on disk and an eval of 6 methods: ~15 s
def test_eval_reports_trees_beside_the_chain(tmp_path):
    """`eval --tree 3x2x6 2x3x7+lookup`: tree methods beside the chain on the same prompts, greedy-identical to plain
    decoding, with τ against the best chain τ, the tree verify's cost (mask cost beside a causal verify of the same
    size), the predicted speedup, and the settings engines take for the best tree."""
    import json

    from mtp_train.commands.eval import run_evaluation
    from mtp_train.heads import save_head
    from mtp_train.runtime.loader import load_model
    from tests.pipeline_fixtures import tiny_pipeline

    recipe, _ = tiny_pipeline(tmp_path, num_conversations=40)
    target = load_model(recipe.target.path, dtype="float32", device="cpu")
    save_head(make_head(target, "last_layer"), tmp_path / "head")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "category": "c", "turns": [text]}) + "\n"
                               for i, text in enumerate(["hello world", "the model drafts tokens data cache"])))
    out = tmp_path / "report"
    report = run_evaluation(recipe, tmp_path / "head", None, prompts, None, [1, 3], 12, out, show_progress=False,
                            trees=("3x2x6", "2x3x7+lookup"))
    overall = report["overall"]
    assert {"mtp@tree=3x2x6", "mtp@tree=2x3x7+lookup", "mtp@k=1", "mtp@k=3"} <= set(overall)
    for method in ("mtp@tree=3x2x6", "mtp@tree=2x3x7+lookup"):
        assert overall[method]["greedy_match"] is True and overall[method]["tau"] >= 1.0
        tree = report["trees"][method]
        assert tree["tau_over_best_chain"] == pytest.approx(
            overall[method]["tau"] / max(overall["mtp@k=1"]["tau"], overall["mtp@k=3"]["tau"]), rel=1e-3)
        assert tree["verify_over_decode"] > 0 and tree["causal_verify_over_decode"] > 0 and tree["mask_cost"] > 0
        curve = report["cost_curve"]["mtp"]
        expected = overall[method]["tau"] / (tree["verify_over_decode"]
                                             + tree["depth"] * curve["draft_step_over_decode"])
        assert tree["predicted_speedup"] == pytest.approx(expected, rel=1e-3, abs=1e-4)  # the report's 4 decimals
    assert report["trees"]["mtp@tree=2x3x7+lookup"]["hybrid"] is True
    best = report["best_tree"]
    assert best["method"] in report["trees"] and "--speculative-eagle-topk" in best["sglang_args"]
    if best["method"] == "mtp@tree=3x2x6":
        assert best["vllm_speculative_token_tree"] == "[(0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1)]"
    markdown = (out / "report.md").read_text()
    assert "## Trees" in markdown and "| mtp@tree=3x2x6 |" in markdown



def test_eval_refuses_a_bad_tree_shape_before_loading(tmp_path, capsys):
    from mtp_train.cli import main

    assert main(["eval", "--recipe", str(tmp_path / "missing.yaml"), "--tree", "3x2"]) == 2
    assert "tree shape '3x2': expected DEPTHxTOPKxNODES" in capsys.readouterr().err


def test_greedy_trees_over_a_deepseek_target_move_the_latent_cache(tmp_path):
    """A DeepSeek-V3 target (MLA: one latent tensor per layer, runtime/deepseek.py) with its MTP head: the tree
    verify follows the ancestor mask and the accepted path's latents are moved into place like K/V pages."""
    from mtp_train.runtime.loader import load_model
    from tests.deepseek_models import save_tiny_deepseek
    from tests.spec_helpers import VOCAB

    save_tiny_deepseek(tmp_path / "v3", "deepseek_v3", n_group=4, topk_group=2, vocab_size=VOCAB)
    target = load_model(tmp_path / "v3", dtype="float32", device="cpu")
    torch.manual_seed(0)
    head = DraftHead.from_target(target, HeadConfig.for_target(target.config, kind="mtp", init="random"))
    accepted = []
    for tree in (DraftTree(head, TreeShape.parse("3x2x6")), DraftTree(head, TreeShape.parse("2x3x6"), PromptLookup())):
        _, stats = run_and_compare(target, tree, make_prompts(2), 24, 3)
        assert stats.schedule.startswith("tree")
        accepted.append(stats.accepted_tokens)
    assert accepted[1] > 0  # the lookup branch is accepted on the target's repetitive greedy text: entries moved
