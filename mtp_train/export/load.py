"""`load_any_head`: any exported format back into a `DraftHead` over a loaded target.

The directory is first checked like `mtp-train inspect --target` (names, shapes, config fields, target), then its
tensors are mapped back to DraftHead's names. Frozen tensors stored in the file (deepseek-mtp's embed_tokens and
shared_head.head) must equal the target's; the head itself always reads the target's own."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from mtp_train.errors import UserError
from mtp_train.export.common import (
    WEIGHTS_FILENAME,
    check_head_config_against_target,
    check_native_state,
    read_safetensors,
)
from mtp_train.export.inspection import inspect_dir
from mtp_train.export.registry import FORMATS
from mtp_train.heads.draft_head import DraftHead
from mtp_train.heads.vocab import check_d2t_t2d
from mtp_train.runtime.model import CausalLM


def _same_values(stored: torch.Tensor, own: torch.Tensor) -> bool:
    if stored.shape != own.shape:
        return False
    own = own.detach().to("cpu")
    if stored.dtype == own.dtype:
        return torch.equal(stored, own)
    if stored.element_size() != own.element_size():  # compare in the narrower dtype (the one that was rounded to)
        narrow = stored.dtype if stored.element_size() < own.element_size() else own.dtype
        return torch.equal(stored.to(narrow), own.to(narrow))
    return torch.allclose(stored.float(), own.float(), rtol=1e-2, atol=1e-2)  # bfloat16 vs float16


def load_any_head(
    directory: str | os.PathLike[str], target: CausalLM, dtype: torch.dtype | None = None
) -> DraftHead:
    """Load the head at `directory` (a trainer's `head/` or any exported format) over `target`, on its device, in `dtype`
    (default: the dtype stored in the file, so a round trip reproduces the original head bit for bit; d2t/t2d of a
    reduced draft vocabulary keep int64/bool)."""
    directory = Path(directory)
    if (directory / "head_config.json").is_file() and not (directory / "config.json").is_file():
        from mtp_train.heads.io import load_head

        return load_head(directory, target, dtype=dtype)  # a trainer's head/ dir (save_head output)
    report = inspect_dir(directory, target)
    if report.problems:
        raise UserError(
            f"{directory}: not a loadable {report.format or 'export'} for this target: " + "; ".join(report.problems)
        )
    fmt = FORMATS[report.format]
    weights = directory / WEIGHTS_FILENAME
    tensors = read_safetensors(weights)
    native, head_config, frozen = fmt.to_native(tensors, report.config, directory)
    check_head_config_against_target(head_config, target.config, target.fingerprint, str(directory / "config.json"))

    own = {"embed_tokens": target.model.embed_tokens.weight, "lm_head": target.lm_head.weight}
    for key, stored in frozen.items():
        if not _same_values(stored, own[key]):
            raise UserError(
                f"{weights}: the stored {key} differs from the target's (exported for a different target, or the "
                "target's weights changed)"
            )

    with torch.device("meta"):
        head = DraftHead(target.config, head_config, target.model.embed_tokens, target.lm_head, target.backend)
    expected = head.state_dict()
    check_native_state(
        {k: tuple(v.shape) for k, v in native.items()},
        head_config,
        _shape_of(target),
        str(weights),
    )
    assert native.keys() == expected.keys()
    head.load_state_dict(
        {
            k: v.to(device=target.device, dtype=(dtype or v.dtype) if v.is_floating_point() else v.dtype)
            for k, v in native.items()
        },
        assign=True,
    )
    if head_config.draft_vocab_size is not None:  # d2t / t2d: the draft vocabulary, as heads.load_head checks it
        check_d2t_t2d(head.d2t, head.t2d, str(directory))
    return head


def _shape_of(target: CausalLM):
    from mtp_train.export.base import TargetView

    return TargetView.of(target).shape
