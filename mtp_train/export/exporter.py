"""`export_head`: a native head directory -> one serving format, written atomically."""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path

from mtp_train.errors import UserError
from mtp_train.export.common import (
    BLOCK_KEY, CHECKSUMS_KEY, CONFIG_FILENAME, DRAFT_VOCAB_TENSORS, HEAD_CONFIG_FILENAME, WEIGHTS_FILENAME, Target,
    check_out_dir, parse_dtype, write_directory,
)
from mtp_train.export.best_k import SPECULATIVE_KEY, find_measured_k, serving_k
from mtp_train.export.registry import get_format
from mtp_train.fileio import json_bytes, safetensors_bytes
from mtp_train.heads.io import check_finite, head_config_bytes, read_head, sha256_hex

log = logging.getLogger(__name__)


def export_head(head_dir: str | os.PathLike[str], format_name: str, out: str | os.PathLike[str],
                target_dir: str | os.PathLike[str] | None, dtype: str | None = None, overwrite: bool = False,
                num_speculative_tokens: int | None = None, full_vocab: bool = False,
                eval_report: str | os.PathLike[str] | None = None, use_eval_report: bool = True) -> Path:
    """Write the head saved at `head_dir` (by `heads.save_head`) as `format_name` into `out`.

    `target_dir`: the target the head was trained for. Every format needs it: it is checked against the head (hidden
    size, vocabulary, architecture, fingerprint), it supplies the layer config written to config.json, and for
    deepseek-mtp the frozen embed_tokens / lm_head tensors. `dtype`: bfloat16 | float16 | float32 (default: the
    head's stored dtype) for the floating-point tensors; a reduced draft vocabulary's d2t (int64) / t2d (bool) keep
    theirs. The output is built in a temporary sibling directory and renamed into place; config.json's
    `mtp_train.checksums` records the sha256 of every other file (native's head_config.json also records its
    model.safetensors', as `save_head` does). The head is read with `heads.read_head`'s checks (its recorded
    checksum, no NaN/Inf), and the tensors written must be finite too (a cast to float16 can overflow).
    `num_speculative_tokens`: k in the serving arguments a format writes (vllm-mtp's vllm_serve.json / SERVING.md,
    eagle3's speculators_config); None: the eval report's best k by measured speedup, else 3.
    `eval_report`: the head's `mtp-train eval` report.json (or its directory); None: `<head>/../eval/report.json`
    when it measured this head. Its best chain k by measured speedup, with the τ and speedup measured per k, goes
    into config.json's `mtp_train.speculative` (export/best_k.py); without a report nothing is written there and
    the serving k is 3 (the log line says so); `use_eval_report` False ignores any report.
    A head trained with a reduced draft vocabulary is written as a full-vocabulary head (its d2t/t2d dropped: it
    then drafts over the target's whole lm_head) by the formats whose layout has no draft vocabulary (deepseek-mtp,
    vllm-mtp), and by every format with `full_vocab`: its logits over the draft ids are unchanged, the rows it was
    never trained against now compete (on the demo head this moved τ by less than 0.01, docs/export.md);
    config.json's mtp_train block records the dropped size as `full_vocab_from_draft_vocab_size`."""
    fmt = get_format(format_name)
    if num_speculative_tokens is not None and num_speculative_tokens < 1:
        raise UserError(f"--num-speculative-tokens must be >= 1, got {num_speculative_tokens}")
    torch_dtype = parse_dtype(dtype)
    head_dir, out = Path(head_dir), Path(out)
    if target_dir is None:
        needs = "the layer config written to config.json and the check of the head against its target"
        if fmt.frozen:
            needs += ", and the target's embed_tokens / lm_head, which this layout stores"
        raise UserError(f"--target DIR is required for --format {fmt.name}: it supplies {needs}")
    check_out_dir(out, overwrite, [head_dir, Path(target_dir)])

    target = Target.from_directory(target_dir)
    if not head_dir.is_dir():
        raise UserError(f"{head_dir}: head directory not found")
    measured, measured_note = find_measured_k(head_dir, eval_report, use_eval_report)
    num_speculative_tokens, k_source = serving_k(measured, num_speculative_tokens)
    state, head_config = read_head(head_dir, target.config, target.fingerprint)
    full_vocab_from = None
    if head_config.draft_vocab_size is not None and (full_vocab or fmt.draft_vocab is None):
        full_vocab_from = head_config.draft_vocab_size
        head_config = replace(head_config, draft_vocab_size=None)
        state = {name: tensor for name, tensor in state.items() if name not in DRAFT_VOCAB_TENSORS}
        why = "--full-vocab" if full_vocab else f"{fmt.name} has no draft vocabulary: {fmt.no_draft_vocab}"
        log.warning("%s: written as %s drafting over the full vocabulary (%s): the head was trained to draft %d of %d "
                    "tokens and now ranks all of them (the same weights; τ measured in docs/export.md)", head_dir,
                    fmt.name, why, full_vocab_from, head_config.vocab_size)
    reason = fmt.refuse_reason(head_config, target) or fmt.state_refusal(state, head_config)
    if reason:
        raise UserError(f"cannot export {head_dir} ({head_config.kind} head) as {fmt.name}: {reason}")
    stored = {tensor.dtype for tensor in state.values() if tensor.is_floating_point()}
    if torch_dtype is None:
        if len(stored) != 1:
            raise UserError(f"{head_dir / WEIGHTS_FILENAME}: mixed dtypes {sorted(map(str, stored))}; pass --dtype")
        torch_dtype = stored.pop()

    options = {"num_speculative_tokens": num_speculative_tokens, "out_resolved": str(out.resolve())}
    tensors, files = fmt.build(state, head_config, target, torch_dtype, options)
    expected = fmt.expected_tensors(files[CONFIG_FILENAME], out)
    got = {name: tuple(t.shape) for name, t in tensors.items()}
    assert got == expected, f"format {fmt.name} wrote {sorted(got.items())}, its checks expect {sorted(expected.items())}"
    check_finite(tensors, f"export of {head_dir} as {fmt.name} in {str(torch_dtype)[6:]}",
                 "the values do not fit that dtype: export in a wider --dtype (float32 or bfloat16)")

    # Besides JSON, a format may write a ready file (bytes): eagle's SGLang token map.
    config = files.pop(CONFIG_FILENAME)
    if full_vocab_from is not None:
        config[BLOCK_KEY]["full_vocab_from_draft_vocab_size"] = full_vocab_from
    if measured is not None:
        config[BLOCK_KEY][SPECULATIVE_KEY] = measured.block()
    else:
        measured_note += ": config.json records no measured k"
    measured_note += f"; serving k = {num_speculative_tokens} ({k_source})"
    contents = {name: c if isinstance(c, bytes) else json_bytes(c) for name, c in files.items()}
    contents[WEIGHTS_FILENAME] = safetensors_bytes(tensors, {"mtp_train_format": fmt.name, "kind": head_config.kind})
    if HEAD_CONFIG_FILENAME in contents:  # native: loadable by heads.load_head as is, with the weights' checksum
        contents[HEAD_CONFIG_FILENAME] = head_config_bytes(head_config, sha256_hex(contents[WEIGHTS_FILENAME]))
    config[BLOCK_KEY][CHECKSUMS_KEY] = {name: sha256_hex(data) for name, data in sorted(contents.items())}
    contents[CONFIG_FILENAME] = json_bytes(config)
    write_directory(out, contents, overwrite)
    log.info("exported %s head %s as %s to %s (%d tensors); %s", head_config.kind, head_dir, fmt.name, out,
             len(tensors), measured_note)
    return out
