"""Self-distillation: replace every assistant turn of a conversation by the target's own reply.

The generation itself is a `GenerateFn` supplied by the caller (the CLI builds one from `mtp_train.runtime`; tests
pass a fake), so this module only schedules it: conversations are processed in batches, turn by turn (the reply to
user turn k is generated from the conversation with the *regenerated* replies 1..k-1), and every finished
conversation is appended to a JSONL progress file. A run that stops (crash, Ctrl-C) resumes from that file: finished
`source_id`s are not generated again.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from mtp_train.data.conversations import Conversation, Message
from mtp_train.fileio import atomic_write_text

logger = logging.getLogger(__name__)

GenerateFn = Callable[[list[list[Message]]], list[str]]
"""Given a batch of conversations that each end with a user turn, return one assistant reply text per conversation.
A reply cut off by max_new_tokens is returned as is (the chat template still closes the turn)."""


@dataclass
class RegenerationStats:
    """How many conversations were generated in this run, and how many were taken from the progress file."""

    generated: int = 0
    resumed: int = 0
    replies: int = 0


def load_finished(progress_path: Path) -> dict[str, list[Message]]:
    """source_id → regenerated messages from a progress file (missing file = nothing finished).

    A last line cut off by a crash is dropped and the file is truncated to its last complete line, so appending
    continues cleanly; that conversation is simply generated again.
    """
    finished: dict[str, list[Message]] = {}
    if not progress_path.exists():
        return finished
    good_bytes = 0
    with progress_path.open("rb") as stream:
        for line_number, raw_line in enumerate(stream, start=1):
            try:
                if not raw_line.endswith(b"\n"):
                    raise ValueError("incomplete last line")
                record = json.loads(raw_line)
                finished[str(record["source_id"])] = list(record["messages"])
            except (ValueError, KeyError, TypeError) as err:
                logger.warning("%s:%d: unreadable progress line dropped (%s)", progress_path, line_number, err)
                continue
            good_bytes += len(raw_line)
    if good_bytes != progress_path.stat().st_size:
        records = ({"source_id": source_id, "messages": messages} for source_id, messages in finished.items())
        atomic_write_text(progress_path, "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records))
    return finished


def _regenerate_batch(
    batch: list[Conversation], generate_fn: GenerateFn, stats: RegenerationStats
) -> list[Conversation]:
    """Regenerate every assistant turn of a batch: one generate_fn call per turn depth across the batch."""
    # The rebuilt conversations, growing turn by turn; `cursors` = index of the next original message to copy.
    rebuilt: list[list[Message]] = [[] for _ in batch]
    cursors = [0] * len(batch)
    while True:
        waiting: list[int] = []  # conversations whose next message is an assistant turn
        for slot, conversation in enumerate(batch):
            messages = conversation.messages
            while cursors[slot] < len(messages) and messages[cursors[slot]]["role"] != "assistant":
                rebuilt[slot].append(dict(messages[cursors[slot]]))
                cursors[slot] += 1
            if cursors[slot] < len(messages):
                waiting.append(slot)
        if not waiting:
            break
        replies = generate_fn([list(rebuilt[slot]) for slot in waiting])
        if len(replies) != len(waiting):
            raise ValueError(f"generate_fn returned {len(replies)} replies for {len(waiting)} conversations")
        for slot, reply in zip(waiting, replies):
            rebuilt[slot].append({"role": "assistant", "content": reply})
            cursors[slot] += 1
        stats.replies += len(waiting)
    return [conversation.with_messages(messages) for conversation, messages in zip(batch, rebuilt)]


def _first_turns(conversation: Conversation, max_turns: int) -> Conversation:
    """The conversation up to (not including) its (max_turns+1)-th user message."""
    user_turns = [index for index, message in enumerate(conversation.messages) if message["role"] == "user"]
    if len(user_turns) <= max_turns:
        return conversation
    return conversation.with_messages(conversation.messages[: user_turns[max_turns]])


def regenerate_conversations(
    conversations: Iterable[Conversation],
    generate_fn: GenerateFn,
    progress_path: str | Path,
    *,
    batch_size: int = 8,
    stats: RegenerationStats | None = None,
    max_turns: int | None = None,
) -> Iterator[Conversation]:
    """The input conversations, in order, with every assistant turn replaced by a `generate_fn` reply.

    Conversations whose `source_id` is already in `progress_path` come from there without calling `generate_fn`;
    each newly finished batch is appended (and fsynced) before it is yielded. The input is consumed lazily, at most
    `batch_size` conversations ahead of what has been yielded. `max_turns`: cut each conversation before its
    (max_turns+1)-th user turn first (fewer, shorter generations per conversation).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    progress_file = Path(progress_path)
    progress_file.parent.mkdir(parents=True, exist_ok=True)
    stats = stats if stats is not None else RegenerationStats()
    finished = load_finished(progress_file)
    if finished:
        logger.info("regeneration: resuming, %d conversations already finished in %s", len(finished), progress_file)

    # Conversations in input order; the ones still to generate are collected until a batch is full.
    pending: list[Conversation] = []
    to_generate: list[Conversation] = []

    def flush() -> Iterator[Conversation]:
        regenerated_by_input = {}
        if to_generate:
            results = _regenerate_batch(to_generate, generate_fn, stats)
            with progress_file.open("a", encoding="utf-8") as stream:
                for conversation in results:
                    record = {"source_id": conversation.source_id, "messages": conversation.messages}
                    stream.write(json.dumps(record, ensure_ascii=False) + "\n")
                stream.flush()
                os.fsync(stream.fileno())
            stats.generated += len(results)
            regenerated_by_input = {id(original): result for original, result in zip(to_generate, results)}
        for conversation in pending:
            yield regenerated_by_input.get(id(conversation), conversation)
        pending.clear()
        to_generate.clear()

    for conversation in conversations:
        if max_turns is not None:
            conversation = _first_turns(conversation, max_turns)
        done_messages = finished.get(conversation.source_id)
        if done_messages is not None:
            stats.resumed += 1
            resumed = conversation.with_messages(done_messages)
            if pending:
                pending.append(resumed)  # keep input order behind conversations still waiting for generation
            else:
                yield resumed
            continue
        pending.append(conversation)
        to_generate.append(conversation)
        if len(to_generate) >= batch_size:
            yield from flush()
    yield from flush()
