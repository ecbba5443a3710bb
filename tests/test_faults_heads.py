"""Faults of heads and exports (issue 14, items 4 and 6): a corrupted head is refused by its checksum and by its
NaN/Inf weights wherever it is read (generate --head, export, inspect, load_any_head); an old head without a checksum
still loads, with a note; a full disk, a read-only directory or a mount point under `export --out` is a named message,
and no half-written export is left under the name."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import mtp_train.export.common as export_common
from mtp_train.errors import UserError
from mtp_train.export import export_head, inspect_dir, load_any_head
from mtp_train.heads import DraftHead, HeadConfig, load_head, save_head
from mtp_train.runtime.loader import load_model
from tests.export_helpers import run_cli
from tests.pipeline_fixtures import make_tiny_target

CORRUPT_BYTES = 4096  # the corruption: 4,096 bytes of 0xFF in the middle of model.safetensors


def make_head(target, kind: str = "mtp", fingerprint: bool = True) -> DraftHead:
    """A one-layer random head of `target`, recording its fingerprint unless `fingerprint` is False (then any target
    of the same shape passes the fingerprint check, e.g. a copy with edited weights)."""
    torch.manual_seed(0)
    config = HeadConfig.for_target(target.config, target.fingerprint if fingerprint else None, kind=kind,
                                   num_layers=1, init="random")
    return DraftHead.from_target(target, config)


def corrupt_middle(path: Path) -> None:
    """Set CORRUPT_BYTES bytes in the middle of `path` to 0xFF (in a bfloat16 file: CORRUPT_BYTES / 2 NaN weights)."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + CORRUPT_BYTES] = b"\xff" * CORRUPT_BYTES
    path.write_bytes(bytes(data))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def leftovers(directory: Path) -> list[str]:
    """Temporary or retired directories/files an interrupted write would leave next to an export."""
    return sorted(p.name for p in directory.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory):
    """(directory, loaded float32 CPU model) of a tiny Llama with a ChatML tokenizer, so `generate` can run on it."""
    directory = make_tiny_target(tmp_path_factory.mktemp("chat_target"), seed=5)
    return directory, load_model(directory, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def good_head(chat_target, tmp_path_factory) -> Path:
    """A one-layer MTP head of `chat_target`, saved by save_head in bfloat16 (as the trainer stores heads)."""
    return save_head(make_head(chat_target[1]), tmp_path_factory.mktemp("heads") / "good", dtype=torch.bfloat16)


# ---- item 4: a corrupted head --------------------------------------------------------------------------------------


def test_save_head_records_the_weights_checksum(good_head):
    config = json.loads((good_head / "head_config.json").read_text())
    assert config["weights_sha256"] == sha256(good_head / "model.safetensors")


def test_corrupted_head_is_refused_by_generate_export_and_load(chat_target, good_head, tmp_path, capsys):
    """The issue's reproduction: 0xFF bytes in the middle of a head's model.safetensors. generate --head used it
    (alpha 0.0), export wrote it; now each refuses it, naming the file, the checksum and the NaN tensors."""
    target_dir, target = chat_target
    bad = tmp_path / "bad"
    shutil.copytree(good_head, bad)
    corrupt_middle(bad / "model.safetensors")
    weights = str(bad / "model.safetensors")

    with pytest.raises(UserError) as caught:
        load_head(bad, target)
    message = str(caught.value)
    assert message.startswith(f"{weights}: checksum mismatch")
    assert "head_config.json recorded" in message
    assert f"it now holds {CORRUPT_BYTES // 2} NaN/Inf value(s)" in message and "NaN)" in message

    generate = ["generate", "--target", str(target_dir), "--head", str(bad), "--prompt", "hello", "--device", "cpu",
                "--max-new-tokens", "4", "--json"]
    assert run_cli(generate) == 2
    err = capsys.readouterr().err
    assert f"{weights}: checksum mismatch" in err and "Traceback" not in err

    out = tmp_path / "export"
    assert run_cli(["export", "--head", str(bad), "--format", "native", "--target", str(target_dir),
                    "--out", str(out)]) == 2
    assert f"{weights}: checksum mismatch" in capsys.readouterr().err
    assert not out.exists() and leftovers(tmp_path) == []


def test_head_without_checksum_is_refused(chat_target, good_head, tmp_path):
    """A head_config.json without weights_sha256 (saved by an older mtp-train): refused, naming the file and what
    to do, not loaded unverified."""
    old = tmp_path / "old"
    shutil.copytree(good_head, old)
    config = json.loads((old / "head_config.json").read_text())
    del config["weights_sha256"]
    (old / "head_config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=r"head_config\.json: no weights_sha256: a head saved by an older mtp-train "
                                        r".*train it again"):
        load_head(old, chat_target[1])


def test_nonfinite_weights_are_refused_by_name_and_count(chat_target, good_head, tmp_path):
    """Without a checksum to catch it (NaN written at save), NaN/Inf weights are refused: every tensor named with
    its count."""
    state = load_file(good_head / "model.safetensors")
    state["layers.0.mlp.up_proj.weight"][0, :3] = float("nan")
    state["norm.weight"][:2] = float("inf")
    state["norm.weight"][2] = float("-inf")
    bad = tmp_path / "nan"
    shutil.copytree(good_head, bad)
    save_file(state, bad / "model.safetensors")
    config = json.loads((bad / "head_config.json").read_text())
    config["weights_sha256"] = sha256(bad / "model.safetensors")  # a head saved with these values
    (bad / "head_config.json").write_text(json.dumps(config))
    with pytest.raises(UserError) as caught:
        load_head(bad, chat_target[1])
    message = str(caught.value)
    assert message.startswith(f"{bad / 'model.safetensors'}: 6 NaN/Inf value(s) in 2 tensor(s)")
    assert "layers.0.mlp.up_proj.weight (3 NaN)" in message and "norm.weight (3 Inf)" in message
    with pytest.raises(UserError, match=r"layers\.0\.mlp\.up_proj\.weight \(3 NaN\)"):
        export_head(bad, "native", tmp_path / "out", chat_target[0])
    assert not (tmp_path / "out").exists()


def test_structural_errors_still_come_first(chat_target, good_head, tmp_path):
    """A file rewritten with a wrong tensor set: the structural message (more specific) rather than the checksum."""
    state = load_file(good_head / "model.safetensors")
    del state["norm.weight"]
    bad = tmp_path / "missing"
    shutil.copytree(good_head, bad)
    save_file(state, bad / "model.safetensors")
    with pytest.raises(UserError, match=r"missing norm\.weight"):
        load_head(bad, chat_target[1])


# ---- item 4: exports carry checksums; inspect checks them ----------------------------------------------------------


@pytest.mark.parametrize("fmt", ["native", "deepseek-mtp"])
def test_export_records_checksums_and_inspect_checks_them(chat_target, good_head, tmp_path, capsys, fmt):
    target_dir, target = chat_target
    out = export_head(good_head, fmt, tmp_path / fmt, target_dir)
    config = json.loads((out / "config.json").read_text())
    recorded = config["mtp_train"]["checksums"]
    files = sorted(p.name for p in out.iterdir() if p.name not in ("config.json", ".mtp_train-output.json"))
    assert sorted(recorded) == files
    assert all(recorded[name] == sha256(out / name) for name in files)
    report = inspect_dir(out, target)
    assert report.ok and report.checksum.startswith("checksum ok"), report.all_problems
    assert run_cli(["inspect", str(out)]) == 0
    assert "checksum ok (sha256 of " in capsys.readouterr().out
    if fmt == "native":  # loadable by heads.load_head as is, its head_config.json carrying the weights' checksum
        assert json.loads((out / "head_config.json").read_text())["weights_sha256"] == recorded["model.safetensors"]
        load_head(out, target)

    corrupt_middle(out / "model.safetensors")
    assert run_cli(["inspect", str(out)]) == 1
    printed = capsys.readouterr().out
    assert f"{out / 'model.safetensors'}: checksum mismatch" in printed
    assert f"{CORRUPT_BYTES // 2} NaN/Inf value(s)" in printed
    with pytest.raises(UserError, match="checksum mismatch"):
        load_any_head(out, target)


def test_inspect_names_a_changed_side_file_and_notes_a_missing_record(chat_target, good_head, tmp_path, capsys):
    target_dir, _ = chat_target
    out = export_head(good_head, "native", tmp_path / "native", target_dir)
    head_config = json.loads((out / "head_config.json").read_text())
    (out / "head_config.json").write_text(json.dumps(head_config, indent=4))  # same content, other bytes
    report = inspect_dir(out)
    assert [p for p in report.integrity if "checksum mismatch" in p] == [
        p for p in report.integrity if p.startswith(f"{out / 'head_config.json'}: checksum mismatch")
    ] != []

    config = json.loads((out / "config.json").read_text())
    del config["mtp_train"]["checksums"]  # an export written before exports carried checksums: refused
    (out / "config.json").write_text(json.dumps(config))
    report = inspect_dir(out)
    assert not report.ok and report.integrity == [
        f"{out / 'config.json'} mtp_train.checksums: absent: an export written by an older mtp-train (before exports "
        "carried checksums); export the head again"]


def test_export_refuses_nonfinite_tensors_it_reads_or_writes(chat_target, good_head, tmp_path):
    """Everything export reads is checked: the target's frozen tensors (deepseek-mtp stores them), and the tensors
    it writes (a cast to float16 can overflow to Inf)."""
    target_dir, target = chat_target
    broken_target = tmp_path / "target"
    shutil.copytree(target_dir, broken_target)
    weights = load_file(target_dir / "model.safetensors")
    weights["model.embed_tokens.weight"][1, 0] = float("nan")
    save_file(weights, broken_target / "model.safetensors", metadata={"format": "pt"})
    unbound = save_head(make_head(target, fingerprint=False), tmp_path / "unbound")
    with pytest.raises(UserError, match=r"\(target weights\): 1 NaN/Inf value\(s\) in 1 tensor\(s\): "
                                        r"model\.embed_tokens\.weight \(1 NaN\)"):
        export_head(unbound, "deepseek-mtp", tmp_path / "ds", broken_target)

    head = make_head(target)
    with torch.no_grad():
        head.norm.weight[0] = 1e6  # beyond float16's range
    big = save_head(head, tmp_path / "big")
    with pytest.raises(UserError, match=r"in float16: 1 NaN/Inf value\(s\) in 1 tensor\(s\): norm\.weight \(1 Inf\)"):
        export_head(big, "native", tmp_path / "f16", target_dir, dtype="float16")
    assert leftovers(tmp_path) == [] and not (tmp_path / "f16").exists()


# ---- item 6: disk full, read-only directory, mount point -----------------------------------------------------------


def test_disk_full_during_export_is_named_and_leaves_the_old_export(chat_target, good_head, tmp_path, monkeypatch):
    target_dir, _ = chat_target
    out = export_head(good_head, "native", tmp_path / "out", target_dir)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    written = []

    def full_disk(path: Path, data: bytes) -> None:
        if written:  # the second file hits the full disk
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written.append(path.name)
        path.write_bytes(data)

    monkeypatch.setattr(export_common, "_write_file", full_disk)
    with pytest.raises(UserError) as caught:
        export_head(good_head, "native", out, target_dir, overwrite=True)
    message = str(caught.value)
    assert message.startswith(f"--out {out}: export not written: No space left on device")
    assert "free space" in message and "rerun the same command" in message
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the previous export, untouched
    assert leftovers(tmp_path) == []  # the half-written staging directory is gone


def test_read_only_file_system_is_named(chat_target, good_head, tmp_path, monkeypatch, capsys):
    """EROFS (a read-only mount; simulated so it also runs as root) through the CLI: one line, no traceback."""
    target_dir, _ = chat_target

    def read_only(path: Path, data: bytes) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(export_common, "_write_file", read_only)
    out = tmp_path / "out"
    argv = ["export", "--head", str(good_head), "--format", "native", "--target", str(target_dir), "--out", str(out)]
    assert run_cli(argv) == 2
    err = capsys.readouterr().err
    assert f"--out {out}: export not written: Read-only file system" in err
    assert "choose a directory on a writable file system" in err and "Traceback" not in err
    assert not out.exists() and leftovers(tmp_path) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_directory_is_named(chat_target, good_head, tmp_path):
    target_dir, _ = chat_target
    parent = tmp_path / "locked"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        with pytest.raises(UserError, match=rf"--out {parent / 'out'}: export not written: Permission denied.*"
                                            "choose a directory you can write to"):
            export_head(good_head, "native", parent / "out", target_dir)
        assert list(parent.iterdir()) == []
    finally:
        parent.chmod(0o755)


def test_mount_point_out_is_refused_before_writing(chat_target, good_head, tmp_path, monkeypatch):
    target_dir, _ = chat_target
    out = tmp_path / "mnt"
    out.mkdir()
    real_ismount = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda path: Path(path) == out or real_ismount(path))
    with pytest.raises(UserError, match=rf"--out {out}: is a mount point.*--out {out / 'head-export'}"):
        export_head(good_head, "native", out, target_dir)
    assert list(out.iterdir()) == [] and leftovers(tmp_path) == []


def test_rename_refused_as_busy_is_named(chat_target, good_head, tmp_path, monkeypatch):
    """A directory the OS will not rename (EBUSY: a mount point not recognized as one, e.g. a bind mount of a
    directory): named, the staged export removed, the old one kept."""
    target_dir, _ = chat_target
    out = export_head(good_head, "native", tmp_path / "out", target_dir)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real_replace = os.replace

    def busy(src, dst):
        if Path(src) == out:
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(src))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", busy)
    with pytest.raises(UserError, match=rf"--out {out}: export not written: Device or resource busy.*mount point"):
        export_head(good_head, "native", out, target_dir, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert leftovers(tmp_path) == []
