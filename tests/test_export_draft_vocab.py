"""Export of heads with a reduced draft vocabulary (d2t/t2d): what each format writes, exact round trips, the formats
whose loaders have no draft vocabulary (written over the full vocabulary), and inspect's consistency checks."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mtp_train.errors import UserError
from mtp_train.export import export_head, inspect_dir, load_any_head
from mtp_train.fileio import OUTPUT_MARKER
from mtp_train.heads import DraftHead, HeadConfig, load_head, save_head
from tests.export_helpers import EXPECTED, draft_logits, edited_copy, read_config, run_cli

V = 96  # the tiny target's vocabulary
DRAFT_IDS = torch.tensor([0, 1, 2, 5, 9, 17, 40, 41, 63, 80, 94, 95])  # both ends of the vocabulary, gaps and runs
N = DRAFT_IDS.numel()
TOKEN_MAP = "speculative_token_map.pt"

# Format -> the head kinds it carries a draft vocabulary for; the others refuse.
CARRIED = [("native", "mtp"), ("native", "eagle1"), ("eagle", "eagle1")]


def make_reduced_head(target, kind: str, dtype=torch.float32, draft_ids=DRAFT_IDS, num_layers: int = 1) -> DraftHead:
    """A random-init head over `draft_ids`, norms and biases perturbed away from 1/0 so a mix-up shows (an eagle1
    head without an fc bias: the one the eagle format writes)."""
    torch.manual_seed(0)
    config = HeadConfig.for_target(
        target.config, target.fingerprint, kind=kind, num_layers=num_layers, init="random",
        draft_vocab_size=draft_ids.numel(), **({"fc_bias": False} if kind == "eagle1" else {}),
    )
    head = DraftHead.from_target(target, config)
    head.set_draft_vocab(draft_ids)
    with torch.no_grad():
        for name, param in head.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
    return head.to(dtype)


@pytest.fixture(scope="module")
def heads(target):
    return {kind: make_reduced_head(target, kind) for kind in ("mtp", "eagle1")}


@pytest.fixture(scope="module")
def head_dirs(heads, tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    return {kind: save_head(head, root / kind) for kind, head in heads.items()}


@pytest.fixture(scope="module")
def exports(head_dirs, target_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("exports")
    return {(fmt, kind): export_head(head_dirs[kind], fmt, root / f"{fmt}-{kind}", target_dir) for fmt, kind in CARRIED}


def layout(directory: Path) -> dict:
    """name -> (shape, dtype) of model.safetensors."""
    return {k: (tuple(v.shape), v.dtype) for k, v in load_file(directory / "model.safetensors").items()}


# ---- what each format writes --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["mtp", "eagle1"])
def test_native_writes_d2t_and_t2d(exports, kind):
    directory = exports[("native", kind)]
    expected = {name: (shape, torch.float32) for name, shape in EXPECTED[("native", kind)].items()}
    expected["d2t"] = ((N,), torch.int64)
    expected["t2d"] = ((V,), torch.bool)
    assert layout(directory) == expected
    tensors = load_file(directory / "model.safetensors")
    # The EAGLE-3 convention: target id = i + d2t[i]; t2d marks exactly those ids.
    assert torch.equal(tensors["d2t"], DRAFT_IDS - torch.arange(N))
    assert torch.equal(torch.arange(N) + tensors["d2t"], DRAFT_IDS)
    assert torch.equal(tensors["t2d"].nonzero().flatten(), DRAFT_IDS)
    assert sorted(p.name for p in directory.iterdir()) == [OUTPUT_MARKER, "config.json", "head_config.json",
                                                            "model.safetensors"]
    config = read_config(directory)
    assert config["draft_vocab_size"] == N and config["vocab_size"] == V
    assert config["torch_dtype"] == "float32"  # the floating-point tensors; d2t/t2d keep int64/bool
    assert config["mtp_train"]["head_config"]["draft_vocab_size"] == N
    assert json.loads((directory / "head_config.json").read_text())["draft_vocab_size"] == N


def test_eagle_writes_sglang_token_map(exports):
    directory = exports[("eagle", "eagle1")]
    # The checkpoint is the plain EAGLE-1 tensor set: SGLang's EAGLE-1 loaders read no d2t/t2d (Qwen2's would fail).
    expected = {name: (shape, torch.float32) for name, shape in EXPECTED[("eagle", "eagle1")].items()}
    assert layout(directory) == expected
    assert sorted(p.name for p in directory.iterdir()) == [OUTPUT_MARKER, "config.json", "model.safetensors",
                                                            TOKEN_MAP]
    # What SGLang's load_token_map does with --speculative-token-map: torch.load(weights_only=True) -> torch.tensor.
    loaded = torch.load(directory / TOKEN_MAP, weights_only=True)
    assert loaded == DRAFT_IDS.tolist() and all(type(i) is int for i in loaded)
    assert torch.equal(torch.tensor(loaded, dtype=torch.int64), DRAFT_IDS)
    config = read_config(directory)
    assert config["draft_vocab_size"] == N
    assert "hot_vocab_size" not in config  # SGLang's worker sets it from the token map itself
    block = config["mtp_train"]
    assert block["head_config"]["draft_vocab_size"] == N
    assert block["speculative_token_map"] == TOKEN_MAP
    assert f"--speculative-token-map <this dir>/{TOKEN_MAP}" in block["engine_support"]


def test_full_vocabulary_exports_carry_no_draft_vocabulary(target, target_dir, tmp_path):
    torch.manual_seed(0)
    config = HeadConfig.for_target(target.config, target.fingerprint, kind="eagle1", init="random")
    save_head(DraftHead.from_target(target, config), tmp_path / "head")
    for fmt in ("native", "eagle"):
        out = export_head(tmp_path / "head", fmt, tmp_path / fmt, target_dir)
        assert "draft_vocab_size" not in read_config(out)
        assert read_config(out)["mtp_train"]["head_config"]["draft_vocab_size"] is None
        assert not {"d2t", "t2d"} & set(layout(out))
        assert not (out / TOKEN_MAP).exists()
        assert "speculative_token_map" not in read_config(out)["mtp_train"]


# ---- round trips --------------------------------------------------------------------------------------------------


def assert_same_head(loaded: DraftHead, original: DraftHead) -> None:
    assert loaded.kind == original.kind and loaded.dtype == original.dtype
    assert loaded.head_config == original.head_config
    assert torch.equal(loaded.draft_ids, original.draft_ids)
    assert loaded.d2t.dtype == torch.int64 and loaded.t2d.dtype == torch.bool
    assert loaded.state_dict().keys() == original.state_dict().keys()
    for key, value in original.state_dict().items():
        got = loaded.state_dict()[key]
        assert got.dtype == value.dtype and torch.equal(got, value), key
    logits = draft_logits(loaded)
    assert logits.shape == (12, original.draft_vocab_size)
    assert torch.equal(logits, draft_logits(original))


@pytest.mark.parametrize("fmt,kind", CARRIED)
def test_round_trip_float32(exports, heads, target, fmt, kind):
    loaded = load_any_head(exports[(fmt, kind)], target)
    assert_same_head(loaded, heads[kind])
    report = inspect_dir(exports[(fmt, kind)], target)
    assert report.format == fmt and report.ok, report.problems


@pytest.mark.parametrize("fmt,kind", CARRIED)
def test_round_trip_bfloat16(target, target_dir, tmp_path, fmt, kind):
    head = make_reduced_head(target, kind, dtype=torch.bfloat16)
    save_head(head, tmp_path / "head")
    out = export_head(tmp_path / "head", fmt, tmp_path / "out", target_dir)
    dtypes = {name: dtype for name, (_, dtype) in layout(out).items()}
    assert {dtype for name, dtype in dtypes.items() if name not in ("d2t", "t2d")} == {torch.bfloat16}
    if fmt == "native":
        assert (dtypes["d2t"], dtypes["t2d"]) == (torch.int64, torch.bool)
    assert read_config(out)["torch_dtype"] == "bfloat16"
    assert inspect_dir(out, target).ok
    assert_same_head(load_any_head(out, target), head)


def test_native_export_is_what_load_head_reads(exports, heads, target):
    for kind in ("mtp", "eagle1"):
        assert_same_head(load_head(exports[("native", kind)], target), heads[kind])


def test_dtype_conversion_keeps_d2t_and_t2d(head_dirs, heads, target, target_dir, tmp_path):
    out = export_head(head_dirs["mtp"], "native", tmp_path / "out", target_dir, dtype="bfloat16")
    dtypes = {name: dtype for name, (_, dtype) in layout(out).items()}
    assert (dtypes.pop("d2t"), dtypes.pop("t2d")) == (torch.int64, torch.bool)
    assert set(dtypes.values()) == {torch.bfloat16}
    assert inspect_dir(out, target).ok
    loaded = load_any_head(out, target)
    assert loaded.dtype == torch.bfloat16 and torch.equal(loaded.draft_ids, DRAFT_IDS)
    # load_any_head(dtype=...) casts the weights only.
    loaded = load_any_head(out, target, dtype=torch.float32)
    assert loaded.dtype == torch.float32 and loaded.d2t.dtype == torch.int64 and loaded.t2d.dtype == torch.bool
    assert torch.equal(loaded.draft_ids, heads["mtp"].draft_ids)


def test_two_layer_reduced_eagle_head_round_trips_through_eagle(target, target_dir, tmp_path):
    head = make_reduced_head(target, "eagle1", num_layers=2, draft_ids=torch.tensor([3, 4, 50]))
    save_head(head, tmp_path / "head")
    out = export_head(tmp_path / "head", "eagle", tmp_path / "out", target_dir)
    assert torch.load(out / TOKEN_MAP, weights_only=True) == [3, 4, 50]
    assert_same_head(load_any_head(out, target), head)


# ---- refusals -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["deepseek-mtp", "vllm-mtp"])
def test_formats_without_a_draft_vocabulary_write_the_head_over_the_full_vocabulary(heads, head_dirs, target,
                                                                                     target_dir, tmp_path, fmt,
                                                                                     caplog):
    """Their engines compute the draft logits with the target's whole lm_head: the head is written drafting over
    every token, with no flag (the demo's head must reach an engine), said in the log and recorded in config.json;
    its logits over the draft ids are the reduced head's."""
    with caplog.at_level("WARNING", logger="mtp_train.export.exporter"):
        out = export_head(head_dirs["mtp"], fmt, tmp_path / "out", target_dir)
    assert f"written as {fmt} drafting over the full vocabulary ({fmt} has no draft vocabulary" in caplog.text
    assert "trained to draft 12 of 96 tokens" in caplog.text
    block = read_config(out)["mtp_train"]
    assert block["head_config"]["draft_vocab_size"] is None and block["full_vocab_from_draft_vocab_size"] == N
    assert not {"d2t", "t2d"} & set(load_file(out / "model.safetensors"))
    loaded = load_any_head(out, target)
    assert loaded.draft_ids is None
    torch.testing.assert_close(draft_logits(loaded)[:, DRAFT_IDS], draft_logits(heads["mtp"]), rtol=1e-5, atol=1e-5)


def test_kind_refusals_suggest_the_formats_that_carry_the_kind(head_dirs, target_dir, tmp_path):
    with pytest.raises(UserError, match=r"hnorm.*would be lost\. Use --format deepseek-mtp, vllm-mtp or native$"):
        export_head(head_dirs["mtp"], "eagle", tmp_path / "eagle", target_dir)
    with pytest.raises(UserError, match=r"fc\.bias would be lost; use --format eagle or native$"):
        export_head(head_dirs["eagle1"], "deepseek-mtp", tmp_path / "d", target_dir)


def test_cli_export_refusal(head_dirs, target_dir, tmp_path, capsys):
    argv = ["export", "--head", str(head_dirs["mtp"]), "--format", "eagle3", "--out", str(tmp_path / "o")]
    assert run_cli(argv + ["--target", str(target_dir)]) == 2
    assert "format eagle3 holds EAGLE-3 heads" in capsys.readouterr().err


def test_inconsistent_head_file_is_refused_at_export(head_dirs, target_dir, tmp_path):
    shutil.copytree(head_dirs["eagle1"], tmp_path / "head")
    tensors = load_file(tmp_path / "head" / "model.safetensors")
    tensors["t2d"] = tensors["t2d"].clone()
    tensors["t2d"][3] = True  # id 3 is not a draft id
    save_file(tensors, tmp_path / "head" / "model.safetensors")
    with pytest.raises(UserError, match="t2d does not mark exactly the target ids that d2t maps to"):
        export_head(tmp_path / "head", "eagle", tmp_path / "out", target_dir)
    tensors["t2d"][3] = False
    tensors["d2t"] = tensors["d2t"].to(torch.int32)
    save_file(tensors, tmp_path / "head" / "model.safetensors")
    with pytest.raises(UserError, match="tensor d2t is torch.int32, expected int64"):
        export_head(tmp_path / "head", "native", tmp_path / "out", target_dir)


# ---- inspect ------------------------------------------------------------------------------------------------------


def _edit(name, fn):
    def edit(tensors):
        tensors = dict(tensors)
        tensors[name] = fn(tensors[name].clone())
        return tensors

    return edit


def _set(index, value):
    def fn(t):
        t[index] = value
        return t

    return fn


def _token_map(ids):
    return lambda d: torch.save(ids, d / TOKEN_MAP)


T2D_MISMATCH = r"t2d does not mark exactly the target ids that d2t maps to"
BROKEN = [
    # (format, kind, tensor edit, config edit, file edit, problem regex)
    ("native", "mtp", _edit("t2d", _set(3, True)), None, None, T2D_MISMATCH),
    ("native", "mtp", _edit("t2d", _set(0, False)), None, None, T2D_MISMATCH),
    ("native", "eagle1", _edit("d2t", _set(4, 0)), None, None, r"d2t: target ids must be strictly increasing"),
    ("native", "eagle1", _edit("d2t", _set(N - 1, V)), None, None, r"d2t: target ids must lie in \[0, 96\)"),
    ("native", "mtp", _edit("d2t", lambda t: t.to(torch.int32)), None, None, r"tensor d2t is int32, expected int64"),
    ("native", "mtp", _edit("t2d", lambda t: t.to(torch.uint8)), None, None, r"tensor t2d is uint8, expected bool"),
    ("native", "mtp", _edit("t2d", lambda t: t[:-1]), None, None, r"tensor t2d has shape \[95\], config\.json implies"),
    ("native", "mtp", lambda t: {k: v for k, v in t.items() if k != "d2t"}, None, None, r"missing tensor d2t \(expected"),
    (
        "native",
        "eagle1",
        None,
        lambda c: c.update(draft_vocab_size=11),
        None,
        r"draft_vocab_size=11 but mtp_train\.head_config\.draft_vocab_size=12",
    ),
    (
        "native",
        "mtp",
        None,
        lambda c: (c.pop("draft_vocab_size"), c["mtp_train"]["head_config"].update(draft_vocab_size=None)),
        None,
        r"draft_vocab_size=None but head_config\.json says 12",
    ),
    ("eagle", "eagle1", None, None, lambda d: (d / TOKEN_MAP).unlink(), r"speculative_token_map\.pt: not found"),
    ("eagle", "eagle1", None, None, _token_map(DRAFT_IDS.tolist()[:-1]), r"11 target ids, but .* draft_vocab_size=12"),
    ("eagle", "eagle1", None, None, _token_map([5, 1, 2] + DRAFT_IDS.tolist()[3:]), r"strictly increasing"),
    ("eagle", "eagle1", None, None, _token_map(DRAFT_IDS.tolist()[:-1] + [96]), r"must lie in \[0, 96\)"),
    ("eagle", "eagle1", None, None, _token_map({"ids": [1, 2]}), r"expected a list of target token ids"),
    (
        "eagle",
        "eagle1",
        None,
        lambda c: c["mtp_train"]["head_config"].update(draft_vocab_size=None),
        None,
        r"draft_vocab_size=12 but mtp_train\.head_config\.draft_vocab_size=None",
    ),
]


@pytest.mark.parametrize("case", range(len(BROKEN)))
def test_inspect_names_every_draft_vocab_problem(exports, target, tmp_path, case, capsys):
    fmt, kind, tensors, config_edit, files, pattern = BROKEN[case]
    broken = edited_copy(exports[(fmt, kind)], tmp_path / "broken", tensors, config_edit, files)
    report = inspect_dir(broken)
    assert report.format == fmt and not report.ok
    assert any(re.search(pattern, p) for p in report.problems), report.problems
    assert run_cli(["inspect", str(broken)]) == 1
    assert re.search(pattern, capsys.readouterr().out)
    with pytest.raises(UserError, match=pattern):
        load_any_head(broken, target)


def test_inspect_cli_shows_the_draft_vocabulary(exports, target_dir, capsys):
    assert run_cli(["inspect", str(exports[("native", "mtp")]), "--target", str(target_dir), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and data["format"] == "native"
    assert data["tensors"]["d2t"] == {"shape": [N], "dtype": "int64"}
    assert data["tensors"]["t2d"] == {"shape": [V], "dtype": "bool"}
    assert run_cli(["inspect", str(exports[("native", "mtp")])]) == 0
    assert "draft vocabulary: 12 of 96 target tokens (d2t/t2d)" in capsys.readouterr().out
    assert run_cli(["inspect", str(exports[("eagle", "eagle1")]), "--target", str(target_dir)]) == 0
    assert f"draft vocabulary: 12 of 96 target tokens (token map {TOKEN_MAP})" in capsys.readouterr().out


@pytest.fixture(scope="module")
def full_exports(target, target_dir, tmp_path_factory):
    """Full-vocabulary deepseek-mtp / vllm-mtp / eagle exports, for configs edited to claim a draft vocabulary."""
    root = tmp_path_factory.mktemp("full")
    out = {}
    for kind, fmts in (("mtp", ("deepseek-mtp", "vllm-mtp")), ("eagle1", ("eagle",))):
        torch.manual_seed(0)
        config = HeadConfig.for_target(target.config, target.fingerprint, kind=kind, init="random")
        save_head(DraftHead.from_target(target, config), root / kind)
        for fmt in fmts:
            out[fmt] = export_head(root / kind, fmt, root / fmt, target_dir)
    return out


@pytest.mark.parametrize("fmt", ["deepseek-mtp", "vllm-mtp"])
def test_formats_without_a_draft_vocabulary_reject_a_declared_one(full_exports, target, tmp_path, fmt):
    def claim(config):
        config["draft_vocab_size"] = N
        config["mtp_train"]["head_config"]["draft_vocab_size"] = N

    broken = edited_copy(full_exports[fmt], tmp_path / "broken", config_edit=claim)
    report = inspect_dir(broken)
    pattern = (
        rf"draft_vocab_size=12, mtp_train\.head_config\.draft_vocab_size=12, but format {fmt} cannot carry a reduced "
        "draft vocabulary"
    )
    assert any(re.search(pattern, p) for p in report.problems), report.problems
    with pytest.raises(UserError, match="cannot carry a reduced draft vocabulary"):
        load_any_head(broken, target)


def test_eagle_token_map_without_a_declared_vocabulary(full_exports, target, tmp_path):
    broken = edited_copy(full_exports["eagle"], tmp_path / "broken", files=_token_map(DRAFT_IDS.tolist()))
    report = inspect_dir(broken)
    assert any("a token map, but" in p and "declares no draft_vocab_size" in p for p in report.problems), report.problems
    with pytest.raises(UserError, match="SGLang would restrict the head to it"):
        load_any_head(broken, target)
