"""`make demo`'s export stage (scripts/demo.py `_export_all`): the default head (an MTP head with a reduced draft
vocabulary) ends in a format vLLM loads with no flag, the summary's `vllm serve` command is the one the export
writes, and each refusal is one line."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from mtp_train.heads import DraftHead, HeadConfig, save_head

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def demo():
    spec = importlib.util.spec_from_file_location("demo_script", REPO / "scripts" / "demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reduced_mtp_head(target, tmp_path: Path) -> Path:
    torch.manual_seed(0)
    config = HeadConfig.for_target(target.config, target.fingerprint, kind="mtp", num_layers=1, init="random",
                                   draft_vocab_size=12)
    head = DraftHead.from_target(target, config)
    head.set_draft_vocab(torch.arange(0, 96, 8))
    return save_head(head, tmp_path / "head")


def test_the_default_head_kind_is_exported_for_vllm_with_its_serve_command(demo, target, target_dir, tmp_path):
    head_dir = reduced_mtp_head(target, tmp_path)
    timings: dict[str, float] = {}
    exports = demo._export_all(head_dir, str(target_dir), tmp_path / "exports", timings)
    assert sorted(exports["written"]) == ["deepseek-mtp", "native", "vllm-mtp"] and "export" in timings
    assert exports["refused"] == {"eagle": "holds eagle1 heads; this is an mtp head",
                                  "eagle3": "holds eagle3 heads; this is an mtp head"}
    assert exports["vllm_format"] == "vllm-mtp"
    # The command shown is the export's own serving arguments (no eval report here: the default k).
    served = json.loads((tmp_path / "exports" / "vllm-mtp" / "vllm_serve.json").read_text())
    assert served["speculative_config"]["num_speculative_tokens"] == 3 and exports["vllm_k"].startswith("k = 3:")
    assert exports["vllm"].splitlines() == [
        f"vllm serve {served['target']} \\",
        f"    --speculative-config '{json.dumps(served['speculative_config'])}' \\",
        f"    --hf-overrides '{json.dumps(served['hf_overrides'])}'",
    ]


def test_a_refusal_of_the_heads_own_kind_is_its_first_clause(demo):
    from mtp_train.export.registry import get_format

    message = ("cannot export runs/x/head (mtp head) as vllm-mtp: the target's decoder block (qwen3) differs from the "
               "Qwen2 layer vLLM's MiMoMTP builds: the q/k norms would be lost; use --format native")
    assert demo._refusal_line(get_format("vllm-mtp"), "mtp", message) == (
        "the target's decoder block (qwen3) differs from the Qwen2 layer vLLM's MiMoMTP builds")
