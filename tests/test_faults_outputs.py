"""Never lose a user's data (issue 44).

Item 1: an output directory is written, replaced or deleted only when it is absent, empty, or carries our marker of the
same kind (`fileio.OUTPUT_MARKER`). Before the fix `prepare` swapped out whatever directory `data.output_dir` named,
`precompute --force` ran `rmtree` on any `precompute.output_dir`, and `export --overwrite` replaced any directory
(`--out exports --overwrite` deleted every other export).
Item 4: a resumed or finished precompute compares the compute dtype; before, a cache could hold shards computed in
fp32 and in bf16, and a finished one ignored a new dtype.
Item 8: a directory replace killed between its two renames (no output under its name, the old copy hidden as
`.<name>.old-<pid>`) is undone by the next reader or writer of that output; before, only the asset builder cleaned
such copies, and it deleted them.
Item 5: one writer per output: a second prepare or precompute of the same output stops at once naming the first
(pid, host, command), and eval does not log into a run whose trainer holds it.
Item 6: precompute checks the prepared token ids against the target's vocabulary before it computes anything (before,
an IndexError naming no sample) and stores no NaN or infinite state (before, stored unchecked); the tokenizer
fingerprint covers tokenizer_config.json's id-relevant keys and added_tokens.json (before, left out)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from mtp_train.data.prepare import prepare_dataset
from mtp_train.errors import UserError
from mtp_train.export import export_head, inspect_dir
from mtp_train.features.format import load_manifest
from mtp_train.features.precompute import run_precompute
from mtp_train.fileio import (
    OUTPUT_MARKER,
    OutputLock,
    check_output_dir,
    output_kind,
    recover_replaced_directory,
    sibling_lock_path,
    write_output_marker,
)
from mtp_train.recipe import load_recipe
from tests.pipeline_fixtures import RECIPE_PATH, tiny_pipeline


def _user_dir(path: Path) -> dict[str, str]:
    """A directory of the user's (a source file and a subdirectory), and what it holds."""
    (path / "sub").mkdir(parents=True)
    files = {"chats.jsonl": '{"id": 1}\n', "sub/notes.txt": "mine"}
    for name, text in files.items():
        (path / name).write_text(text)
    return files


def _unchanged(path: Path, files: dict[str, str]) -> bool:
    held = {str(p.relative_to(path)): p.read_text() for p in path.rglob("*") if p.is_file()}
    return held == files


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """(recipe overrides, root) of a tiny prepared dataset (read only)."""
    root = tmp_path_factory.mktemp("faults-outputs")
    _, overrides = tiny_pipeline(root, num_conversations=16)
    return overrides, root


def test_the_marker_rules(tmp_path):
    check_output_dir(tmp_path / "absent", "features", "precompute.output_dir")
    (tmp_path / "empty").mkdir()
    check_output_dir(tmp_path / "empty", "features", "precompute.output_dir")
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / "shard.bin").write_bytes(b"x")
    write_output_marker(ours, "features")
    assert output_kind(ours) == "features"
    check_output_dir(ours, "features", "precompute.output_dir")
    with pytest.raises(UserError, match=r"holds the output of mtp-train precompute \(features\), not of mtp-train "
                                        r"export"):
        check_output_dir(ours, "export", "--out")
    (ours / OUTPUT_MARKER).write_text('{"kind": "features"')  # torn: not a marker
    with pytest.raises(UserError, match="not empty and not written by mtp-train precompute"):
        check_output_dir(ours, "features", "precompute.output_dir")
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="exists and is not a directory"):
        check_output_dir(tmp_path / "file", "prepared", "data.output_dir")


@pytest.mark.parametrize("force", [False, True])
def test_prepare_never_replaces_a_directory_it_did_not_write(pipeline, tmp_path, force):
    overrides, _ = pipeline
    mine = tmp_path / "mydata"
    files = _user_dir(mine)
    recipe = load_recipe(RECIPE_PATH, overrides + [f"data.output_dir={mine}"])
    with pytest.raises(UserError, match=r"data.output_dir .*mydata: not empty and not written by mtp-train prepare"):
        prepare_dataset(recipe, force=force, show_progress=False)
    assert _unchanged(mine, files)
    # no work or staging directory left behind; the lock file stays, empty (released)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".mydata.lock", "mydata"]
    assert (tmp_path / ".mydata.lock").read_text() == ""


def test_prepare_replaces_its_own_output(pipeline):
    overrides, root = pipeline
    recipe = load_recipe(RECIPE_PATH, overrides)
    assert output_kind(root / "prepared") == "prepared"
    result = prepare_dataset(recipe, force=True, show_progress=False)
    assert not result.up_to_date and output_kind(root / "prepared") == "prepared"


@pytest.mark.parametrize("force", [False, True])
def test_precompute_never_writes_into_or_deletes_a_directory_it_did_not_write(pipeline, tmp_path, force):
    """`--set precompute.output_dir=data --force` used to delete the downloaded models."""
    overrides, _ = pipeline
    models = tmp_path / "data"
    files = _user_dir(models)
    recipe = load_recipe(RECIPE_PATH, overrides + [f"precompute.output_dir={models}"])
    with pytest.raises(UserError, match=r"precompute.output_dir .*data: not empty and not written by mtp-train "
                                        r"precompute.*--force/--overwrite included"):
        run_precompute(recipe, force=force)
    assert _unchanged(models, files)


def test_precompute_refuses_another_stages_output_and_forces_its_own(pipeline, tmp_path):
    overrides, root = pipeline
    recipe = load_recipe(RECIPE_PATH, overrides + [f"precompute.output_dir={root / 'prepared'}"])
    with pytest.raises(UserError, match=r"holds the output of mtp-train prepare \(prepared\)"):
        run_precompute(recipe, force=True)
    assert output_kind(root / "prepared") == "prepared"

    features = tmp_path / "features"
    recipe = load_recipe(RECIPE_PATH, overrides + [f"precompute.output_dir={features}"])
    run_precompute(recipe)
    assert output_kind(features) == "features"
    (features / "leftover.txt").write_text("gone with --force")
    run_precompute(recipe, force=True)  # ours: deleted and computed again
    assert output_kind(features) == "features" and not (features / "leftover.txt").exists()


def test_export_overwrite_never_deletes_other_exports(target_dir, tmp_path):
    """`--out exports --overwrite`, where exports/ holds other exports (each marked, the folder above not)."""
    from mtp_train.heads import DraftHead, HeadConfig, save_head
    from mtp_train.runtime.loader import load_model

    target = load_model(target_dir, dtype="float32", device="cpu")
    head = DraftHead.from_target(target, HeadConfig.for_target(target.config, kind="mtp", init="last_layer"))
    head_dir = save_head(head, tmp_path / "head")
    exports = tmp_path / "exports"
    first = export_head(head_dir, "native", exports / "first", target_dir)
    with pytest.raises(UserError, match=r"--out .*exports: not empty and not written by mtp-train export"):
        export_head(head_dir, "native", exports, target_dir, overwrite=True)
    assert output_kind(first) == "export" and (first / "model.safetensors").is_file()
    export_head(head_dir, "native", first, target_dir, overwrite=True)  # one export replaced by another: allowed
    assert output_kind(first) == "export"
    # item 8 for exports: a replace killed between its renames; the next reader (inspect, load) restores the old one
    first.rename(exports / f".first.old-{_dead_pid()}")
    assert not inspect_dir(first).problems and output_kind(first) == "export"


# ---- item 4: a resumed or finished precompute never mixes compute dtypes --------------------------------------------


@pytest.mark.parametrize("finished", [False, True], ids=["resumed", "finished"])
def test_precompute_refuses_another_compute_dtype(pipeline, tmp_path, finished):
    overrides, _ = pipeline
    features = tmp_path / "features"
    # keys and values rounded to bf16 either way, so only the compute dtype differs between the two runs
    overrides = overrides + [f"precompute.output_dir={features}", "precision.kv_cache=bfloat16"]
    recipe = load_recipe(RECIPE_PATH, overrides)
    run_precompute(recipe)
    if not finished:
        (features / "manifest.json").unlink()  # interrupted before the manifest: the progress files remain
    bf16 = load_recipe(RECIPE_PATH, overrides + ["precision.compute=bfloat16"])
    with pytest.raises(UserError, match="existing cache has target_dtype='float32', this run 'bfloat16'"):
        run_precompute(bf16)
    run_precompute(bf16, force=True)  # ours to start over
    assert load_manifest(features)["target_dtype"] == "bfloat16"


# ---- item 6: token ids and stored values checked where they enter ---------------------------------------------------


def test_precompute_names_a_token_id_outside_the_targets_vocabulary(pipeline, tmp_path):
    """A target whose embedding is one row short of its tokenizer (the added tokens' last id has no row): named by
    split, sample and id before anything is computed, instead of an IndexError in the first forward."""
    from tests.tiny_models import save_tiny_model

    from mtp_train.data.prepared import load_prepared

    overrides, root = pipeline
    target = Path(load_recipe(RECIPE_PATH, overrides).target.path)
    prepared = load_prepared(root / "prepared")
    highest = max(max(ids) for split in (prepared.train, prepared.eval) for ids in split["input_ids"])
    short = save_tiny_model(tmp_path / "short-target", "llama", vocab_size=highest)  # no row for the highest id
    for path in target.iterdir():  # the same tokenizer and chat template
        if path.name not in ("config.json", "model.safetensors", "generation_config.json"):
            shutil.copy(path, short / path.name)
    features = tmp_path / "features"
    recipe = load_recipe(RECIPE_PATH, overrides + [f"target.path={short}", f"precompute.output_dir={features}"])
    with pytest.raises(UserError, match=rf"prepared/(train|eval): sample \d+ \(source '.*'\) holds token id "
                                        rf"{highest}, outside the target's vocabulary \(vocab_size {highest} in "):
        run_precompute(recipe)
    assert not features.exists()


def test_precompute_stores_no_nan_states(pipeline, tmp_path):
    from safetensors.torch import load_file, save_file

    overrides, _ = pipeline
    target = Path(load_recipe(RECIPE_PATH, overrides).target.path)
    broken = tmp_path / "nan-target"
    shutil.copytree(target, broken)
    weights = load_file(broken / "model.safetensors")
    weights["model.norm.weight"][0] = float("nan")  # a damaged checkpoint
    save_file(weights, broken / "model.safetensors")
    features = tmp_path / "features"
    recipe = load_recipe(RECIPE_PATH, overrides + [f"target.path={broken}", f"precompute.output_dir={features}"])
    with pytest.raises(UserError, match=r"hidden states are NaN or infinite for sample\(s\) \d+.*nothing of that "
                                        r"batch was stored"):
        run_precompute(recipe)
    assert not list(features.glob("*/shard-*.safetensors"))


# ---- item 8: a replace interrupted between its two renames is undone --------------------------------------------------


def _dead_pid() -> int:
    import subprocess

    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_a_prepared_dataset_retired_by_an_interrupted_replace_is_restored(pipeline, tmp_path):
    """A kill after `replace_directory` moved the old output aside and before it moved the new one in: the output's
    name is gone and the old copy hidden. The next reader (and the next writer) renames it back."""
    from mtp_train.data.prepared import load_prepared

    _, root = pipeline
    prepared = tmp_path / "prepared"
    shutil.copytree(root / "prepared", prepared)
    hidden = tmp_path / f".prepared.old-{_dead_pid()}"
    prepared.rename(hidden)
    assert len(load_prepared(prepared).train) > 0  # restored under its name
    assert prepared.is_dir() and not hidden.exists()


def test_a_copy_left_after_the_second_rename_is_removed_and_a_live_one_kept(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "new.txt").write_text("new")
    stale = tmp_path / f".out.old-{_dead_pid()}"
    stale.mkdir()
    live = tmp_path / f".out.old-{os.getpid()}"  # a replace in progress in a live process: not ours to touch
    live.mkdir()
    recover_replaced_directory(target)
    assert (target / "new.txt").read_text() == "new" and not stale.exists() and live.exists()


# ---- item 5: one writer per output --------------------------------------------------------------------------------


def _held(path: Path, what: str) -> OutputLock:
    """The lock of `path` held as another run of `what` would hold it."""
    return OutputLock(path, lambda who: f"held by {who}", label=what).acquire()


def test_a_second_prepare_of_one_output_stops_naming_the_first(pipeline):
    """Two `prepare --force` at once shared one staging directory."""
    overrides, root = pipeline
    recipe = load_recipe(RECIPE_PATH, overrides)
    before = sorted(p.name for p in (root / "prepared").iterdir())
    lock = _held(sibling_lock_path(root / "prepared"), "prepare")
    try:
        with pytest.raises(UserError, match=rf"another prepare \(pid {os.getpid()} on host .*, `python -m pytest"):
            prepare_dataset(recipe, force=True, show_progress=False)
    finally:
        lock.release()
    assert sorted(p.name for p in (root / "prepared").iterdir()) == before
    assert not (root / ".prepared.work").exists()


def test_a_second_precompute_of_one_cache_stops_before_touching_it(pipeline, tmp_path):
    """A precompute's start-up cleanup removed another live precompute's temporary files; `--force` deleted its
    cache under it."""
    overrides, _ = pipeline
    features = tmp_path / "features"
    recipe = load_recipe(RECIPE_PATH, overrides + [f"precompute.output_dir={features}"])
    run_precompute(recipe)
    (features / "train" / ".shard-r0-000009.tmp-1").write_bytes(b"a live run's shard in progress")
    lock = _held(sibling_lock_path(features), "precompute")
    try:
        for force in (False, True):
            with pytest.raises(UserError, match=r"another precompute \(pid \d+ on host .*\) is writing this cache"):
                run_precompute(recipe, force=force)
    finally:
        lock.release()
    assert (features / "train" / ".shard-r0-000009.tmp-1").is_file() and (features / "manifest.json").is_file()


def test_eval_does_not_log_into_a_run_that_is_training(tmp_path):
    """`eval` appended its results to the metrics of a run whose trainer was still writing them."""
    from mtp_train.commands.eval import run_evaluation
    from mtp_train.train.checkpoints import RunDirLock

    run_dir = tmp_path / "run"
    with RunDirLock(run_dir):  # the trainer
        with pytest.raises(UserError, match=r"another process is using this run dir .*eval would log into its "
                                            r"metrics.jsonl"):
            run_evaluation(None, head_dir=None, draft_dir=None, prompts_path=None, limit=None, ks=[1],
                           max_new_tokens=1, out_dir=tmp_path / "eval", log_run_dir=run_dir)
    assert not (run_dir / "metrics.jsonl").exists() and not (tmp_path / "eval").exists()


def test_the_tokenizer_fingerprint_covers_what_changes_the_ids(pipeline, tmp_path):
    """tokenizer_config.json (added tokens and their ids, bos/eos insertion) and added_tokens.json change which ids a
    text becomes; before, the fingerprint left both out, so data tokenized otherwise passed as the same tokenizer.
    Where the files were, and the padding side, do not change it."""
    import json

    from mtp_train.data.prepared import tokenizer_hash

    overrides, _ = pipeline
    target = Path(load_recipe(RECIPE_PATH, overrides).target.path)

    def variant(name: str, edit=None, added: dict | None = None) -> str:
        copy = tmp_path / name
        shutil.copytree(target, copy)
        config = json.loads((copy / "tokenizer_config.json").read_text())
        if edit:
            edit(config)
        (copy / "tokenizer_config.json").write_text(json.dumps(config))
        if added is not None:
            (copy / "added_tokens.json").write_text(json.dumps(added))
        return tokenizer_hash(copy, "template")

    same = variant("same")
    assert variant("moved", lambda c: c.update(name_or_path="/elsewhere", model_max_length=4096,
                                               padding_side="left")) == same
    assert variant("bos", lambda c: c.update(add_bos_token=not c.get("add_bos_token", False))) != same
    assert variant("added", added={"<|tool|>": 9999}) != same
