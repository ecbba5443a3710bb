"""How vLLM serves an exported head: the format vLLM loads for each head kind, the `vllm serve` arguments for an
export (speculative_config, and the target's hf_overrides where the method needs them) and the command line.

Used by the exports that write their serving arguments (vllm-mtp's vllm_serve.json / SERVING.md), by
`mtp-train eval --engine vllm` (export/vllm_eval.py) and by `make demo`'s summary, so that the command a user is shown
is the one that was run."""

from __future__ import annotations

import json
from typing import Any

# head kind -> (export format, vLLM's speculative method)
VLLM_FORMATS = {"mtp": ("vllm-mtp", "mtp"), "eagle3": ("eagle3", "eagle3"), "eagle1": ("eagle", "eagle")}
# What the target's config needs for a method: vLLM's MTP path reads num_nextn_predict_layers from the *target*
# config, which a Llama/Qwen2 config lacks.
_TARGET_OVERRIDES = {"mtp": {"num_nextn_predict_layers": 1}}


def vllm_serve_arguments(kind: str, export_dir: str, target_dir: str, num_speculative_tokens: int) -> dict[str, Any]:
    """{"target", "speculative_config", "hf_overrides" (None when the method needs none)} that serve the export
    `export_dir` of a `kind` head over the target `target_dir` with k = `num_speculative_tokens`."""
    method = VLLM_FORMATS[kind][1]
    return {
        "target": target_dir,
        "speculative_config": {"method": method, "model": export_dir, "num_speculative_tokens": num_speculative_tokens},
        "hf_overrides": _TARGET_OVERRIDES.get(method),
    }


def vllm_serve_command(serve: dict[str, Any], multiline: bool = False) -> str:
    """The `vllm serve` command line of `vllm_serve_arguments`' result (one line, or one option per line)."""
    parts = [f"vllm serve {serve['target']}", f"--speculative-config '{json.dumps(serve['speculative_config'])}'"]
    if serve.get("hf_overrides"):
        parts.append(f"--hf-overrides '{json.dumps(serve['hf_overrides'])}'")
    return (" \\\n    " if multiline else " ").join(parts)
