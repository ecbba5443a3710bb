"""The export formats by name."""

from __future__ import annotations

from mtp_train.errors import UserError
from mtp_train.export import FORMAT_NAMES
from mtp_train.export.base import ExportFormat
from mtp_train.export.deepseek_mtp import DeepSeekMTPFormat
from mtp_train.export.eagle import EagleFormat
from mtp_train.export.eagle3 import Eagle3Format
from mtp_train.export.native import NativeFormat
from mtp_train.export.vllm_mtp import VllmMTPFormat

FORMATS: dict[str, ExportFormat] = {
    f.name: f for f in (NativeFormat(), DeepSeekMTPFormat(), VllmMTPFormat(), EagleFormat(), Eagle3Format())
}
assert tuple(FORMATS) == FORMAT_NAMES


def get_format(name: str) -> ExportFormat:
    if name not in FORMATS:
        raise UserError(f"unknown format {name!r}; known formats: {', '.join(FORMATS)}")
    return FORMATS[name]
