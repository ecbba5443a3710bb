"""`precompute.backend: vllm`: the feature cache computed by vLLM (its CPU build, in its own virtualenv) is the
runtime backend's cache, within storage rounding; it resumes after kill -9 as the runtime's does; misuse is refused.

Needs vLLM's interpreter (`make .venv-vllm/.installed`; `make test` installs it and sets MTP_TRAIN_REQUIRE_VLLM=1,
so that there a missing vLLM fails instead of skipping). A tiny random Llama whose head size vLLM's CPU attention
takes (32), three layers, fp32."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mtp_train.errors import UserError
from mtp_train.features.compare import compare_caches
from mtp_train.features.format import load_manifest
from mtp_train.features.precompute import run_precompute
from mtp_train.features.verify import verify_features
from mtp_train.recipe import load_recipe
from tests.pipeline_fixtures import (PRECOMPUTE_UNTIL_FIRST_SHARD, RECIPE_PATH, free_port, tiny_pipeline,
                                     vllm_python)

REPO = Path(__file__).resolve().parents[1]
TINY_VLLM_TARGET = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3, "num_attention_heads": 4,
                    "num_key_value_heads": 2}
AUX_LAYERS = "[0, 1, 2]"  # every decoder layer's output: vLLM ids 1..3, the last one also H's input
VLLM = ["precompute.backend=vllm", "precompute.vllm.enforce_eager=true"]




pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    vllm_python()
    root = tmp_path_factory.mktemp("vllm-backend")
    _, overrides = tiny_pipeline(root, num_conversations=24, target_overrides=TINY_VLLM_TARGET,
                                 **{"precompute.aux_layers": AUX_LAYERS, "precision.kv_cache": "float32"})
    return root, overrides


@pytest.fixture(scope="module")
def caches(pipeline):
    """(vLLM's cache, the runtime's cache) of the same prepared data, both computed in fp32."""
    root, overrides = pipeline
    runtime = run_precompute(load_recipe(RECIPE_PATH, overrides + [f"precompute.output_dir={root / 'runtime'}"]))
    vllm_overrides = overrides + VLLM + ["precision.kv_cache=auto", f"precompute.output_dir={root / 'vllm'}"]
    vllm = run_precompute(load_recipe(RECIPE_PATH, vllm_overrides))
    return vllm, runtime, vllm_overrides


def test_vllm_cache_is_the_runtime_cache_within_storage_rounding(caches):
    vllm, runtime, _ = caches
    result = compare_caches(vllm, runtime)
    assert result.samples == 24 and result.tokens > 0
    # fp32 both ways: different kernels, the same values up to fp32 round-off, then one bf16 rounding at storage
    assert result.hidden.max_ulps <= 1.5 and result.hidden.mean_row_rel < 1e-4, result.hidden
    assert result.aux_hidden is not None and result.aux_hidden.max_ulps <= 1.5, result.aux_hidden
    assert result.argmax_agreement >= 0.999
    manifest = load_manifest(vllm)
    assert manifest["backend"] == "vllm" and manifest["vllm_version"] == "0.32.0"
    assert manifest["target_dtype"] == "float32" and manifest["kv_dtype"] == "float32"
    assert manifest["aux_layers"] == [0, 1, 2]
    assert verify_features(vllm, progress=False).ok
    assert not list((vllm / ".vllm").glob("states/*"))  # per-sample files removed as read


def test_a_cache_of_one_backend_is_not_resumed_by_the_other(caches, pipeline):
    vllm, _, _ = caches
    _, overrides = pipeline
    with pytest.raises(UserError, match="backend='vllm', this run 'runtime'"):
        run_precompute(load_recipe(RECIPE_PATH, overrides + [f"precompute.output_dir={vllm}"]))


def test_a_finished_cache_is_checked_without_starting_vllm(caches, capsys):
    """No vLLM interpreter is needed to find a finished cache finished (starting the engine takes a minute)."""
    vllm, _, vllm_overrides = caches
    recipe = load_recipe(RECIPE_PATH, vllm_overrides + ["precompute.vllm.python=/nonexistent/python"])
    assert run_precompute(recipe) == vllm
    assert "is already complete" in capsys.readouterr().out
    explicit = load_recipe(RECIPE_PATH, vllm_overrides + ["precision.compute=bfloat16"])
    with pytest.raises(UserError, match="target_dtype='float32', this run 'bfloat16'"):
        run_precompute(explicit)


def _descendants(pid: int) -> set[int]:
    found, frontier = set(), [pid]
    while frontier:
        parent = frontier.pop()
        for status in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = status.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == parent:
                child = int(status.parent.name)
                found.add(child)
                frontier.append(child)
    return found


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.add(pid)
    return alive


def test_kill_9_then_resume_is_byte_identical_and_leaves_no_engine(caches, tmp_path):
    vllm, _, vllm_overrides = caches
    killed = tmp_path / "killed"
    sets = vllm_overrides + [f"precompute.output_dir={killed}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    child = subprocess.Popen([sys.executable, "-c", PRECOMPUTE_UNTIL_FIRST_SHARD, str(RECIPE_PATH), json.dumps(sets)],
                             cwd=REPO, env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        lines = []
        while not lines or not (lines[-1].startswith("SHARD_WRITTEN") or lines[-1] == ""):  # "" = the child ended
            lines.append(child.stdout.readline())
        assert lines[-1].split() == ["SHARD_WRITTEN", "1"], lines
        engine = _descendants(child.pid)
        assert engine  # the vLLM worker (and its engine core)
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 60
    while _alive(engine) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _alive(engine), "vLLM's processes outlived the killed precompute"
    assert not (killed / "manifest.json").exists()
    assert len(list(killed.rglob("shard-*.safetensors"))) == 1

    run_precompute(load_recipe(RECIPE_PATH, sets))
    reference = {p.relative_to(vllm): p.read_bytes() for p in vllm.rglob("shard-*")}
    resumed = {p.relative_to(killed): p.read_bytes() for p in killed.rglob("shard-*")}
    assert len(reference) > 2 and resumed == reference
    assert verify_features(killed, progress=False).ok


def test_torchrun_ranks_are_engines_side_by_side(caches, tmp_path):
    """Data parallelism: two torchrun ranks, each its own vLLM engine over its share of the samples (on GPUs each on
    its own devices), make the one-engine cache: every sample once, the same states."""
    vllm, _, vllm_overrides = caches
    out = tmp_path / "dp"
    sets = [a for o in vllm_overrides + [f"precompute.output_dir={out}"] for a in ("--set", o)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                          f"--master-port={free_port()}", "-m", "mtp_train", "precompute", "--recipe", str(RECIPE_PATH),
                          *sets], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "rank 1 starting vLLM" in run.stdout
    manifest = load_manifest(out)
    assert manifest["world_size"] == 2 and manifest["backend"] == "vllm"
    assert {shard["rank"] for shard in manifest["splits"]["train"]["shards"]} == {0, 1}
    assert verify_features(out, progress=False).ok
    result = compare_caches(out, vllm)  # every sample of the one-engine cache, once, token for token
    assert result.samples == 24
    assert result.hidden.max_ulps <= 1.5 and result.aux_hidden.max_ulps <= 1.5 and result.argmax_agreement >= 0.999
    assert (out / ".vllm" / "rank1" / "worker.log").is_file()


def test_engine_devices_give_each_rank_its_own_gpus():
    from mtp_train.features.vllm_target import engine_devices
    from mtp_train.recipe import VllmEngineSection

    tp2 = VllmEngineSection(tensor_parallel_size=2)
    assert [engine_devices(tp2, rank, 4, 8) for rank in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert engine_devices(tp2, 0, 1, 8) is None  # one engine: vLLM's default (every visible device)
    assert engine_devices(tp2, 1, 2, 0) is None  # CPU
    with pytest.raises(UserError, match="need 16 GPUs; this node has 8"):
        engine_devices(VllmEngineSection(tensor_parallel_size=4), 0, 4, 8)


@pytest.mark.parametrize("sets, message", [
    (["precision.kv_cache=bfloat16"], "precision.kv_cache bfloat16 is the runtime's K/V cache"),
    (["target.tensor_parallel=2"], "spreads the target with vLLM's own parallelism"),
    (["precompute.vllm.engine_args={data_parallel_size: 2}"], "data parallelism is torchrun's ranks"),
    (["precompute.vllm.engine_args={max_model_len: 64}"], r"engine_args: max_model_len set here"),
    (["precompute.vllm.python=/nonexistent/python"], "precompute.vllm.python /nonexistent/python: no such"),
])
def test_misuse_is_refused_before_anything_runs(pipeline, tmp_path, sets, message):
    _, overrides = pipeline
    recipe = load_recipe(RECIPE_PATH, overrides + VLLM + ["precision.kv_cache=auto",
                                                          f"precompute.output_dir={tmp_path / 'cache'}", *sets])
    with pytest.raises(UserError, match=message):
        run_precompute(recipe)
    assert not list((tmp_path / "cache").glob("*/shard-*"))


def test_a_worker_that_fails_names_its_log(pipeline, tmp_path):
    """vLLM refusing the model (here an engine argument it does not know) is a UserError naming the worker's log."""
    _, overrides = pipeline
    recipe = load_recipe(RECIPE_PATH, overrides + VLLM + [
        "precision.kv_cache=auto", f"precompute.output_dir={tmp_path / 'cache'}",
        "precompute.vllm.engine_args={no_such_engine_argument: 1}"])
    with pytest.raises(UserError, match=r"vLLM failed: .*no_such_engine_argument.*its log: .*worker.log"):
        run_precompute(recipe)


@pytest.mark.parametrize("kind", ["mtp"])
def test_eval_in_vllm_beside_ours(caches, tmp_path, kind):
    """A head trained on vLLM's features, exported in the format vLLM loads for its kind and served by vLLM on the
    held-out prompts (`mtp-train eval --engine both`): vLLM's τ, acceptance per position and speedup in report.json
    and report.md beside our engine's, and vLLM's greedy speculative output identical to its plain output."""
    from mtp_train.cli import main
    from mtp_train.train.trainer import run_training

    vllm, _, vllm_overrides = caches
    run_dir = tmp_path / "run"
    sets = vllm_overrides + [f"train.run_dir={run_dir}", f"head.kind={kind}", "train.max_steps=24",
                             "eval.cost_curve=false", "precision.decode=float32"]
    run_training(load_recipe(RECIPE_PATH, sets), show_progress=False)
    out = tmp_path / "eval"
    argv = ["eval", "--recipe", str(RECIPE_PATH), *(a for s in sets for a in ("--set", s)), "--engine", "both",
            "--num-speculative-tokens", "2", "--limit", "3", "--max-new-tokens", "16", "--no-prompt-lookup",
            "--out", str(out)]
    assert main(argv) == 0
    report = json.loads((out / "report.json").read_text())
    ours = report["overall"][f"{kind}@k=2"]
    theirs = report["vllm"]["methods"][f"{kind}@k=2"]
    assert report["vllm"]["vllm_version"] == "0.32.0" and 1 <= report["vllm"]["prompts"] <= 3
    assert report["vllm"]["export"]["format"] == {"mtp": "vllm-mtp", "eagle3": "eagle3"}[kind]
    assert theirs["outputs_identical_to_plain"], theirs
    assert theirs["drafts"] > 0 and len(theirs["acceptance_per_position"]) == 2
    assert 1.0 <= theirs["tau"] <= 3.0 and theirs["speedup"] > 0
    assert ours["tau"] >= 1.0  # ours ran too, in the same report
    markdown = (out / "report.md").read_text()
    assert "## vLLM 0.32.0" in markdown and f"| {kind}@k=2 |" in markdown and "vllm serve" in markdown
