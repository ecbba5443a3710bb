"""Errors instead of tracebacks for damaged files (issue 44, item 7): bytes that are not UTF-8 in a model's
`config.json`, its `model.safetensors.index.json` and the recipe are UserErrors naming the file; a damaged precision
probe cache is measured again; a torn last line of a run's `metrics.jsonl` (a kill while it was appended) no longer
breaks resume or eval, and any other bad line is named by file and line. Before the fix each was a
UnicodeDecodeError or JSONDecodeError traceback."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mtp_train.errors import UserError
from mtp_train.recipe import load_recipe
from mtp_train.runtime.config import load_config
from mtp_train.runtime.loader import load_model
from mtp_train.train.tracking import read_metric_rows, truncate_metrics

NOT_UTF8 = b"\xff\xfe caf\xe9"


def _model_copy(target_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "model"
    shutil.copytree(target_dir, copy)
    return copy


def test_a_config_json_that_is_not_utf8_is_named(target_dir, tmp_path):
    model = _model_copy(target_dir, tmp_path)
    config = model / "config.json"
    config.write_bytes(config.read_bytes().replace(b'"llama"', b'"llama' + NOT_UTF8 + b'"', 1))
    with pytest.raises(UserError, match=rf"^{config}: unreadable \(.*codec can't decode"):
        load_config(model)


def test_a_weights_index_that_is_not_utf8_is_named(target_dir, tmp_path):
    model = _model_copy(target_dir, tmp_path)
    index = model / "model.safetensors.index.json"
    index.write_bytes(b'{"weight_map": {"' + NOT_UTF8 + b'": "model.safetensors"}}')
    with pytest.raises(UserError, match=rf"^{index} \(the sharded weights' index\): unreadable"):
        load_model(model, dtype="float32", device="cpu")


def test_a_recipe_that_is_not_utf8_is_named(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_bytes(b"name: caf" + NOT_UTF8 + b"\n")
    with pytest.raises(UserError, match=rf"^{recipe}: not UTF-8 text \(byte 0xff at offset 9\); save the recipe as"):
        load_recipe(recipe)


def test_a_damaged_probe_cache_is_measured_again(tmp_path, monkeypatch):
    from mtp_train.runtime.hardware import CpuFacts
    from mtp_train.runtime.precision import _cache_path, decode_probe

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    facts = CpuFacts("AMD EPYC (Zen 3)", "x86_64", frozenset({"avx2", "fma", "f16c"}), "AVX2", 2)
    timing = {1: {"float32": 2.0, "bfloat16": 1.0}}
    for damaged in (NOT_UTF8, b'{"torn": ', b"[1, 2]"):
        _cache_path().parent.mkdir(parents=True, exist_ok=True)
        _cache_path().write_bytes(damaged)
        assert decode_probe(facts, timer=lambda: timing) == timing
        assert decode_probe(facts, timer=lambda: pytest.fail("measured twice")) == timing  # cached now


def _metrics(path: Path, tail: bytes) -> Path:
    rows = b"".join(json.dumps({"step": step, "loss": 1.0 / step, "tokens": 10}).encode() + b"\n"
                    for step in (1, 2, 3))
    path.write_bytes(rows + tail)
    return path


@pytest.mark.parametrize("tail", [b'{"step": 4, "lo', b'{"step": 4, "loss": 0.2' + NOT_UTF8, b"\x00\x00\x00"],
                         ids=["torn", "torn-mid-character", "zero-filled"])
def test_a_torn_last_metrics_line_is_dropped(tmp_path, tail):
    metrics = _metrics(tmp_path / "metrics.jsonl", tail)
    assert [row["step"] for row in read_metric_rows(metrics)] == [1, 2, 3]
    truncate_metrics(metrics, after_step=2)  # what resume does: the rows after the checkpoint and the torn line go
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2]


def test_a_bad_metrics_line_before_the_last_is_named(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(UserError, match=rf"^{metrics}:2: not a metrics row"):
        read_metric_rows(metrics)
