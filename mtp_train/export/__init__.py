"""Export trained draft heads for serving engines, and read every exported format back.

Formats (one module each): `native` (our runtime), `deepseek-mtp` (DeepSeek-V3 MTP layout), `eagle` (EAGLE-1 layout,
SGLang), `speculators` (vLLM speculators `eagle`). `export_head` writes one; `inspect_dir` detects and checks one;
`load_any_head` loads any of them back into a `DraftHead`. See docs/export.md for engines and citations.

The package import is light (no torch) so `mtp-train --help` stays fast; the API is imported on first use.
"""

from __future__ import annotations

FORMAT_NAMES = ("native", "deepseek-mtp", "eagle", "speculators")

__all__ = ["FORMAT_NAMES", "export_head", "get_format", "inspect_dir", "load_any_head"]


def __getattr__(name: str):
    if name == "export_head":
        from mtp_train.export.exporter import export_head

        return export_head
    if name == "get_format":
        from mtp_train.export.registry import get_format

        return get_format
    if name == "inspect_dir":
        from mtp_train.export.inspection import inspect_dir

        return inspect_dir
    if name == "load_any_head":
        from mtp_train.export.load import load_any_head

        return load_any_head
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
