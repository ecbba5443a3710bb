"""Evaluation prompts: MT-bench-format JSONL (`question_id`, `category`, `turns`) or the held-out split of `prepare`.

The package ships three such files (prompt_sets/, origins and licences in its README.md), named by `BUILT_IN_SETS`
wherever a prompts file is taken.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from mtp_train.data.prepared import load_prepared, prompt_before_first_reply
from mtp_train.errors import UserError

PROMPT_SETS_DIR = Path(__file__).parent / "prompt_sets"
BUILT_IN_SETS = ("mt_bench", "humaneval", "gsm8k")  # prompt_sets/<name>.jsonl


def prompts_file(name_or_path: str | Path) -> Path:
    """The JSONL file a prompts setting names: a built-in set's file for its name, else the path itself, which must
    be a file (a UserError otherwise, listing the built-in names)."""
    if str(name_or_path) in BUILT_IN_SETS:
        return PROMPT_SETS_DIR / f"{name_or_path}.jsonl"
    path = Path(name_or_path)
    if not path.is_file():
        raise UserError(f"{name_or_path}: prompts file not found, and not a built-in prompt set "
                        f"({', '.join(BUILT_IN_SETS)}); give one of those names or the path of an MT-bench-format "
                        "JSONL file (question_id, category, turns)")
    return path


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


def load_mt_bench(name_or_path: str | Path, limit: int | None = None) -> PromptSet:
    """The first `limit` usable rows (all with None) of a built-in set or an MT-bench-format JSONL file."""
    path = prompts_file(name_or_path)
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
    source = f"{name_or_path} (built-in prompt set)" if str(name_or_path) in BUILT_IN_SETS else str(path)
    return PromptSet(prompts, source, skipped)


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
