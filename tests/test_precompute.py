"""Precompute: features equal transformers' hidden states; torchrun sharding covers every sample once; a killed
run resumes to byte-identical shards; verify-features catches corruption; caches refuse another target."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mtp_train.errors import UserError
from mtp_train.features.format import decode_hidden, encode_hidden, load_manifest
from mtp_train.features.precompute import pack_batches, plan_rank_shards, run_precompute
from mtp_train.features.verify import verify_features
from mtp_train.recipe import load_recipe
from tests.pipeline_fixtures import free_port, tiny_pipeline

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "smollm2-135m-mtp.yaml"


def _cli(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, **kwargs)


def _shard_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("shard-*.safetensors"))}


def _read_samples(root: Path, split: str = "train") -> dict[int, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    manifest = load_manifest(root)
    samples = {}
    for record in manifest["splits"][split]["shards"]:
        t = load_file(root / record["name"])
        hidden = decode_hidden(t["hidden"], t.get("hidden_scale"))
        for s, index in enumerate(t["sample_index"].tolist()):
            a, b = t["offsets"][s].item(), t["offsets"][s + 1].item()
            samples[index] = {"input_ids": t["input_ids"][a:b], "loss_mask": t["loss_mask"][a:b], "hidden": hidden[a:b]}
    return samples


def test_plan_is_disjoint_balanced_and_packs_by_tokens():
    lengths = [5, 50, 7, 30, 30, 2, 9, 41, 13]
    plans = [plan_rank_shards(lengths, r, 2, samples_per_shard=2) for r in range(2)]
    everything = sorted(i for plan in plans for shard in plan for i in shard)
    assert everything == list(range(len(lengths)))
    totals = [sum(lengths[i] for shard in plan for i in shard) for plan in plans]
    assert abs(totals[0] - totals[1]) <= max(lengths)
    batches = pack_batches([1, 7, 3, 4, 8], lengths, tokens_per_batch=60)
    assert batches == [[1], [7], [3, 4], [8]]  # 50 | 41 | 30+30 | 13


@pytest.mark.parametrize("storage", ["bfloat16", "float16", "float8_e4m3"])
def test_storage_roundtrip_error(storage):
    hidden = torch.randn(64, 32) * 3
    stored, scale = encode_hidden(hidden, storage)
    error = (decode_hidden(stored, scale) - hidden).abs() / hidden.abs().amax(-1, keepdim=True)
    assert error.max() < {"bfloat16": 2**-8, "float16": 2**-11, "float8_e4m3": 2**-3}[storage]


def test_features_match_transformers_hidden_states(tmp_path):
    from transformers import AutoModelForCausalLM

    recipe, _ = tiny_pipeline(tmp_path, num_conversations=24)
    root = run_precompute(recipe)
    assert verify_features(root, recipe.target.path, progress=False).ok
    hf = AutoModelForCausalLM.from_pretrained(recipe.target.path, dtype=torch.float32).eval()
    samples = _read_samples(root)
    assert len(samples) > 10
    for index in list(samples)[:6]:
        sample = samples[index]
        with torch.no_grad():
            ref = hf(sample["input_ids"][None].long(), output_hidden_states=True).hidden_states[-1][0]
        # fp32 compute, bf16 storage: equal within bf16 rounding of each value.
        tol = ref.abs() * 2**-8 + 1e-4
        assert ((sample["hidden"] - ref).abs() <= tol).all()


def test_kv_dtype_stores_the_states_a_decode_over_a_bf16_cache_computes(tmp_path):
    """`precision.kv_cache: bfloat16` on an fp32 target: the stored states are those of attention over keys and values
    rounded as a bf16 K/V cache holds them (the served target's), recorded in the manifest; a resume under another
    setting is refused."""
    from mtp_train.runtime.attention import BatchInfo
    from mtp_train.runtime.loader import load_model

    recipe, overrides = tiny_pipeline(tmp_path, num_conversations=16, **{"precision.kv_cache": "bfloat16"})
    root = run_precompute(recipe)
    assert load_manifest(root)["kv_dtype"] == "bfloat16"
    model = load_model(recipe.target.path, dtype="float32", device="cpu")
    samples = _read_samples(root)
    worst = {"rounded": 0.0, "unrounded": 0.0}
    for sample in list(samples.values())[:4]:
        ids = sample["input_ids"].long()
        for name, kv_dtype in (("rounded", torch.bfloat16), ("unrounded", None)):
            states = model(ids, BatchInfo.without_cache([len(ids)], kv_dtype=kv_dtype), return_hidden=True).hidden
            stored = encode_hidden(states, "bfloat16")
            worst[name] = max(worst[name], (decode_hidden(*stored, torch.float32) - sample["hidden"]).abs().max().item())
    assert worst["rounded"] == 0.0 < worst["unrounded"]  # the same bf16 values as the rounded forward, bit for bit

    (root / "manifest.json").unlink()  # pretend it was interrupted: progress files remain
    with pytest.raises(UserError, match="kv_dtype='bfloat16', this run 'float32'"):
        run_precompute(load_recipe(RECIPE, overrides + ["precision.kv_cache=float32"]))


def test_features_from_vllm_refuse_a_kv_cache_set_for_the_runtime(tmp_path):
    """`precision.kv_cache` is the runtime's cache; features from vLLM attend over vLLM's
    (precompute.vllm.kv_cache_dtype), so an explicit value is refused before anything starts, naming both keys."""
    _, overrides = tiny_pipeline(tmp_path, num_conversations=8)
    recipe = load_recipe(RECIPE, overrides + ["precompute.backend=vllm", "precision.kv_cache=bfloat16",
                                              f"precompute.output_dir={tmp_path / 'cache'}"])
    with pytest.raises(UserError, match=r"precision.kv_cache bfloat16 is the runtime's K/V cache; .*"
                                        r"precompute.vllm.kv_cache_dtype"):
        run_precompute(recipe)
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("bf16_decode_wins", [True, False])
def test_kv_dtype_auto_follows_the_k_v_cache_eval_decodes_over(tmp_path, monkeypatch, capsys, bf16_decode_wins):
    """`precision.kv_cache: auto` with `precision.compute: auto` on an AVX2-only CPU: precompute runs the fp32 target and
    rounds keys and values to bf16 when decode (timed, as eval times it) reads bf16 weights, so a bf16 K/V cache; an
    fp32 decode keeps them unrounded. `auto` is resolved once and printed once, and recipe.resolved.yaml records what
    it resolved to."""
    from mtp_train.runtime import precision
    from tests.test_precision import AVX2

    monkeypatch.setattr(precision, "cpu_facts", lambda: AVX2)
    bf16_ms = 1e-3 if bf16_decode_wins else 4e-3
    monkeypatch.setattr(precision, "decode_probe", lambda *a, **k: {rows: {"float32": 2e-3, "bfloat16": bf16_ms}
                                                                    for rows in precision.PROBE_ROWS})
    _, overrides = tiny_pipeline(tmp_path, num_conversations=12)
    recipe = load_recipe(RECIPE, overrides + ["precision.compute=auto"])
    root = run_precompute(recipe)
    kv = "bfloat16" if bf16_decode_wins else "float32"
    assert load_manifest(root)["kv_dtype"] == kv
    lines = [line for line in capsys.readouterr().out.splitlines() if "compute dtype" in line]
    assert len(lines) == 1 and lines[0].startswith(
        "precompute: compute dtype float32" + (", K/V cache bfloat16 (auto: " if bf16_decode_wins else " (auto: "))
    resolved = load_recipe(root / "recipe.resolved.yaml").precision
    assert (resolved.compute, resolved.decode, resolved.kv_cache) == ("float32", "auto", kv)


def test_precompute_probes_no_peak_and_records_its_speed(tmp_path, monkeypatch, capsys):
    """Precompute records tokens/s and the target's counted GFLOP/s in its manifest and prints them; it runs no probe
    of the machine's matmul peak (scripts/bench_precompute.py does)."""
    import mtp_train.runtime.hardware as hardware

    def no_probe(*args, **kwargs):
        raise AssertionError("precompute probed the machine's matmul peak")

    monkeypatch.setattr(hardware, "measure_matmul_gflops", no_probe)
    recipe, _ = tiny_pipeline(tmp_path, num_conversations=20)
    run_precompute(recipe)
    throughput = load_manifest(Path(recipe.precompute.output_dir))["throughput"]
    assert throughput["tokens"] > 0 and throughput["tokens_per_s"] > 0 and throughput["gflops"] > 0
    assert not {"peak_gflops", "fraction_of_peak"} & set(throughput)
    assert f"{throughput['tokens_per_s']:.0f} tok/s, {throughput['gflops']:.1f} GFLOP/s" in capsys.readouterr().out


@pytest.mark.slow
def test_torchrun_two_ranks_cover_every_sample_once(tmp_path):
    recipe, overrides = tiny_pipeline(tmp_path, num_conversations=30)
    sets = [a for o in overrides for a in ("--set", o)]
    result = _cli(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master-port={free_port()}", "-m",
         "mtp_train", "precompute", "--recipe", str(RECIPE), *sets],
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    root = Path(recipe.precompute.output_dir)
    manifest = load_manifest(root)
    assert manifest["world_size"] == 2
    assert {r["rank"] for r in manifest["splits"]["train"]["shards"]} == {0, 1}
    report = verify_features(root, progress=False)
    assert report.ok, report.problems
    assert report.samples == sum(info["num_samples"] for info in manifest["splits"].values())


@pytest.mark.slow
def test_sigkill_then_resume_is_byte_identical(tmp_path):
    recipe, overrides = tiny_pipeline(tmp_path / "a", num_conversations=160, **{"precompute.samples_per_shard": 2,
                                                                               "precompute.tokens_per_batch": 32})
    reference_root = run_precompute(recipe)
    reference = _shard_bytes(reference_root)
    killed_root = tmp_path / "killed"
    sets = [a for o in overrides for a in ("--set", o)] + ["--set", f"precompute.output_dir={killed_root}"]
    command = [sys.executable, "-m", "mtp_train", "precompute", "--recipe", str(RECIPE), *sets]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    progress = killed_root / "progress-r0.json"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        if progress.is_file() and progress.read_text().count('"sha256"') >= 3:
            break
        time.sleep(0.002)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (killed_root / "manifest.json").exists(), "the run finished before it could be killed"
    partial = len(_shard_bytes(killed_root))
    assert 0 < partial < len(reference)
    result = _cli(command, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert _shard_bytes(killed_root) == reference
    assert not list(killed_root.rglob("*.tmp-*"))  # no leftovers of the killed write


@pytest.mark.slow
def test_verify_catches_flipped_byte_and_truncation(tmp_path):
    recipe, _ = tiny_pipeline(tmp_path, num_conversations=16)
    root = run_precompute(recipe)
    shards = sorted(root.rglob("shard-*.safetensors"))
    flipped, truncated = shards[0], shards[1]
    data = bytearray(flipped.read_bytes())
    data[-5] ^= 0x01
    flipped.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:-100])
    report = verify_features(root, progress=False)
    assert not report.ok
    text = "\n".join(report.problems)
    assert f"{flipped.relative_to(root)}: sha256 mismatch" in text
    assert f"{truncated.relative_to(root)}: size" in text and "truncated" in text
    assert "missing from every shard" in text  # coverage reports the samples those shards held
    result = _cli([sys.executable, "-m", "mtp_train", "verify-features", str(root)])
    assert result.returncode == 1 and "FAILED" in result.stdout


def test_refuses_to_append_for_another_target(tmp_path):
    from tests.pipeline_fixtures import make_tiny_target

    recipe, overrides = tiny_pipeline(tmp_path, num_conversations=16)
    root = run_precompute(recipe)
    (root / "manifest.json").unlink()  # pretend it was interrupted: progress files remain
    other = make_tiny_target(tmp_path / "other-target", seed=7)
    shutil.copy(Path(recipe.target.path) / "tokenizer.json", other / "tokenizer.json")
    changed = load_recipe(RECIPE, overrides + [f"target.path={other}"])
    with pytest.raises(UserError, match="fingerprint 'target' differs"):
        run_precompute(changed)
    assert verify_features(root, other, progress=False).ok is False


def test_reader_splits_ranks_shuffles_and_resumes(tmp_path):
    from mtp_train.features.reader import FeatureReader

    recipe, _ = tiny_pipeline(tmp_path, num_conversations=40)
    root = run_precompute(recipe)
    readers = [FeatureReader(root, micro_batch_tokens=200, rank=r, world_size=2, seed=3) for r in range(2)]
    epoch0 = [r.epoch_batches(0) for r in readers]
    assert len(epoch0[0]) == len(epoch0[1]) > 0
    seen = [i for batches in epoch0 for b in batches for i in b]
    assert len(seen) == len(set(seen))  # ranks disjoint
    assert epoch0[0] != readers[0].epoch_batches(1)  # reshuffled per epoch
    for b in epoch0[0]:
        assert sum(readers[0].samples[i][2] for i in b) <= 200 or len(b) == 1
    # The batch content equals the stored sample, and resuming from a saved position continues identically.
    samples = _read_samples(root)
    reader = readers[0]
    it = iter(reader)
    first = [next(it) for _ in range(3)]
    state = reader.state_dict()
    following = [next(it) for _ in range(4)]
    resumed = FeatureReader(root, micro_batch_tokens=200, rank=0, world_size=2, seed=3)
    older = {key: value for key, value in state.items() if key != "seed"}  # an older mtp-train's data position
    with pytest.raises(UserError, match="data position without seed: saved by an older mtp-train; start over"):
        resumed.load_state_dict(older)
    resumed.load_state_dict(state)
    again = iter(resumed)
    for expected in following:
        got = next(again)
        assert torch.equal(got.input_ids, expected.input_ids) and torch.equal(got.hidden, expected.hidden)
    batch = first[0]
    start = 0
    for pos, length in zip(batch.sample_index, batch.lengths):
        stored = samples[pos]  # positions are sample indices (samples are ordered by index)
        assert torch.equal(batch.input_ids[start : start + length], stored["input_ids"].long())
        assert torch.equal(batch.hidden[start : start + length], stored["hidden"])
        start += length


def test_reader_refuses_corrupted_shard_and_wrong_target(tmp_path):
    from mtp_train.features.reader import FeatureReader

    recipe, _ = tiny_pipeline(tmp_path, num_conversations=16)
    root = run_precompute(recipe)
    with pytest.raises(UserError, match="fingerprint 'target'"):
        FeatureReader(root, expected_fingerprints={"target": "0" * 16})
    shard = sorted((root / "train").glob("shard-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(UserError, match="sha256 differs"):
        FeatureReader(root)


def _build_on_ranks(root: Path, ranks: int, monkeypatch, **kwargs) -> tuple[list, dict[int, list[str]]]:
    """Build `FeatureReader(root, hash_share=(rank, ranks))` on `ranks` threads standing in for ranks, with
    `all_gather_object` exchanging the threads' objects as the collective exchanges the ranks'. Returns each rank's
    reader or raised error, and the shard names each rank hashed."""
    import threading

    import mtp_train.features.reader as reader
    from mtp_train.fileio import file_sha256

    barrier = threading.Barrier(ranks, timeout=60)
    sent: dict[int, object] = {}
    hashed: dict[int, list[str]] = {rank: [] for rank in range(ranks)}
    local = threading.local()

    def all_gather_object(out: list, obj: object) -> None:
        sent[local.rank] = obj
        barrier.wait()
        out[:] = [sent[rank] for rank in range(ranks)]
        barrier.wait()

    def counting_sha256(path, *args):
        hashed[local.rank].append(Path(path).name)
        return file_sha256(path, *args)

    monkeypatch.setattr(reader.dist, "all_gather_object", all_gather_object)
    monkeypatch.setattr(reader, "file_sha256", counting_sha256)  # where the reader calls it
    results: list = [None] * ranks

    def build(rank: int) -> None:
        local.rank = rank
        try:
            results[rank] = reader.FeatureReader(root, hash_share=(rank, ranks), **kwargs)
        except UserError as err:
            results[rank] = err

    threads = [threading.Thread(target=build, args=(rank,)) for rank in range(ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, hashed


def test_reader_hashes_each_shard_once_among_the_ranks_and_all_refuse_a_corrupted_one(tmp_path, monkeypatch):
    """Every training rank builds the train and eval readers of the same cache; the shards' sha256 are checked once
    among them (shard i by rank i % world size), not by every rank, and a corrupted shard is refused on every rank
    with the same message, naming the file and what to run."""
    recipe, _ = tiny_pipeline(tmp_path, num_conversations=16)
    root = run_precompute(recipe)
    names = [Path(record["name"]).name for record in load_manifest(root)["splits"]["train"]["shards"]]
    assert len(names) >= 3
    readers, hashed = _build_on_ranks(root, 2, monkeypatch, micro_batch_tokens=1)
    assert all(not isinstance(r, UserError) for r in readers), readers
    assert hashed == {0: names[0::2], 1: names[1::2]}  # each shard once, in all
    # The eval reader does not split its data over the ranks (rank 0 of 1), but its hashing is still shared.
    readers, hashed = _build_on_ranks(root, 2, monkeypatch, split="eval", rank=0, world_size=1)
    eval_names = [Path(record["name"]).name for record in load_manifest(root)["splits"]["eval"]["shards"]]
    assert sorted(hashed[0] + hashed[1]) == sorted(eval_names) and not set(hashed[0]) & set(hashed[1])

    shard = root / "train" / names[1]  # hashed by rank 1 only
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    errors, hashed = _build_on_ranks(root, 2, monkeypatch, micro_batch_tokens=1)
    assert names[1] not in hashed[0]
    assert all(isinstance(e, UserError) for e in errors), errors
    assert str(errors[0]) == str(errors[1])
    assert f"{shard}: sha256 differs from the manifest" in str(errors[0])
    assert f"mtp-train verify-features {root}" in str(errors[0])
