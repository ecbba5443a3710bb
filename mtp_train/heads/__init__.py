"""Draft heads: the MTP head with restored norms and its EAGLE-1 ablation (`DraftHead`), the EAGLE-3 head
(`Eagle3Head`), their config (`HeadConfig`), the class of each kind (`head_class`) and the native head files
(`save_head` / `load_head`).

Names are imported on first use, so `mtp_train.heads.config` (what a recipe reads its defaults from) does not pull in
torch; `mtp-train --help` stays fast."""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "HeadConfig": "mtp_train.heads.config",
    "DraftHead": "mtp_train.heads.draft_head",
    "Eagle3Head": "mtp_train.heads.eagle3",
    "head_class": "mtp_train.heads.kinds",
    "load_head": "mtp_train.heads.io",
    "read_head_config": "mtp_train.heads.io",
    "save_head": "mtp_train.heads.io",
}

__all__ = list(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'mtp_train.heads' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
