"""`load_any_head`: the one loader of draft heads. Any exported format, or a trainer's `head/` directory, back into a
`DraftHead` over a loaded target.

An export is first checked like `mtp-train inspect --target` (names, shapes, config fields, target), then its
tensors are mapped back to DraftHead's names and checked as `heads.io.load_head` checks a native head, and last its
integrity (the sha256 recorded at export, no NaN/Inf weights) as `inspect` reports it. Frozen tensors
stored in the file (deepseek-mtp's embed_tokens and shared_head.head) must equal the target's; the head itself always
reads the target's own."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from mtp_train.errors import UserError
from mtp_train.export.common import CONFIG_FILENAME, HEAD_CONFIG_FILENAME, WEIGHTS_FILENAME
from mtp_train.export.inspection import inspect_dir
from mtp_train.export.registry import FORMATS
from mtp_train.fileio import recover_replaced_directory
from mtp_train.heads.draft_head import DraftHead
from mtp_train.heads.io import build_head, check_head_state, check_target, load_head, read_safetensors
from mtp_train.heads.vocab import ids_from_d2t
from mtp_train.runtime.decode_runner import head_runner
from mtp_train.runtime.loader import load_model, load_tokenizer
from mtp_train.runtime.model import CausalLM

log = logging.getLogger(__name__)


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


def load_any_head(directory: str | os.PathLike[str], target: CausalLM, dtype: torch.dtype | None = None) -> DraftHead:
    """Load the head at `directory` (a trainer's `head/` or any exported format) over `target`, on its device, in `dtype`
    (default: for an export the dtype stored in the file, so a round trip reproduces the original head bit for bit;
    for a `head/` directory the target's, as `load_head`; d2t/t2d of a reduced draft vocabulary keep int64/bool)."""
    directory = Path(directory)
    recover_replaced_directory(directory)  # an export replaced by a run killed between its renames: the old one back
    if (directory / HEAD_CONFIG_FILENAME).is_file() and not (directory / CONFIG_FILENAME).is_file():
        return load_head(directory, target, dtype=dtype)  # a trainer's head/ dir (save_head output)
    report = inspect_dir(directory, target)
    if report.problems:
        raise UserError(
            f"{directory}: not a loadable {report.format or 'export'} for this target: " + "; ".join(report.problems)
        )
    weights = directory / WEIGHTS_FILENAME
    native, head_config, frozen = FORMATS[report.format].to_native(read_safetensors(weights), report.config, directory)
    check_target(head_config, target.config, target.fingerprint, str(directory / CONFIG_FILENAME))
    own = {"embed_tokens": target.model.embed_tokens.weight, "lm_head": target.lm_head.weight}
    if "d2t" in native and "lm_head" in frozen:  # eagle3 stores only the draft vocabulary's rows of the lm_head
        own["lm_head"] = own["lm_head"][ids_from_d2t(native["d2t"]).to(own["lm_head"].device)]
    for key, stored in frozen.items():
        if not _same_values(stored, own[key]):
            raise UserError(
                f"{weights}: the stored {key} differs from the target's (exported for a different target, or the "
                "target's weights changed)"
            )
    check_head_state(native, head_config, target.config, str(weights))
    if report.integrity:  # after the structural checks, as for a native head (heads.io.read_head)
        raise UserError(f"{directory}: not loadable: " + "; ".join(report.integrity))
    if not report.checksum.startswith("checksum ok"):
        log.warning("%s: %s", directory, report.checksum)
    return build_head(target, head_config, native, dtype)


def load_draft(target: CausalLM, tokenizer, precision, head: str | None = None, draft_model: str | None = None,
               head_decode_dtype: str = "auto"):
    """The draft of speculative decoding over `target` (loaded with `precision`): the head at `head` (a trainer's
    head/ or any export format) as a `HeadRunner`, its weights in the target's compute dtype and its draft steps reading
    the decode weights `head_decode_dtype` names (`decode_runner.head_runner`; the name is kept in its
    `decode_weights`), or the smaller model at `draft_model`, which must share the target's tokenizer."""
    if head:
        return head_runner(load_any_head(head, target, dtype=target.dtype), precision, head_decode_dtype)
    target_vocab, draft_vocab = tokenizer.get_vocab(), load_tokenizer(draft_model).get_vocab()
    if target_vocab != draft_vocab:
        differing = len(set(target_vocab.items()) ^ set(draft_vocab.items()))
        raise UserError(
            f"--draft {draft_model}: its tokenizer differs from the target's: {len(draft_vocab)} vs "
            f"{len(target_vocab)} tokens, {differing} (token, id) pair(s) differ; a draft model must share the "
            "target's tokenizer"
        )
    return load_model(draft_model, device=target.device, precision=precision)
