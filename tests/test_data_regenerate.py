"""Self-distillation scheduling with a fake generate_fn: turn-by-turn context, batching, order, resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mtp_train.data.conversations import Conversation, Message
from mtp_train.data.regenerate import RegenerationStats, load_finished, regenerate_conversations


def make_conversation(source_id: str, user_turns: int, system: bool = False) -> Conversation:
    messages: list[Message] = [{"role": "system", "content": "sys"}] if system else []
    for turn in range(user_turns):
        messages.append({"role": "user", "content": f"{source_id} q{turn}"})
        messages.append({"role": "assistant", "content": f"original {turn}"})
    return Conversation(source_id, messages, origin=f"file:{source_id}")


class FakeGenerator:
    """Replies with a description of what it was given; can be told to fail after some calls."""

    def __init__(self, fail_after_calls: int | None = None) -> None:
        self.calls: list[list[list[Message]]] = []
        self.fail_after_calls = fail_after_calls

    def __call__(self, batch: list[list[Message]]) -> list[str]:
        if self.fail_after_calls is not None and len(self.calls) >= self.fail_after_calls:
            raise RuntimeError("simulated crash")
        self.calls.append([list(messages) for messages in batch])
        return [f"reply to {messages[-1]['content']} after {len(messages)} messages" for messages in batch]

    def prompted_ids(self) -> set[str]:
        return {messages[-1]["content"].split()[0] for batch in self.calls for messages in batch}


def test_every_assistant_turn_is_replaced_with_regenerated_context(tmp_path: Path) -> None:
    conversations = [make_conversation("a", 1), make_conversation("b", 3, system=True), make_conversation("c", 2)]
    generate = FakeGenerator()
    stats = RegenerationStats()
    result = list(
        regenerate_conversations(conversations, generate, tmp_path / "progress.jsonl", batch_size=8, stats=stats)
    )

    assert [c.source_id for c in result] == ["a", "b", "c"]
    b = result[1]
    assert [m["role"] for m in b.messages] == ["system", "user", "assistant", "user", "assistant", "user", "assistant"]
    assert b.messages[2]["content"] == "reply to b q0 after 2 messages"
    assert b.messages[6]["content"] == "reply to b q2 after 6 messages"
    assert not any("original" in m["content"] for c in result for m in c.messages)
    # One call per turn depth across the batch: depth 0 has a, b, c; depth 1 has b, c; depth 2 has b.
    assert [len(batch) for batch in generate.calls] == [3, 2, 1]
    # The context of a later turn holds the regenerated (not the original) earlier reply.
    depth_two_prompt = generate.calls[2][0]
    assert depth_two_prompt[2]["content"] == "reply to b q0 after 2 messages"
    assert stats.generated == 3 and stats.resumed == 0 and stats.replies == 6
    # Inputs are left untouched.
    assert conversations[1].messages[2]["content"] == "original 0"


def test_resume_after_a_crash_does_not_redo_finished_ids(tmp_path: Path) -> None:
    progress = tmp_path / "work" / "progress.jsonl"
    conversations = [make_conversation(f"id{i}", 2) for i in range(7)]

    crashing = FakeGenerator(fail_after_calls=4)  # batches of 3 need 2 calls each: 2 batches finish, then crash
    finished_before_crash = []
    with pytest.raises(RuntimeError, match="simulated crash"):
        for conversation in regenerate_conversations(conversations, crashing, progress, batch_size=3):
            finished_before_crash.append(conversation.source_id)
    assert finished_before_crash == [f"id{i}" for i in range(6)]
    assert set(load_finished(progress)) == {f"id{i}" for i in range(6)}

    resumed = FakeGenerator()
    stats = RegenerationStats()
    result = list(regenerate_conversations(conversations, resumed, progress, batch_size=3, stats=stats))
    assert [c.source_id for c in result] == [f"id{i}" for i in range(7)]
    assert resumed.prompted_ids() == {"id6"}  # only the unfinished one is generated again
    assert stats.resumed == 6 and stats.generated == 1
    assert result[0].messages[1]["content"] == "reply to id0 q0 after 1 messages"  # taken from the progress file
    assert len(progress.read_text(encoding="utf-8").splitlines()) == 7

    third = FakeGenerator()
    assert len(list(regenerate_conversations(conversations, third, progress, batch_size=3))) == 7
    assert third.calls == []


def test_a_line_cut_by_a_crash_is_dropped_and_regenerated(tmp_path: Path) -> None:
    progress = tmp_path / "progress.jsonl"
    good = {"source_id": "x", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "r"}]}
    progress.write_text(json.dumps(good) + "\n" + '{"source_id": "y", "messa', encoding="utf-8")
    assert set(load_finished(progress)) == {"x"}
    assert progress.read_text(encoding="utf-8") == json.dumps(good) + "\n"  # truncated to the last complete line

    generate = FakeGenerator()
    conversations = [make_conversation("x", 1), make_conversation("y", 1)]
    result = list(regenerate_conversations(conversations, generate, progress, batch_size=2))
    assert generate.prompted_ids() == {"y"}
    assert result[0].messages[1]["content"] == "r"
    assert set(load_finished(progress)) == {"x", "y"}


def test_order_is_kept_when_resumed_and_new_conversations_interleave(tmp_path: Path) -> None:
    progress = tmp_path / "progress.jsonl"
    conversations = [make_conversation(f"c{i}", 1) for i in range(5)]
    list(regenerate_conversations([conversations[1], conversations[3]], FakeGenerator(), progress, batch_size=2))
    generate = FakeGenerator()
    result = list(regenerate_conversations(conversations, generate, progress, batch_size=2))
    assert [c.source_id for c in result] == [f"c{i}" for i in range(5)]
    assert generate.prompted_ids() == {"c0", "c2", "c4"}


def test_generate_fn_returning_the_wrong_number_of_replies_is_an_error(tmp_path: Path) -> None:
    def broken(batch: list[list[Message]]) -> list[str]:
        return ["only one"]

    with pytest.raises(ValueError, match="returned 1 replies for 2 conversations"):
        list(
            regenerate_conversations(
                [make_conversation("a", 1), make_conversation("b", 1)], broken, tmp_path / "p.jsonl"
            )
        )


def test_max_turns_keeps_only_the_first_user_turns(tmp_path: Path) -> None:
    conversations = [make_conversation("a", 1), make_conversation("b", 3, system=True)]
    generate = FakeGenerator()
    result = list(regenerate_conversations(conversations, generate, tmp_path / "p.jsonl", batch_size=8, max_turns=1))
    assert [m["role"] for m in result[1].messages] == ["system", "user", "assistant"]
    assert result[1].messages[2]["content"] == "reply to b q0 after 2 messages"
    assert [len(batch) for batch in generate.calls] == [2]  # one generation depth only
