"""Tensor parallelism (runtime/tensor_parallel.py): the head/MLP split and the layout rules in one process, and one
2-rank gloo run (tests/tp_worker.py) in which a TP=2 target matches the TP=1 target within 1e-4 in fp32 (prefill,
paged decode, verify, a decode batch; the torch path and the CPU decode kernels) on a tiny Llama, a Qwen2 with
biases, a GQA model with fewer KV heads than ranks and one whose KV groups split unevenly (SmolLM2's 9 heads / 3 KV
heads on 2 ranks), and greedy speculative decoding over the TP=2 target equals plain greedy decoding."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mtp_train.errors import UserError
from mtp_train.runtime.tensor_parallel import ParallelLayout, balanced_range, shard_heads
from tests.pipeline_fixtures import free_port
from tests.tiny_models import save_tiny_model

REPO = Path(__file__).resolve().parent.parent
TOLERANCE = 1e-4

MODELS = {  # name -> (model_type, overrides)
    "llama": ("llama", {}),  # 4 heads, 2 KV heads: one KV group per rank
    "qwen2_bias": ("qwen2", {}),  # q/k/v biases
    "gqa_one_kv": ("llama", {"num_key_value_heads": 1}),  # 1 KV head on 2 ranks: replicated, 2 query heads each
    "uneven_groups": ("llama", {"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 96,
                                "intermediate_size": 100}),  # 2 + 1 KV groups, MLP columns 50 + 50
}


def test_heads_go_to_ranks_in_whole_groups():
    # SmolLM2-135M: 9 heads, 3 KV heads, 2 ranks -> 2 groups (6 heads) and 1 group (3 heads).
    assert [shard_heads(9, 3, 2, r) for r in range(2)] == [
        shard_heads(9, 3, 2, 0).__class__(0, 6, 0, 2), shard_heads(9, 3, 2, 1).__class__(6, 9, 2, 3)]
    # Llama-3.3-70B on 8 ranks: 64 heads, 8 KV heads -> 8 heads and 1 KV head each.
    assert [(s.q_start, s.q_stop, s.kv_start) for s in (shard_heads(64, 8, 8, r) for r in range(8))] == [
        (8 * r, 8 * r + 8, r) for r in range(8)]
    # Fewer KV heads than ranks: each KV head replicated on 4 / 2 = 2 ranks, its 4 query heads split 2 + 2.
    assert [(s.q_start, s.q_stop, s.kv_start, s.kv_stop) for s in (shard_heads(8, 2, 4, r) for r in range(4))] == [
        (0, 2, 0, 1), (2, 4, 0, 1), (4, 6, 1, 2), (6, 8, 1, 2)]
    with pytest.raises(UserError, match="cannot split 9 attention heads with 3 KV heads"):
        shard_heads(9, 3, 4, 0)
    assert [balanced_range(10, 3, i) for i in range(3)] == [(0, 4), (4, 7), (7, 10)]


def test_layout_groups_consecutive_ranks_and_refuses_a_world_it_does_not_divide():
    layout = ParallelLayout(rank=5, world_size=8, tensor_parallel=2)
    assert (layout.tp_rank, layout.dp_rank, layout.dp_size, layout.is_leader) == (1, 2, 4, False)
    assert layout.tp_ranks == [4, 5]
    with pytest.raises(UserError, match=r"target.tensor_parallel.*does not divide the world size 3"):
        ParallelLayout(rank=0, world_size=3, tensor_parallel=2)


def test_recipe_tensor_parallel_is_validated():
    from mtp_train.recipe import load_recipe

    assert load_recipe(REPO / "recipes" / "smollm2-135m-mtp.yaml", ["target.tensor_parallel=2"]).target \
        .tensor_parallel == 2
    with pytest.raises(UserError, match="target.tensor_parallel"):
        load_recipe(REPO / "recipes" / "smollm2-135m-mtp.yaml", ["target.tensor_parallel=0"])


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tp")
    dirs = [str(save_tiny_model(root / name, model_type, seed=11, **overrides))
            for name, (model_type, overrides) in MODELS.items()]
    out = root / "results.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                          f"--master-port={free_port()}", "-m", "tests.tp_worker", str(out), *dirs],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("decode_path", ["torch", "kernels"])
@pytest.mark.parametrize("model", list(MODELS))
def test_tp2_matches_tp1_and_greedy_speculation_matches_plain(two_rank_results, model, decode_path):
    for rank, results in enumerate(two_rank_results["ranks"]):
        case = results[f"{model}/{decode_path}"]
        assert "error" not in case, f"rank {rank}: {case.get('error')}"
        worst = max(case["max_abs_diff"].values())
        assert worst <= TOLERANCE, (rank, case["max_abs_diff"])
        phases = {"prefill/logits", "decode0/hidden", "verify/logits", "decode_batch/logits", "verify_batch/logits"}
        assert phases <= case["max_abs_diff"].keys()
        assert case["used_kernels"] == (decode_path == "kernels")
        # The paged cache holds the rank's own KV heads (one replicated KV head when there are fewer than ranks).
        full = case["full_kv_heads"]
        expected_local = {"uneven_groups": [2, 1][rank]}.get(model, max(full // 2, 1))
        assert case["kv_cache_heads"] == expected_local
        greedy = case["greedy"]
        assert greedy["speculative_tp2"] == greedy["plain_tp2"]
        assert greedy["plain_tp2"] == greedy["plain_tp1"]
        assert greedy["accepted_tokens"] > 0


# ---- the stages under torchrun: precompute TP 2 × DP 2 (4 ranks), eval with a TP=2 target --------------------------


def _torchrun(nproc: int, args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                           f"--master-port={free_port()}", "-m", "mtp_train", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    from mtp_train.data.prepare import prepare_dataset
    from mtp_train.features.precompute import run_precompute
    from mtp_train.recipe import load_recipe
    from tests.pipeline_fixtures import make_tiny_target, synthetic_sharegpt, tiny_recipe_overrides

    root = tmp_path_factory.mktemp("tp-pipeline")
    # 6 heads / 3 KV heads: the groups split 2 + 1 over two ranks, as SmolLM2's 9 / 3 do.
    target = make_tiny_target(root / "target", seed=2, **MODELS["uneven_groups"][1])
    overrides = tiny_recipe_overrides(root, target, synthetic_sharegpt(root / "chats.jsonl", 30))
    recipe = load_recipe(REPO / "recipes" / "smollm2-135m-mtp.yaml", overrides)
    prepare_dataset(recipe, show_progress=False)
    run_precompute(recipe)  # the TP = 1 reference cache
    return root, recipe, overrides


@pytest.mark.slow
def test_precompute_tp2_dp2_matches_tp1_within_bf16_rounding(pipeline):
    from mtp_train.features.compare import compare_caches
    from mtp_train.features.format import load_manifest
    from mtp_train.features.verify import verify_features

    root, recipe, overrides = pipeline
    out = root / "features-tp2x2"
    sets = [a for o in overrides for a in ("--set", o)]
    run = _torchrun(4, ["precompute", "--tp", "2", *sets, "--set", f"precompute.output_dir={out}"])
    assert run.returncode == 0, run.stderr[-4000:]
    assert "tensor parallel 2 × data parallel 2 (world 4)" in run.stdout
    manifest = load_manifest(out)
    assert manifest["world_size"] == 2 and manifest["tensor_parallel"] == 2  # two writing groups
    assert {r["rank"] for r in manifest["splits"]["train"]["shards"]} == {0, 1}
    assert not list(out.glob("progress-r2*")) and not list(out.glob("train/shard-r2-*"))  # followers wrote nothing
    assert verify_features(out, recipe.target.path, progress=False).problems == []
    comparison = compare_caches(out, recipe.precompute.output_dir)
    assert comparison.samples == sum(info["num_samples"] for info in manifest["splits"].values())
    assert comparison.hidden.max_ulps <= 1.0, comparison.as_dict()  # each value the reference's or its neighbour
    assert comparison.argmax_agreement >= 0.99


@pytest.mark.slow
def test_eval_with_a_tp2_target_reproduces_tp1(pipeline):
    import torch

    from mtp_train.commands.eval import run_evaluation
    from mtp_train.heads import DraftHead, HeadConfig, save_head
    from mtp_train.runtime.loader import load_model

    root, recipe, overrides = pipeline
    target = load_model(recipe.target.path, dtype="float32", device="cpu")
    torch.manual_seed(0)
    save_head(DraftHead.from_target(target, HeadConfig.for_target(target.config, target.fingerprint, kind="mtp",
                                                                  init="last_layer")), root / "head")
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"question_id": i, "category": "writing", "turns": [t]})
                                 for i, t in enumerate(["hello world", "python code data cache"])) + "\n")
    common = dict(head_dir=str(root / "head"), draft_dir=None, prompts_path=str(prompts), limit=None, ks=[2],
                  max_new_tokens=12, show_progress=False, prompt_lookup=False)
    reference = run_evaluation(recipe, out_dir=root / "eval-tp1", **common)
    sets = [a for o in overrides for a in ("--set", o)]
    out = root / "eval-tp2"
    run = _torchrun(2, ["eval", "--tp", "2", *sets, "--head", str(root / "head"), "--prompts", str(prompts),
                        "--num-speculative-tokens", "2", "--max-new-tokens", "12", "--no-prompt-lookup",
                        "--set", "eval.cost_curve=false", "--out", str(out)])
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.count("eval: plain") == 1  # only the leader reports
    report = json.loads((out / "report.json").read_text())
    spec, ref = report["overall"]["mtp@k=2"], reference["overall"]["mtp@k=2"]
    assert spec["greedy_match"] is True  # speculative over the TP=2 target == plain greedy over it
    for key in ("new_tokens", "tau", "acceptance_per_position"):
        assert spec[key] == ref[key], key  # the same tokens and acceptances as with the whole target
