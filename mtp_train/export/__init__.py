"""Export trained draft heads for serving engines, and read every exported format back.

Formats (one module each): `native` (our runtime), `deepseek-mtp` (DeepSeek-V3 MTP layout), `vllm-mtp` (vLLM's
MiMo-MTP layout, MTP heads), `eagle` (EAGLE-1 layout, SGLang and vLLM), `eagle3` (speculators EAGLE-3 layout, vLLM).
`export_head` writes one; `inspect_dir` detects and checks one; `load_any_head` loads any of them back into a
`DraftHead`. See docs/export.md for engines and citations.

The package import is light (no torch) so `mtp-train --help` stays fast; the API is imported on first use.
"""

from __future__ import annotations

import importlib

FORMAT_NAMES = ("native", "deepseek-mtp", "vllm-mtp", "eagle", "eagle3")
_WHERE = {
    "export_head": "mtp_train.export.exporter",
    "get_format": "mtp_train.export.registry",
    "inspect_dir": "mtp_train.export.inspection",
    "load_any_head": "mtp_train.export.load",
}

__all__ = ["FORMAT_NAMES", *_WHERE]


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
