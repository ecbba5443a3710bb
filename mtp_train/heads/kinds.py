"""The head class of each head kind (`HeadConfig.kind`): `DraftHead` (mtp, eagle1) and `Eagle3Head` (eagle3). Every
place that builds a head from its config (training, loading, the export checks) asks `head_class`."""

from __future__ import annotations

from mtp_train.heads.draft_head import DraftHead
from mtp_train.heads.eagle3 import Eagle3Head


def head_class(kind: str) -> type:
    """The nn.Module class that builds heads of `kind` (a `DraftHead` or its subclass)."""
    if kind == "eagle3":
        return Eagle3Head

    return DraftHead
