"""Conversation loading: ShareGPT / OpenAI `messages` / MT-bench `turns` rows from JSON, JSONL, HF datasets, parquet.

Every source is read row by row into `Conversation`s with normalized roles (system / user / assistant). A row that
cannot be used raises `RowSkipped` with a stable `reason` (counted per source in `SourceStats`, reported in
stats.json) and a `detail` naming the file and line; with `strict=True` a *malformed* row (bad JSON, unknown role,
wrong types) is a `UserError` instead. Nothing is dropped silently.

Containers (chosen from the path): a directory is an HF `datasets` directory (`load_from_disk`); `*.parquet` is a
parquet file; anything else is JSON: a top-level array of records (read record by record, so a file cut off in the
middle of a record still yields every complete record before the cut) or JSON Lines. JSON is read as UTF-8; a
record holding bytes that are not UTF-8 is an "invalid UTF-8" row (named by file:line, malformed under --strict),
and reading goes on with the next record.

Row schemas (`format`): sharegpt = `conversations: [{from, value} | {role, content}]` (plus optional `system`);
messages = `messages: [{role, content}]` (content a string or a list of `{type: text, text}` parts);
mt_bench = `turns: [str, ...]` (user turns only: prompts, no assistant reply). `auto` detects the schema from the
first record of each file; `hf` means "HF container, schema auto-detected".
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from mtp_train.data.json_array import UNDECODABLE_ERRORS, JsonArrayReader, find_undecodable
from mtp_train.errors import UserError

logger = logging.getLogger(__name__)

Role = Literal["system", "user", "assistant"]
Message = dict[str, str]
"""One chat message: {"role": "system" | "user" | "assistant", "content": str}."""

ROLE_ALIASES: dict[str, Role] = {
    "system": "system",
    **dict.fromkeys(("human", "user"), "user"),
    **dict.fromkeys(("gpt", "chatgpt", "bing", "bard", "assistant", "model"), "assistant"),
}

_FORMAT_KEYS = {"sharegpt": "conversations", "messages": "messages", "mt_bench": "turns"}
_ID_KEYS = ("id", "question_id", "conversation_id", "uid")


@dataclass
class Conversation:
    """A conversation read from a source.

    source_id: stable identifier `<source stem>:<row id>` (the row's own id field, else `#<row index>`); it
    drives the train/eval split and regeneration resume. origin: where the row came from (`file:line`), for
    messages about it. metadata: extra row fields worth keeping (e.g. MT-bench `category`).
    """

    source_id: str
    messages: list[Message]
    origin: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)

    def with_messages(self, messages: list[Message]) -> Conversation:
        """The same conversation (source_id, origin, a copy of the metadata) with other messages."""
        return Conversation(self.source_id, messages, self.origin, dict(self.metadata))


class RowSkipped(Exception):
    """A row that cannot be used.

    reason: short stable category used as the counter key (e.g. "malformed JSON", "unknown role: tool").
    detail: full one-line explanation naming file and row. malformed: bad input (fails under --strict) as opposed
    to a row that is valid but unusable for training (e.g. no assistant turn).
    """

    def __init__(self, reason: str, detail: str, malformed: bool) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
        self.malformed = malformed


@dataclass
class SourceStats:
    """Counters for one source. `skipped` maps reason → rows; `adjusted` maps a fix applied to kept rows → rows."""

    path: str
    format: str = "auto"
    rows_read: int = 0
    kept: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    adjusted: Counter[str] = field(default_factory=Counter)

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "format": self.format,
            "rows_read": self.rows_read,
            "kept": self.kept,
            "skipped": dict(sorted(self.skipped.items())),
            "adjusted": dict(sorted(self.adjusted.items())),
        }


@dataclass
class RawRow:
    """One record of a source before parsing. `record` is None when `error` says why the record is unreadable."""

    index: int
    location: str
    record: Any = None
    error: RowSkipped | None = None


# --------------------------------------------------------------------------------------------------------------------
# Containers
# --------------------------------------------------------------------------------------------------------------------


def _iter_json_array(path: Path) -> Iterator[RawRow]:
    """Records of a top-level JSON array, decoded one at a time (`JsonArrayReader`, reading the file in chunks).

    A record cut off by the end of the file (a truncated download: the file does not end with `]`) ends the
    file with one "truncated JSON record" row, not counted as malformed, so `--strict` still reads such files.
    A malformed record (or a missing comma) ends the file with one "malformed JSON" row: we stop there rather
    than guess where the next record starts. A well-formed record holding bytes that are not UTF-8 is one
    "invalid UTF-8" row (located at the line where the record starts) and reading goes on.
    """
    with path.open(encoding="utf-8", errors=UNDECODABLE_ERRORS) as stream:
        reader = JsonArrayReader(stream, str(path))
        records = 0
        for element in reader:
            location = f"{path}:{element.line}"
            if element.undecodable and element.problem != "cut_off":
                stop = "; stopping here" if element.problem else ""
                detail = f"{location}: record {element.index}: not UTF-8 text ({element.undecodable}){stop}"
                yield RawRow(element.index, location, error=RowSkipped("invalid UTF-8", detail, malformed=True))
                if element.problem:
                    return
                continue
            if not element.problem:
                yield RawRow(element.index, location, record=element.value)
                records += 1
                continue
            cut_off = element.problem == "cut_off"
            if element.problem == "separator":
                detail = f"{path}: line {element.line}: {element.message}"
            else:
                detail = f"{path}: line {element.line}: record {element.index}: {element.message}; stopping here"
            reason = "truncated JSON record" if cut_off else "malformed JSON"
            yield RawRow(element.index, location, error=RowSkipped(reason, detail, malformed=not cut_off))
            return
        if reader.truncated:
            line = reader.locate()[0]
            logger.warning("%s: line %d: the JSON array ends without ']' after %d records", path, line, records)
        if reader.trailing is not None:  # e.g. a second array appended, or JSON Lines whose first row is an array
            line, column, found = reader.trailing
            detail = f"{path}:{line}: text after the closing ']' of the JSON array at column {column} ({found!r}); "
            detail += "a JSON file holds one array (or one object per line: JSON Lines)"
            yield RawRow(records, f"{path}:{line}", error=RowSkipped("malformed JSON", detail, malformed=True))


def _iter_json_lines(path: Path) -> Iterator[RawRow]:
    """Records of a JSON Lines file; blank lines are ignored, a malformed line (bad JSON, or bytes that are not
    UTF-8) is reported with its number."""
    index = 0
    with path.open(encoding="utf-8", errors=UNDECODABLE_ERRORS) as stream:
        for line_number, line in enumerate(stream, start=1):
            if line_number == 1:
                line = line.removeprefix("\ufeff")  # a byte order mark
            if not line.strip():
                continue
            location = f"{path}:{line_number}"
            undecodable = find_undecodable(line)
            if undecodable is not None:
                column, byte = undecodable[0] + 1, undecodable[1]
                detail = f"{location}: not UTF-8 text (byte 0x{byte:02x} at column {column})"
                yield RawRow(index, location, error=RowSkipped("invalid UTF-8", detail, malformed=True))
                index += 1
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                detail = f"{location}: malformed JSON ({err.msg} at column {err.colno})"
                yield RawRow(index, location, error=RowSkipped("malformed JSON", detail, malformed=True))
            else:
                yield RawRow(index, location, record=record)
            index += 1


def _iter_hf_rows(path: Path, split: str | None) -> Iterator[RawRow]:
    """Rows of an HF `datasets` directory (Dataset or DatasetDict) or of a parquet file."""
    if path.is_file():
        import pyarrow.parquet as pq  # local: `mtp-train --help` imports this module (through assets.sharegpt)

        try:
            parquet = pq.ParquetFile(path)
        except Exception as err:  # pyarrow raises several types for non-parquet input
            raise UserError(f"{path}: not a readable parquet file ({err})") from None
        yield from _arrow_rows(path, parquet.iter_batches(batch_size=256))
        return

    import datasets  # local: takes about a second; `mtp-train --help` imports this module (through assets.sharegpt)

    try:
        loaded = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as err:
        raise UserError(f"{path}: not an HF datasets directory saved with save_to_disk ({err})") from None
    if isinstance(loaded, datasets.DatasetDict):
        split_name = split or ("train" if "train" in loaded else None)
        if split_name not in loaded:
            raise UserError(f"{path}: split {split or 'train'!r} not found; set `split:` to one of {list(loaded)}")
        loaded = loaded[split_name]
    yield from _arrow_rows(path, loaded.with_format("arrow").iter(batch_size=256))


def _arrow_rows(path: Path, batches: Iterator[Any]) -> Iterator[RawRow]:
    """The rows of Arrow record batches (or tables) as RawRows named `<path> row <index>`.

    Arrow strings must be UTF-8, and the usual writers check that, but a file from a writer that does not holds
    bytes that fail only when a row is converted: such a row is an "invalid UTF-8" row, the others are kept.
    """
    index = 0
    for batch in batches:
        try:
            records = batch.to_pylist()
        except UnicodeDecodeError:  # find the bad rows one by one
            records = None
        for offset in range(batch.num_rows):
            row = RawRow(index, f"{path} row {index}")
            if records is not None:
                row.record = records[offset]
            else:
                try:
                    row.record = batch.slice(offset, 1).to_pylist()[0]
                except UnicodeDecodeError as err:
                    detail = f"{row.location}: not UTF-8 text (byte 0x{err.object[err.start]:02x} in a string value)"
                    row.error = RowSkipped("invalid UTF-8", detail, malformed=True)
            yield row
            index += 1


def iter_raw_rows(path: str | Path, split: str | None = None) -> Iterator[RawRow]:
    """Every record of a source file or directory, in order (see the module docstring for the containers)."""
    source_path = Path(path)
    if not source_path.exists():
        raise UserError(f"{source_path}: data source not found")
    if is_hf_container(source_path):
        yield from _iter_hf_rows(source_path, split)
        return
    with source_path.open(encoding="utf-8", errors=UNDECODABLE_ERRORS) as stream:
        first_chars = stream.read(4096).lstrip().removeprefix("\ufeff").lstrip()
        whole_file_read = not stream.read(1)
    if not first_chars and whole_file_read:
        raise UserError(f"{source_path}: the file is empty (no JSON records); fetch it again or remove the source")
    if first_chars.startswith("["):
        yield from _iter_json_array(source_path)
    else:
        yield from _iter_json_lines(source_path)


def is_hf_container(path: str | Path) -> bool:
    """Whether `path` is read as an HF dataset (a directory or a parquet file) rather than JSON."""
    source_path = Path(path)
    return source_path.is_dir() or source_path.suffix == ".parquet"


# --------------------------------------------------------------------------------------------------------------------
# Rows → conversations
# --------------------------------------------------------------------------------------------------------------------


def normalize_role(role: Any, location: str) -> Role:
    """Map a source role name onto system / user / assistant; anything else is a malformed row."""
    name = role.strip().lower() if isinstance(role, str) else role
    normalized = ROLE_ALIASES.get(name) if isinstance(name, str) else None
    if normalized is None:
        raise RowSkipped(f"unknown role: {role}", f"{location}: unknown role {role!r}", malformed=True)
    return normalized


def _content_text(content: Any, location: str, message_index: int) -> str:
    """A message's text: a string, or the concatenated text parts of an OpenAI-style content list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(part, dict) for part in content):
        if any(part.get("type", "text") != "text" for part in content):
            detail = f"{location}: message {message_index} has non-text content parts"
            raise RowSkipped("non-text content", detail, malformed=False)
        texts = [part.get("text") for part in content]
        if all(isinstance(text, str) for text in texts):
            return "".join(texts)  # type: ignore[arg-type]
    detail = f"{location}: message {message_index}: expected string content, got {type(content).__name__}"
    raise RowSkipped("bad message", detail, malformed=True)


def _parse_messages(entries: Any, key: str, location: str) -> list[Message]:
    if not isinstance(entries, list):
        detail = f"{location}: `{key}` should be a list of messages, got {type(entries).__name__}"
        raise RowSkipped("bad message", detail, malformed=True)
    messages: list[Message] = []
    for message_index, entry in enumerate(entries):
        if not isinstance(entry, dict):
            detail = f"{location}: message {message_index} should be an object, got {type(entry).__name__}"
            raise RowSkipped("bad message", detail, malformed=True)
        if "from" in entry or "value" in entry:
            role, content = entry.get("from"), entry.get("value")
        else:
            role, content = entry.get("role"), entry.get("content")
        if role is None:
            detail = f"{location}: message {message_index} has no `from`/`role`"
            raise RowSkipped("bad message", detail, malformed=True)
        messages.append(
            {"role": normalize_role(role, location), "content": _content_text(content, location, message_index)}
        )
    return messages


def parse_row(record: Any, row_format: str, source_name: str, row: RawRow) -> Conversation:
    """One parsed record → a Conversation (roles normalized, nothing else changed). Raises RowSkipped."""
    location = row.location
    if not isinstance(record, dict):
        detail = f"{location}: expected a JSON object per row, got {type(record).__name__}"
        raise RowSkipped("row is not an object", detail, malformed=True)
    key = _FORMAT_KEYS[row_format]
    if key not in record:
        detail = f"{location}: missing `{key}` (expected {row_format} rows)"
        raise RowSkipped(f"missing key: {key}", detail, malformed=True)

    if row_format == "mt_bench":
        turns = record[key]
        if not isinstance(turns, list) or not all(isinstance(turn, str) for turn in turns):
            detail = f"{location}: `turns` should be a list of strings"
            raise RowSkipped("bad message", detail, malformed=True)
        messages: list[Message] = [{"role": "user", "content": turn} for turn in turns]
    else:
        messages = _parse_messages(record[key], key, location)
        system_text = record.get("system")
        if row_format == "sharegpt" and isinstance(system_text, str) and system_text.strip():
            if not messages or messages[0]["role"] != "system":
                messages.insert(0, {"role": "system", "content": system_text})

    row_id = next((record[k] for k in _ID_KEYS if isinstance(record.get(k), (str, int))), None)
    source_id = f"{source_name}:{row_id}" if row_id is not None else f"{source_name}:#{row.index}"
    metadata = {k: record[k] for k in ("category",) if isinstance(record.get(k), str)}
    return Conversation(source_id=source_id, messages=messages, origin=location, metadata=metadata)


def iter_conversations(
    path: str | Path,
    row_format: str = "auto",
    *,
    stats: SourceStats | None = None,
    strict: bool = False,
    split: str | None = None,
    limit: int | None = None,
) -> Iterator[Conversation]:
    """Parsed conversations of one source, in file order.

    Skipped rows are counted in `stats.skipped` (malformed ones raise UserError when `strict`); `stats.rows_read`
    counts every record seen. `limit` caps the records read. Conversations are returned as written in the source
    (roles normalized only); training-specific cleanup is `normalize_for_training`.
    """
    source_path = Path(path)
    if row_format == "hf" and not is_hf_container(source_path):
        raise UserError(f"{source_path}: format 'hf' needs an HF datasets directory or a .parquet file")
    stats = stats if stats is not None else SourceStats(path=str(path))
    source_name = source_path.name if source_path.is_dir() else source_path.stem  # the prefix of source ids
    resolved_format = None if row_format in ("auto", "hf") else row_format
    for row in iter_raw_rows(source_path, split):
        if limit is not None and stats.rows_read >= limit:
            return
        stats.rows_read += 1
        try:
            if row.error is not None:
                raise row.error
            if not isinstance(row.record, dict):  # skipped before format detection, which needs an object's keys
                detail = f"{row.location}: expected a JSON object per row, got {type(row.record).__name__}"
                raise RowSkipped("row is not an object", detail, malformed=True)
            if resolved_format is None:
                resolved_format = next((fmt for fmt, key in _FORMAT_KEYS.items() if key in row.record), None)
                if resolved_format is None:
                    keys = sorted(row.record)
                    raise UserError(
                        f"{row.location}: cannot detect the row format from keys {keys}; expected one of "
                        "`conversations` (sharegpt), `messages`, `turns` (mt_bench), or set `format:` on the source"
                    )
                stats.format = resolved_format
            yield parse_row(row.record, resolved_format, source_name, row)
        except RowSkipped as skipped:
            record_skip(stats, skipped, strict)


def record_skip(stats: SourceStats, skipped: RowSkipped, strict: bool) -> None:
    """Count a skipped row (logging the first few of each reason); under `strict`, a malformed row is a UserError."""
    if strict and skipped.malformed:
        raise UserError(f"{skipped.detail} (--strict)")
    stats.skipped[skipped.reason] += 1
    if stats.skipped[skipped.reason] <= 3:
        logger.warning("skipped: %s", skipped.detail)


def read_conversations(
    path: str | Path, row_format: str = "auto", *, strict: bool = False, limit: int | None = None
) -> tuple[list[Conversation], SourceStats]:
    """All conversations of one source plus its stats (e.g. MT-bench prompts for evaluation)."""
    stats = SourceStats(path=str(path), format=row_format)
    conversations = list(iter_conversations(path, row_format, stats=stats, strict=strict, limit=limit))
    stats.kept = len(conversations)
    return conversations, stats


# --------------------------------------------------------------------------------------------------------------------
# Training cleanup
# --------------------------------------------------------------------------------------------------------------------


def normalize_for_training(
    conversation: Conversation,
    stats: SourceStats,
    *,
    system_mode: str = "keep",
    system_text: str | None = None,
) -> Conversation:
    """Shape a conversation for assistant-only training; raises RowSkipped when nothing trainable remains.

    Applies the recipe's system-prompt policy (keep / drop / default / override), drops empty system messages,
    drops assistant turns before the first user turn (the conversation then starts at a user turn), cuts the
    conversation before its first empty user/assistant message, and drops user turns after the last assistant turn
    (they carry no loss). Each change is counted in `stats.adjusted`.
    """
    location = conversation.origin or conversation.source_id
    messages = [dict(message) for message in conversation.messages]
    if not messages:
        raise RowSkipped("empty conversation", f"{location}: no messages", malformed=False)

    if any(m["role"] == "system" and not m["content"].strip() for m in messages):
        messages = [m for m in messages if not (m["role"] == "system" and not m["content"].strip())]
        stats.adjusted["empty system message dropped"] += 1
    if system_mode == "drop" and any(m["role"] == "system" for m in messages):
        messages = [m for m in messages if m["role"] != "system"]
        stats.adjusted["system message dropped"] += 1
    elif system_mode == "override":
        messages = [{"role": "system", "content": system_text or ""}] + [m for m in messages if m["role"] != "system"]
        stats.adjusted["system message set"] += 1
    elif system_mode == "default" and (not messages or messages[0]["role"] != "system"):
        messages.insert(0, {"role": "system", "content": system_text or ""})
        stats.adjusted["system message set"] += 1

    leading_system = 0
    while leading_system < len(messages) and messages[leading_system]["role"] == "system":
        leading_system += 1
    first_user = next((i for i in range(leading_system, len(messages)) if messages[i]["role"] == "user"), None)
    if first_user is None:
        reason = "no user turn" if any(m["role"] == "assistant" for m in messages) else "empty conversation"
        raise RowSkipped(reason, f"{location}: no user turn", malformed=False)
    if first_user > leading_system:
        messages = messages[:leading_system] + messages[first_user:]
        stats.adjusted["leading assistant turns dropped"] += 1

    first_empty = next((i for i, m in enumerate(messages) if m["role"] != "system" and not m["content"].strip()), None)
    if first_empty is not None:
        # Keep the turns before the first empty message (an empty user turn has no meaningful reply after it).
        empty_role = messages[first_empty]["role"]
        messages = messages[:first_empty]
        if not any(m["role"] == "assistant" for m in messages):
            detail = f"{location}: message {first_empty} ({empty_role}) is empty and no complete turn precedes it"
            raise RowSkipped(f"empty {empty_role} message", detail, malformed=False)
        stats.adjusted["cut at an empty message"] += 1

    last_assistant = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last_assistant is None:
        raise RowSkipped("no assistant turn", f"{location}: no assistant turn", malformed=False)
    if last_assistant < len(messages) - 1:
        messages = messages[: last_assistant + 1]
        stats.adjusted["trailing user turns dropped"] += 1
    return conversation.with_messages(messages)
