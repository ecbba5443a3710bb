"""Faults of the feature cache (issue 14): a target whose tokenizer did not tokenize the data is refused by precompute,
verify-features and the training reader; a damaged manifest (no fingerprints, a dropped shard record, a wrong count,
hidden size or storage dtype) is named by verify-features and refused by the reader `train` builds; precompute killed
with SIGKILL after its first shard resumes to byte-identical shards."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mtp_train.data.prepared import tokenizer_fingerprint
from mtp_train.errors import UserError
from mtp_train.features.precompute import run_precompute
from mtp_train.features.reader import FeatureReader
from mtp_train.features.verify import verify_features
from mtp_train.fingerprint import target_fingerprint
from mtp_train.recipe import load_recipe
from tests.conftest_data import SMOLLM2_CHATML_TEMPLATE, build_tokenizer
from tests.pipeline_fixtures import PRECOMPUTE_UNTIL_FIRST_SHARD, RECIPE_PATH, tiny_features
from tests.tiny_models import save_tiny_model

REPO = Path(__file__).resolve().parent.parent


def _other_tokenizer_target(directory: Path) -> Path:
    """A tiny target whose tokenizer has the same size as the pipeline's but other ids (special tokens reordered),
    and a larger embedding, so features computed with it run without an index error, as with a real other family."""
    tokenizer = build_tokenizer(["<|im_end|>", "<|im_start|>", "<|endoftext|>"], bos="<|im_start|>", eos="<|im_end|>",
                                chat_template=SMOLLM2_CHATML_TEMPLATE, vocab_size=620)
    save_tiny_model(directory, "llama", seed=7, vocab_size=len(tokenizer) + 200, eos_token_id=tokenizer.eos_token_id,
                    bos_token_id=tokenizer.bos_token_id)
    tokenizer.save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """(root, recipe, overrides) of a tiny prepared pipeline and its complete feature cache (read only)."""
    root = tmp_path_factory.mktemp("faults-features")
    recipe, overrides = tiny_features(root, num_conversations=24)
    return root, recipe, overrides


# ---- item 2: features for a target whose tokenizer is not the one that tokenized the data ----------------------------


def test_target_with_another_tokenizer_is_refused_everywhere(cache, tmp_path, monkeypatch):
    root, recipe, overrides = cache
    other = _other_tokenizer_target(tmp_path / "other-target")
    features = tmp_path / "features"
    foreign = load_recipe(RECIPE_PATH, overrides + [f"target.path={other}", f"precompute.output_dir={features}"])

    # precompute: refused before any forward, naming both tokenizers and what to do.
    with pytest.raises(UserError) as refused:
        run_precompute(foreign)
    message = str(refused.value)
    assert "fingerprint.json" in message and str(recipe.target.path) in message and str(other) in message
    assert "Re-run `mtp-train prepare` for this target" in message
    assert not features.exists()

    # A cache made that way before the check existed (the check skipped): verify-features and the reader refuse it.
    monkeypatch.setattr("mtp_train.features.precompute._check_tokenizer", lambda recipe, prepared: None)
    run_precompute(foreign)
    for target_dir in (other, None):  # --target, or the cache's own target
        report = verify_features(features, target_dir, progress=False)
        assert not report.ok and any("the data was tokenized by tokenizer" in p and str(other) in p
                                     for p in report.problems), report.problems
    with pytest.raises(UserError, match="the data was tokenized by tokenizer"):
        FeatureReader(features, expected_fingerprints={"target": target_fingerprint(other)}, target_dir=other)
    with pytest.raises(UserError, match="the data was tokenized by tokenizer") as refused:  # the trainer's way
        FeatureReader(features, expected_fingerprints={"target": target_fingerprint(other),
                                                       "tokenizer": tokenizer_fingerprint(other)}, target_dir=other)
    assert str(other) in str(refused.value)
    # The target the data was prepared with passes all three.
    assert verify_features(root / "features", recipe.target.path, progress=False).ok
    FeatureReader(root / "features", target_dir=recipe.target.path)


# ---- item 6: manifest faults flagged by verify and refused by the training reader ------------------------------------


def _drop_fingerprints(manifest):
    del manifest["fingerprints"]
    return "fingerprints"


def _drop_record(manifest):
    return manifest["splits"]["train"]["shards"].pop(0)["name"]


def _wrong_num_samples(manifest):
    record = manifest["splits"]["train"]["shards"][1]
    record["num_samples"] += 1
    return f"{record['name']}: holds {record['num_samples'] - 1} samples"


def _wrong_hidden_size(manifest):
    manifest["hidden_size"] = 32
    return "hidden_size 32"


def _wrong_storage_dtype(manifest):
    manifest["storage_dtype"] = "float16"
    return "storage_dtype float16"


@pytest.mark.parametrize(
    "damage", [_drop_fingerprints, _drop_record, _wrong_num_samples, _wrong_hidden_size, _wrong_storage_dtype]
)
def test_damaged_manifest_is_named_by_verify_and_refused_by_the_reader(cache, tmp_path, damage):
    root, recipe, _ = cache
    features = shutil.copytree(root / "features", tmp_path / "features")
    manifest = json.loads((features / "manifest.json").read_text())
    named = damage(manifest)
    (features / "manifest.json").write_text(json.dumps(manifest))

    report = verify_features(features, recipe.target.path, progress=False)
    assert not report.ok and any(named in problem for problem in report.problems), report.problems
    with pytest.raises(UserError) as refused:  # what `train` builds (trainer.setup)
        FeatureReader(features, "train", expected_fingerprints={"target": target_fingerprint(recipe.target.path)})
    assert named in str(refused.value)
    assert "manifest.json" in str(refused.value)


# ---- precompute: SIGKILL after the first shard, then resume ----------------------------------------------------------


@pytest.mark.slow
def test_sigkill_after_first_shard_then_resume_is_byte_identical(cache, tmp_path):
    root, _, overrides = cache
    killed = tmp_path / "killed"
    sets = overrides + [f"precompute.output_dir={killed}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    child = subprocess.Popen([sys.executable, "-c", PRECOMPUTE_UNTIL_FIRST_SHARD, str(RECIPE_PATH), json.dumps(sets)],
                             cwd=REPO, env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        lines = []
        while not lines or not (lines[-1].startswith("SHARD_WRITTEN") or lines[-1] == ""):  # "" = the child ended
            lines.append(child.stdout.readline())
        assert lines[-1].split() == ["SHARD_WRITTEN", "1"], lines
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL
    assert not (killed / "manifest.json").exists()
    assert len(list(killed.rglob("shard-*.safetensors"))) == 1

    run_precompute(load_recipe(RECIPE_PATH, sets))
    reference = {p.relative_to(root / "features"): p.read_bytes() for p in (root / "features").rglob("shard-*")}
    resumed = {p.relative_to(killed): p.read_bytes() for p in killed.rglob("shard-*")}
    assert len(reference) > 2 and resumed == reference
    assert not list(killed.rglob("*.tmp-*"))
    assert verify_features(killed, progress=False).ok
