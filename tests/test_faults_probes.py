"""Probes of issue 44 that found a problem, kept as tests (the whole list, with what happens now: docs/faults.md).

- A full disk in `prepare` (inside `datasets`' writer) and in `eval` (matplotlib saving a plot) was a traceback
  naming no file; a read-only run directory was a traceback at the trainer's lock. Each is now one line naming the
  directory, the reason and what to do (exit 2), with nothing half-written left under an output's name.
- Data prepared by a version whose tokenizer fingerprint was computed otherwise was refused as "tokenized by another
  tokenizer" naming the same directory twice; it is now refused as an older prepared format.
- An output on a file system without locks (NFS without a lock service) said only "cannot take the lock ([Errno
  37] No locks available)"; it now says what the file system lacks and where to put the output instead.
"""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from mtp_train.cli import main
from mtp_train.errors import UserError
from mtp_train.fileio import file_system_error
from tests.pipeline_fixtures import RECIPE_PATH, tiny_pipeline


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults-probes")
    _, overrides = tiny_pipeline(root, num_conversations=16)
    return root, overrides


def _cli(stage: str, overrides: list[str], *extra: str) -> int:
    return main([stage, "--recipe", str(RECIPE_PATH), *(a for o in overrides for a in ("--set", o)), *extra])


def test_a_full_disk_in_prepare_is_one_line_naming_where(pipeline, tmp_path, monkeypatch, capsys):
    import mtp_train.data.prepare as prepare

    root, overrides = pipeline

    def full(*args, **kwargs):  # what `datasets` raised: ENOSPC with no file name
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(prepare, "_write_splits", full)
    out = tmp_path / "prepared"
    assert _cli("prepare", overrides, "--set", f"data.output_dir={out}") == 2
    err = capsys.readouterr().err
    assert f"mtp-train prepare: error: {tmp_path / '.prepared.work'}: No space left on device; the disk is full" in err
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == [".prepared.lock"]  # no output, no work directory


def test_a_full_disk_in_eval_names_the_report_directory(pipeline, tmp_path, monkeypatch):
    import torch

    import mtp_train.evaluate.evaluation as evaluation
    from mtp_train.commands.eval import run_evaluation
    from mtp_train.heads import DraftHead, HeadConfig, save_head
    from mtp_train.recipe import load_recipe
    from mtp_train.runtime.loader import load_model

    root, overrides = pipeline
    recipe = load_recipe(RECIPE_PATH, overrides)
    target = load_model(recipe.target.path, dtype="float32", device="cpu")
    torch.manual_seed(0)
    save_head(DraftHead.from_target(target, HeadConfig.for_target(target.config, target.fingerprint, kind="mtp")),
              tmp_path / "head")

    def full(*args, **kwargs):  # what matplotlib raised: ENOSPC with no file name
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(evaluation, "write_plots", full)  # where the eval calls it
    with pytest.raises(OSError) as raised:
        run_evaluation(recipe, tmp_path / "head", None, None, 1, [1], 4, tmp_path / "eval", show_progress=False)
    assert raised.value.filename == str(tmp_path / "eval")
    assert file_system_error(raised.value).startswith(f"{tmp_path / 'eval'}: No space left on device; the disk is "
                                                      "full")


@pytest.mark.parametrize("code, advice", [(errno.EROFS, "the file system is read-only"),
                                          (errno.EACCES, "no permission"), (errno.EDQUOT, "quota")])
def test_a_refusing_file_system_is_one_line_in_every_stage(pipeline, tmp_path, monkeypatch, capsys, code, advice):
    """A read-only run directory: the trainer's lock is the first thing it writes."""
    from mtp_train.fileio import OutputLock

    _, overrides = pipeline
    run_dir = tmp_path / "run"

    def refused(self):
        raise OSError(code, __import__("os").strerror(code), str(self.path))

    monkeypatch.setattr(OutputLock, "acquire", refused)
    assert _cli("train", overrides, "--set", f"train.run_dir={run_dir}") == 2
    err = capsys.readouterr().err
    assert f"mtp-train train: error: {run_dir / '.lock'}: " in err and advice in err and "Traceback" not in err


def test_a_file_system_without_locks_is_named_with_what_to_do(pipeline, tmp_path, monkeypatch, capsys):
    """An NFS mount without a lock service: flock fails with ENOLCK (was "cannot take the lock ([Errno 37] ...)")."""
    import fcntl

    _, overrides = pipeline
    run_dir = tmp_path / "run"

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, __import__("os").strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    assert _cli("train", overrides, "--set", f"train.run_dir={run_dir}") == 2
    err = capsys.readouterr().err
    assert f"{run_dir / '.lock'}: cannot take the lock: this file system offers no locks" in err
    assert "local disk" in err and "Traceback" not in err


def test_a_bug_stays_a_traceback():
    assert file_system_error(OSError(errno.EBADF, "Bad file descriptor")) is None
    assert file_system_error(ValueError("not a file system error")) is None


def test_data_prepared_with_the_older_tokenizer_fingerprint_is_refused_as_such(pipeline):
    from mtp_train.data.prepared import load_prepared

    root, _ = pipeline
    fingerprint = root / "prepared" / "fingerprint.json"
    saved = fingerprint.read_text()
    try:
        fingerprint.write_text(json.dumps({**json.loads(saved), "format_version": 1}))
        with pytest.raises(UserError, match=r"format_version 1, expected 2 \(prepared by another version of "
                                            r"mtp_train\); re-run `mtp-train prepare --force`"):
            load_prepared(root / "prepared")
    finally:
        fingerprint.write_text(saved)
