"""Evaluation prompts: MT-bench-format JSONL (`question_id`, `category`, `turns`) or the held-out split of `prepare`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from mtp_train.data.prepared import load_prepared, prompt_before_first_reply
from mtp_train.errors import UserError


@dataclass
class EvalPrompt:
    question_id: str
    category: str
    turns: list[str] = field(default_factory=list)  # user turns, run one after another with the model's own answers
    prompt_ids: list[int] | None = None  # a ready token prompt (held-out split) instead of turns


@dataclass
class PromptSet:
    prompts: list[EvalPrompt]
    source: str
    skipped: list[str] = field(default_factory=list)  # "file:line: reason"


def load_mt_bench(path: str | Path, limit: int | None = None) -> PromptSet:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: prompts file not found (expected MT-bench-format JSONL: question_id, category, turns)")
    prompts, skipped = [], []
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            skipped.append(f"{path}:{line_no}: invalid JSON ({err.msg})")
            continue
        turns = row.get("turns") if isinstance(row, dict) else None
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
            skipped.append(f"{path}:{line_no}: no 'turns' list of non-empty strings")
            continue
        prompts.append(EvalPrompt(str(row.get("question_id", line_no)), str(row.get("category", "default")), turns))
        if limit and len(prompts) >= limit:
            break
    if not prompts:
        raise UserError(f"{path}: no usable prompts ({len(skipped)} row(s) skipped, e.g. {skipped[:1]})")
    return PromptSet(prompts, str(path), skipped)


def load_heldout(prepared_dir: str | Path, limit: int | None = None) -> PromptSet:
    """First prompt of each held-out conversation (ending with the generation header), as token ids."""
    prepared = load_prepared(prepared_dir)
    prompts, skipped = [], []
    for row in prepared.eval:
        ids = prompt_before_first_reply(row["input_ids"], row["loss_mask"])
        if len(ids) == len(row["input_ids"]):
            skipped.append(f"{row['source_id']}: no assistant reply")
            continue
        prompts.append(EvalPrompt(row["source_id"], "held-out", prompt_ids=ids))
        if limit and len(prompts) >= limit:
            break
    if not prompts:
        raise UserError(f"{prepared_dir}: the eval split has no usable prompts; raise data.eval_fraction")
    return PromptSet(prompts, f"{prepared_dir} (eval split)", skipped)
