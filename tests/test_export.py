"""Export formats: exact layouts, inspect's checks, round trips through load_any_head, refusals, the CLI, and the real
SmolLM2 head."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mtp_train.errors import UserError
from mtp_train.export import export_head, inspect_dir, load_any_head
from mtp_train.heads import DraftHead, HeadConfig, save_head
from mtp_train.runtime.attention import BatchInfo
from mtp_train.runtime.loader import load_model
from tests.export_helpers import EXPECTED, draft_logits, edited_copy, prefixed, read_config, run_cli
from tests.tiny_models import save_tiny_model

# The tiny target is the `target`/`target_dir` fixture of tests/conftest.py; EXPECTED, its exports' layouts, is in
# tests/export_helpers.py.

REPRESENTABLE = sorted(EXPECTED)

# Config fields each format must carry, with the values pinned where they are fixed.
REQUIRED_CONFIG = {
    "native": {
        "format": "mtp_train.native",
        "format_version": 1,
        "head_kind": None,
        "num_layers": 1,
        "model_type": "llama",
        "hidden_size": 64,
        "vocab_size": 96,
        "norms": None,
        "fc_bias": None,
        "layer": None,
        "layer_ids": [2],
        "target_fingerprint": None,
        "hidden_state_input": "final_norm_output",
        "torch_dtype": "float32",
    },
    "deepseek-mtp": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 112,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 96,
        "rms_norm_eps": None,
        "num_hidden_layers": 2,
        "num_nextn_predict_layers": 1,
        "rope_theta": 10000.0,
        "torch_dtype": "float32",
    },
    "vllm-mtp": {
        "architectures": ["MiMoForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_nextn_predict_layers": 1,
        "rope_theta": 10000.0,
        "torch_dtype": "float32",
    },
    "eagle": {
        "architectures": ["LlamaForCausalLMEagle", "LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 112,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 96,
        "rms_norm_eps": None,
        "num_hidden_layers": 1,
        "rope_theta": 10000.0,
        "torch_dtype": "float32",
    },
}


def make_head(target, kind: str, num_layers: int = 1, dtype=torch.float32, fc_bias: bool = False) -> DraftHead:
    """A random-init head whose norms and biases are perturbed away from 1/0, so a mix-up shows. An eagle1 head has no
    fc bias unless `fc_bias` (what vLLM's EAGLE-1 class serves; tests/test_export_vllm.py covers the biased one)."""
    torch.manual_seed(0)
    extra = {"fc_bias": fc_bias} if kind == "eagle1" else {}
    config = HeadConfig.for_target(target.config, target.fingerprint, kind=kind, num_layers=num_layers, init="random",
                                   **extra)
    head = DraftHead.from_target(target, config)
    with torch.no_grad():
        for name, param in head.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
    return head.to(dtype)


@pytest.fixture(scope="module")
def head_dirs(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    dirs = {}
    for kind in ("mtp", "eagle1"):
        dirs[kind] = save_head(make_head(target, kind), root / kind)
    return dirs


@pytest.fixture(scope="module")
def exports(head_dirs, target_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("exports")
    return {
        (fmt, kind): export_head(head_dirs[kind], fmt, root / f"{fmt}-{kind}", target_dir)
        for fmt, kind in REPRESENTABLE
    }


def tensor_shapes(directory: Path) -> dict:
    return {k: tuple(v.shape) for k, v in load_file(directory / "model.safetensors").items()}


# ---- exact layouts ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt,kind", REPRESENTABLE)
def test_exact_tensor_names_and_shapes(exports, fmt, kind):
    assert tensor_shapes(exports[(fmt, kind)]) == EXPECTED[(fmt, kind)]


@pytest.mark.parametrize("fmt,kind", REPRESENTABLE)
def test_required_config_fields(exports, target, fmt, kind):
    directory = exports[(fmt, kind)]
    config = read_config(directory)
    for key, value in REQUIRED_CONFIG[fmt].items():
        assert key in config, key
        if value is not None:
            assert config[key] == value, key
    block = config["mtp_train"]
    assert block["format"] == fmt
    assert block["head_config"]["kind"] == kind
    assert block["target_fingerprint"] == target.fingerprint
    assert block["hidden_state_input"] == "final_norm_output"
    assert block["draft_feedback"] == {"mtp": "post_norm_output", "eagle1": "raw_layer_output"}[kind]
    if fmt == "native":
        assert json.loads((directory / "head_config.json").read_text())["kind"] == kind
        assert config["norms"] == {
            "mtp": {"enorm": True, "hnorm": True, "input_layernorm": [True], "final_norm": True},
            "eagle1": {"enorm": False, "hnorm": False, "input_layernorm": [False], "final_norm": False},
        }[kind]
        assert config["fc_bias"] is False  # mtp: eh_proj has none; these eagle1 heads have head.fc_bias: false


def test_deepseek_mtp_stores_the_targets_frozen_tensors_and_head_order(exports, head_dirs, target):
    stored = load_file(exports[("deepseek-mtp", "mtp")] / "model.safetensors")
    assert torch.equal(stored["model.layers.2.embed_tokens.weight"], target.model.embed_tokens.weight)
    assert torch.equal(stored["model.layers.2.shared_head.head.weight"], target.lm_head.weight)
    native = load_file(head_dirs["mtp"] / "model.safetensors")
    # Same column order as ours (embed | hidden): the projection is copied, not permuted.
    assert torch.equal(stored["model.layers.2.eh_proj.weight"], native["eh_proj.weight"])
    assert torch.equal(stored["model.layers.2.shared_head.norm.weight"], native["norm.weight"])
    for fmt in ("native", "eagle", "vllm-mtp"):
        for kind in ("mtp", "eagle1"):
            if (fmt, kind) in exports:
                names = tensor_shapes(exports[(fmt, kind)])
                assert not [n for n in names if "embed_tokens" in n or "lm_head" in n or "shared_head.head" in n]


def test_native_export_is_what_load_head_reads(exports, head_dirs, target):
    from mtp_train.heads import load_head

    for kind in ("mtp", "eagle1"):
        head = load_head(exports[("native", kind)], target)
        original = load_head(head_dirs[kind], target)
        assert torch.equal(draft_logits(head), draft_logits(original))


# ---- round trips --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt,kind", REPRESENTABLE)
def test_round_trip_reproduces_draft_logits(exports, head_dirs, target, fmt, kind):
    from mtp_train.heads import load_head

    original = load_head(head_dirs[kind], target)
    loaded = load_any_head(exports[(fmt, kind)], target)
    assert loaded.kind == kind and loaded.dtype == original.dtype == torch.float32
    assert loaded.state_dict().keys() == original.state_dict().keys()
    for key, value in original.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    assert torch.equal(draft_logits(loaded), draft_logits(original))


@pytest.mark.parametrize("fmt,kind", [("deepseek-mtp", "mtp"), ("eagle", "eagle1"), ("vllm-mtp", "mtp")])
def test_round_trip_bfloat16(target, target_dir, tmp_path, fmt, kind):
    head = make_head(target, kind, dtype=torch.bfloat16)
    save_head(head, tmp_path / "head")
    out = export_head(tmp_path / "head", fmt, tmp_path / "out", target_dir)
    assert {v.dtype for v in load_file(out / "model.safetensors").values()} == {torch.bfloat16}
    assert read_config(out)["torch_dtype"] == "bfloat16"
    loaded = load_any_head(out, target)
    assert loaded.dtype == torch.bfloat16
    assert torch.equal(draft_logits(loaded), draft_logits(head))


def test_two_layer_eagle_head_round_trips_through_eagle(target, target_dir, tmp_path):
    head = make_head(target, "eagle1", num_layers=2)
    save_head(head, tmp_path / "head")
    out = export_head(tmp_path / "head", "eagle", tmp_path / "out", target_dir)
    names = tensor_shapes(out)
    assert "layers.1.input_layernorm.weight" in names and "layers.0.input_layernorm.weight" not in names
    assert read_config(out)["num_hidden_layers"] == 2
    assert torch.equal(draft_logits(load_any_head(out, target)), draft_logits(head))


def test_qwen2_eagle_head_round_trips(tmp_path):
    """An engine config keeps the target's whole-model fields (Qwen2's `layer_types`, one per target layer) next to
    num_hidden_layers = the head's layers; reading the layer shape back parses only the fields that shape a layer."""
    qwen_dir = save_tiny_model(tmp_path / "qwen2", "qwen2")
    qwen = load_model(qwen_dir, dtype="float32", device="cpu")
    save_head(make_head(qwen, "eagle1"), tmp_path / "head")
    out = export_head(tmp_path / "head", "eagle", tmp_path / "out", qwen_dir)
    assert read_config(out)["architectures"] == ["Qwen2ForCausalLMEagle"]  # vLLM has no EAGLE-1 Qwen2 class
    assert inspect_dir(out, qwen).ok
    assert torch.equal(draft_logits(load_any_head(out, qwen)), draft_logits(make_head(qwen, "eagle1")))

def test_export_dtype_conversion(head_dirs, target_dir, tmp_path):
    out = export_head(head_dirs["mtp"], "native", tmp_path / "out", target_dir, dtype="bfloat16")
    assert {v.dtype for v in load_file(out / "model.safetensors").values()} == {torch.bfloat16}
    assert read_config(out)["torch_dtype"] == "bfloat16"
    with pytest.raises(UserError, match="--dtype 'int8'"):
        export_head(head_dirs["mtp"], "native", tmp_path / "bad", target_dir, dtype="int8")


def test_an_export_is_the_same_bytes_in_every_process(head_dirs, target_dir, tmp_path):
    """Exports are reproducible byte for byte (hash them to compare two runs): safetensors writes its metadata from a
    hash map whose order changes per process, so the writer puts the keys in sorted order. Three processes each export
    the same head; every file of the three exports is identical."""
    script = ("import sys; from mtp_train.export import export_head; "
              "export_head(sys.argv[1], 'deepseek-mtp', sys.argv[2], sys.argv[3])")
    outs = [tmp_path / f"out{i}" for i in range(3)]
    for out in outs:
        subprocess.run([sys.executable, "-c", script, str(head_dirs["mtp"]), str(out), str(target_dir)], check=True,
                       cwd=Path(__file__).resolve().parents[1], capture_output=True)
    files = sorted(p.name for p in outs[0].iterdir())
    assert "model.safetensors" in files and len(load_file(outs[0] / "model.safetensors")) > 3
    for out in outs[1:]:
        assert sorted(p.name for p in out.iterdir()) == files
        assert all((out / name).read_bytes() == (outs[0] / name).read_bytes() for name in files)


# ---- inspect ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt,kind", REPRESENTABLE)
def test_inspect_accepts_every_export(exports, target, fmt, kind):
    report = inspect_dir(exports[(fmt, kind)], target)
    assert report.format == fmt and report.ok, report.problems
    assert {k: v[0] for k, v in report.tensors.items()} == EXPECTED[(fmt, kind)]


def _renamed(old, new):
    return lambda t: {(new if k == old else k): v for k, v in t.items()}


def _added(name, shape):
    return lambda t: {**t, name: torch.zeros(shape)}


BROKEN = [
    # (format, kind, tensor edit, config edit, problem regex)
    ("native", "mtp", _renamed("hnorm.weight", "h_norm.weight"), None, r"missing tensor hnorm\.weight"),
    ("native", "mtp", _renamed("hnorm.weight", "h_norm.weight"), None, r"unexpected tensor h_norm\.weight"),
    ("native", "mtp", _added("fc.bias", (64,)), None, r"unexpected tensor fc\.bias"),
    ("native", "eagle1", None, lambda c: c.pop("norms"), r"missing config field norms"),
    (
        "deepseek-mtp",
        "mtp",
        _renamed("model.layers.2.eh_proj.weight", "model.layers.2.e_h_proj.weight"),
        None,
        r"missing tensor model\.layers\.2\.eh_proj\.weight",
    ),
    (
        "deepseek-mtp",
        "mtp",
        _added("model.layers.2.eh_proj.bias", (64,)),
        None,
        r"unexpected tensor model\.layers\.2\.eh_proj\.bias",
    ),
    ("deepseek-mtp", "mtp", None, lambda c: c.pop("num_nextn_predict_layers"), "missing config field num_nextn_predict_layers"),
    ("eagle", "eagle1", _renamed("fc.bias", "fc.b"), None, r"missing tensor fc\.bias"),
    (
        "eagle",
        "eagle1",
        _added("layers.0.self_attn.o_proj.bias", (64,)),
        None,
        r"unexpected tensor layers\.0\.self_attn\.o_proj\.bias",
    ),
    ("eagle", "eagle1", _added("layers.0.input_layernorm.weight", (64,)), None, r"unexpected tensor layers\.0\.input_layernorm"),
    ("eagle", "eagle1", None, lambda c: c.pop("num_hidden_layers"), "missing config field num_hidden_layers"),
    (
        "vllm-mtp",
        "mtp",
        _renamed("model.mtp_layers.0.input_proj.weight", "model.mtp_layers.0.eh_proj.weight"),
        None,
        r"missing tensor model\.mtp_layers\.0\.input_proj\.weight",
    ),
    (
        "vllm-mtp",
        "mtp",
        _added("model.mtp_layers.0.self_attn.o_proj.bias", (64,)),
        None,
        r"unexpected tensor model\.mtp_layers\.0\.self_attn\.o_proj\.bias",
    ),
    ("vllm-mtp", "mtp", None, lambda c: c.update(architectures=["LlamaForCausalLM"]), r"needs \['MiMoForCausalLM'\]"),
]


@pytest.mark.parametrize("case", range(len(BROKEN)))
def test_inspect_names_every_problem(exports, target, tmp_path, case, capsys):
    fmt, kind, tensors, config_edit, pattern = BROKEN[case]
    broken = edited_copy(exports[(fmt, kind)], tmp_path / "broken", tensors, config_edit)
    report = inspect_dir(broken)
    assert not report.ok
    assert any(re.search(pattern, p) for p in report.problems), report.problems
    # The CLI exits 1 and prints the problem.
    assert run_cli(["inspect", str(broken)]) == 1
    assert re.search(pattern, capsys.readouterr().out)
    # load_any_head refuses it too.
    with pytest.raises(UserError, match=pattern):
        load_any_head(broken, target)


def test_inspect_against_a_target(exports, tmp_path, capsys):
    other = load_model(save_tiny_model(tmp_path / "wide", "llama", hidden_size=48, head_dim=12), "float32", "cpu")
    report = inspect_dir(exports[("eagle", "eagle1")], other)
    assert any("hidden_size=64 but the target has hidden_size=48" in p for p in report.problems)
    qwen = save_tiny_model(tmp_path / "qwen", "qwen2")
    assert run_cli(["inspect", str(exports[("deepseek-mtp", "mtp")]), "--target", str(qwen)]) == 1
    out = capsys.readouterr().out
    assert "model_type='llama' but the target has model_type='qwen2'" in out
    # Same architecture and shapes, other weights: only the fingerprint tells.
    twin = save_tiny_model(tmp_path / "twin", "llama", seed=99)
    assert run_cli(["inspect", str(exports[("native", "mtp")]), "--target", str(twin)]) == 1
    assert "does not match the target's" in capsys.readouterr().out


def test_inspect_cli_ok_table(exports, target_dir, capsys):
    assert run_cli(["inspect", str(exports[("deepseek-mtp", "mtp")]), "--target", str(target_dir)]) == 0
    out = capsys.readouterr().out
    assert "format deepseek-mtp" in out and "model.layers.2.eh_proj.weight" in out and "[64, 128]" in out
    assert run_cli(["inspect", str(exports[("eagle", "eagle1")]), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["format"] == "eagle" and data["ok"] and data["tensors"]["fc.bias"] == {"shape": [64], "dtype": "float32"}


# ---- refusals -----------------------------------------------------------------------------------------------------


def test_mtp_head_refused_by_eagle_formats(head_dirs, target_dir, tmp_path):
    with pytest.raises(UserError) as err:
        export_head(head_dirs["mtp"], "eagle", tmp_path / "e", target_dir)
    message = str(err.value)
    for lost in ("enorm", "hnorm", "input_layernorm", "final norm"):
        assert lost in message
    with pytest.raises(UserError, match="fc.bias would be lost"):
        export_head(head_dirs["eagle1"], "deepseek-mtp", tmp_path / "d", target_dir)
    with pytest.raises(UserError, match="token_layernorm, hidden_layernorm.*fc.bias would be lost"):
        export_head(head_dirs["eagle1"], "vllm-mtp", tmp_path / "v", target_dir)
    assert not any(tmp_path.iterdir())  # nothing written, no temporary directory left


def test_multi_layer_mtp_head_refused_by_deepseek(target, target_dir, tmp_path):
    save_head(make_head(target, "mtp", num_layers=2), tmp_path / "head")
    with pytest.raises(UserError, match="2 decoder layers.*exactly one block"):
        export_head(tmp_path / "head", "deepseek-mtp", tmp_path / "out", target_dir)


def test_unsupported_block_refused(tmp_path):
    qwen3_dir = save_tiny_model(tmp_path / "qwen3", "qwen3", head_dim=24)
    qwen3 = load_model(qwen3_dir, dtype="float32", device="cpu")
    save_head(make_head(qwen3, "eagle1"), tmp_path / "head")
    with pytest.raises(UserError, match="no EAGLE-1 loader for model_type 'qwen3'"):
        export_head(tmp_path / "head", "eagle", tmp_path / "out", qwen3_dir)
    out = export_head(tmp_path / "head", "native", tmp_path / "native", qwen3_dir)
    assert torch.equal(draft_logits(load_any_head(out, qwen3)), draft_logits(make_head(qwen3, "eagle1")))


def test_unknown_format(head_dirs, target_dir, tmp_path, capsys):
    with pytest.raises(UserError, match="unknown format 'medusa'; known formats: native, deepseek-mtp, vllm-mtp, eagle"):
        export_head(head_dirs["mtp"], "medusa", tmp_path / "out", target_dir)
    argv = ["export", "--head", str(head_dirs["mtp"]), "--format", "medusa", "--out", str(tmp_path / "o")]
    assert run_cli(argv + ["--target", str(target_dir)]) == 2
    assert "known formats: native, deepseek-mtp, vllm-mtp, eagle" in capsys.readouterr().err


def test_output_directory_rules(head_dirs, target_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("the user's")
    for overwrite in (False, True):  # a directory that is not an export of ours is never replaced
        with pytest.raises(UserError, match="not empty and not written by mtp-train export.*--overwrite included"):
            export_head(head_dirs["mtp"], "native", out, target_dir, overwrite=overwrite)
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "the user's"
    (out / "notes.txt").unlink()
    export_head(head_dirs["mtp"], "native", out, target_dir)
    with pytest.raises(UserError, match="holds an export.*--overwrite"):
        export_head(head_dirs["mtp"], "native", out, target_dir)
    export_head(head_dirs["mtp"], "native", out, target_dir, overwrite=True)  # our export: replaced
    assert sorted(p.name for p in out.iterdir()) == [".mtp_train-output.json", "config.json", "head_config.json",
                                                     "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the temporary and old directories are gone
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask  # an ordinary directory, not mkdtemp's 0700
    (tmp_path / "empty").mkdir()
    export_head(head_dirs["mtp"], "native", tmp_path / "empty", target_dir)  # an empty directory is fine
    with pytest.raises(UserError, match="input directory"):
        export_head(head_dirs["mtp"], "native", head_dirs["mtp"], target_dir, overwrite=True)
    with pytest.raises(UserError, match="--target DIR is required.*embed_tokens / lm_head"):
        export_head(head_dirs["mtp"], "deepseek-mtp", tmp_path / "nt", None)


def test_head_against_wrong_target(head_dirs, tmp_path):
    cases = {
        "hidden": (dict(hidden_size=48, head_dim=12), "hidden_size=64 but the target has hidden_size=48"),
        "vocab": (dict(vocab_size=80), "vocab_size=96 but the target has vocab_size=80"),
        "arch": (dict(model_type="qwen2"), "model_type='llama' but the target has model_type='qwen2'"),
        "fingerprint": (dict(seed=7), "target_fingerprint .* does not match the target's"),
    }
    for name, (overrides, message) in cases.items():
        overrides = dict(overrides)
        model_type = overrides.pop("model_type", "llama")
        other = save_tiny_model(tmp_path / name, model_type, **overrides)
        with pytest.raises(UserError, match=message):
            export_head(head_dirs["mtp"], "native", tmp_path / f"out-{name}", other)
        assert not (tmp_path / f"out-{name}").exists()


def test_load_any_head_wrong_target(exports, tmp_path):
    other = load_model(save_tiny_model(tmp_path / "twin", "llama", seed=5), dtype="float32", device="cpu")
    with pytest.raises(UserError, match="does not match the target's"):
        load_any_head(exports[("deepseek-mtp", "mtp")], other)


def test_deepseek_frozen_tensors_must_match_the_target(exports, target, tmp_path):
    def edit(t):
        t = dict(t)
        t["model.layers.2.embed_tokens.weight"] = t["model.layers.2.embed_tokens.weight"] + 1
        return t

    broken = edited_copy(exports[("deepseek-mtp", "mtp")], tmp_path / "b", edit)
    with pytest.raises(UserError, match="stored embed_tokens differs from the target's"):
        load_any_head(broken, target)


# ---- CLI ----------------------------------------------------------------------------------------------------------


def test_cli_export(head_dirs, target_dir, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["export", "--head", str(head_dirs["mtp"]), "--format", "vllm-mtp", "--out", str(out)]
    argv += ["--target", str(target_dir), "--num-speculative-tokens", "5"]
    assert run_cli(argv) == 0
    serve = json.loads((out / "vllm_serve.json").read_text())
    assert serve["speculative_config"] == {"method": "mtp", "model": str(out.resolve()), "num_speculative_tokens": 5}
    assert run_cli(argv) == 2  # not empty now
    assert "--overwrite" in capsys.readouterr().err
    assert run_cli(argv + ["--overwrite"]) == 0


# ---- the real SmolLM2 ---------------------------------------------------------------------------------------------

SMOL_BLOCK = {
    "self_attn.q_proj.weight": (576, 576),  # 9 heads x 64
    "self_attn.k_proj.weight": (192, 576),  # 3 kv heads x 64
    "self_attn.v_proj.weight": (192, 576),
    "self_attn.o_proj.weight": (576, 576),
    "post_attention_layernorm.weight": (576,),
    "mlp.gate_proj.weight": (1536, 576),
    "mlp.up_proj.weight": (1536, 576),
    "mlp.down_proj.weight": (576, 1536),
}


@pytest.mark.slow
@pytest.mark.real_model
def test_smollm2_last_layer_mtp_head_exports(smollm2_dir, tmp_path):
    target = load_model(smollm2_dir, dtype="bfloat16", device="cpu")
    config = HeadConfig.for_target(target.config, target.fingerprint, kind="mtp", init="last_layer")
    torch.manual_seed(0)
    head = DraftHead.from_target(target, config)
    save_head(head, tmp_path / "head")

    native = export_head(tmp_path / "head", "native", tmp_path / "native", smollm2_dir)
    assert tensor_shapes(native) == {
        "enorm.weight": (576,),
        "hnorm.weight": (576,),
        "eh_proj.weight": (576, 1152),
        "layers.0.input_layernorm.weight": (576,),
        **prefixed("layers.0.", SMOL_BLOCK),
        "norm.weight": (576,),
    }
    assert read_config(native)["layer_ids"] == [30]

    mtp = export_head(tmp_path / "head", "deepseek-mtp", tmp_path / "mtp", smollm2_dir)
    assert tensor_shapes(mtp) == {
        "model.layers.30.embed_tokens.weight": (49152, 576),
        "model.layers.30.enorm.weight": (576,),
        "model.layers.30.hnorm.weight": (576,),
        "model.layers.30.eh_proj.weight": (576, 1152),
        "model.layers.30.input_layernorm.weight": (576,),
        **prefixed("model.layers.30.", SMOL_BLOCK),
        "model.layers.30.shared_head.norm.weight": (576,),
        "model.layers.30.shared_head.head.weight": (49152, 576),
    }
    config = read_config(mtp)
    assert (config["num_hidden_layers"], config["num_nextn_predict_layers"], config["torch_dtype"]) == (30, 1, "bfloat16")
    assert config["rope_theta"] == 100000.0 and config["tie_word_embeddings"] is True
    assert inspect_dir(mtp, target).ok

    with pytest.raises(UserError, match="would be lost"):
        export_head(tmp_path / "head", "eagle", tmp_path / "eagle", smollm2_dir)

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 49152, (12,), generator=gen)
    hidden = torch.randn(12, 576, generator=gen).to(torch.bfloat16)
    batch = BatchInfo.without_cache([8, 4])
    with torch.no_grad():
        expected = head.logits(head(tokens, hidden, batch))
        for directory in (native, mtp):
            loaded = load_any_head(directory, target)
            assert torch.equal(loaded.logits(loaded(tokens, hidden, batch)), expected)


@pytest.mark.slow
@pytest.mark.real_model
def test_smollm2_eagle_head_exports(smollm2_dir, tmp_path):
    target = load_model(smollm2_dir, dtype="bfloat16", device="cpu")
    config = HeadConfig.for_target(target.config, target.fingerprint, kind="eagle1", init="last_layer")
    save_head(DraftHead.from_target(target, config), tmp_path / "head")
    eagle = export_head(tmp_path / "head", "eagle", tmp_path / "eagle", smollm2_dir)
    assert tensor_shapes(eagle) == {"fc.weight": (576, 1152), "fc.bias": (576,), **prefixed("layers.0.", SMOL_BLOCK)}
    assert read_config(eagle)["architectures"] == ["LlamaForCausalLMEagle", "LlamaForCausalLM"]
    with pytest.raises(UserError, match="fc.bias would be lost"):
        export_head(tmp_path / "head", "deepseek-mtp", tmp_path / "mtp", smollm2_dir)
