"""Conversation loaders: formats, containers, role normalization, skip accounting, training cleanup."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from mtp_train.data import json_array
from mtp_train.data.conversations import (
    Conversation,
    RowSkipped,
    SourceStats,
    iter_conversations,
    normalize_for_training,
    read_conversations,
)
from mtp_train.errors import UserError
from mtp_train.evaluate.prompts import prompts_file
from tests.conftest_data import sharegpt_row, write_jsonl

MT_BENCH = prompts_file("mt_bench")  # the built-in set the package ships


def roles_and_texts(conversation: Conversation) -> list[tuple[str, str]]:
    return [(message["role"], message["content"]) for message in conversation.messages]


def test_sharegpt_json_array_from_value_with_role_aliases(tmp_path: Path) -> None:
    rows = [
        sharegpt_row("a", ("human", "Hi"), ("gpt", "Hello")),
        sharegpt_row("b", ("user", "Q"), ("chatgpt", "A1"), ("human", "Q2"), ("bing", "A2")),
        sharegpt_row("c", ("Human", "Q"), ("bard", "A"), system="Be nice."),
        {"conversations": [{"role": "user", "content": "x"}, {"role": "model", "content": "y"}]},
    ]
    path = tmp_path / "chats.json"
    path.write_text(json.dumps(rows, indent=2), encoding="utf-8")
    conversations, stats = read_conversations(path)
    assert stats.format == "sharegpt" and stats.rows_read == 4 and not stats.skipped
    assert [c.source_id for c in conversations] == ["chats:a", "chats:b", "chats:c", "chats:#3"]
    assert roles_and_texts(conversations[0]) == [("user", "Hi"), ("assistant", "Hello")]
    assert [m["role"] for m in conversations[1].messages] == ["user", "assistant", "user", "assistant"]
    assert roles_and_texts(conversations[2])[0] == ("system", "Be nice.")
    assert roles_and_texts(conversations[3]) == [("user", "x"), ("assistant", "y")]
    assert conversations[1].origin.startswith(f"{path}:")


def test_messages_jsonl_with_text_parts_and_mt_bench_turns(tmp_path: Path) -> None:
    messages_path = write_jsonl(
        tmp_path / "msgs.jsonl",
        [
            {
                "id": 7,
                "messages": [
                    {"role": "system", "content": "S"},
                    {"role": "user", "content": "U"},
                    {"role": "assistant", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]},
                ],
            },
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
        ],
    )
    conversations, stats = read_conversations(messages_path)
    assert stats.format == "messages"
    assert [c.source_id for c in conversations] == ["msgs:7"]
    assert roles_and_texts(conversations[0]) == [("system", "S"), ("user", "U"), ("assistant", "AB")]
    assert stats.skipped == {"non-text content": 1}

    bench_path = write_jsonl(
        tmp_path / "bench.jsonl", [{"question_id": 81, "category": "writing", "turns": ["T1", "T2"]}]
    )
    (prompt,), bench_stats = read_conversations(bench_path)
    assert bench_stats.format == "mt_bench"
    assert prompt.source_id == "bench:81" and prompt.metadata == {"category": "writing"}
    assert roles_and_texts(prompt) == [("user", "T1"), ("user", "T2")]


def test_real_mt_bench_file_reads_as_prompts() -> None:
    prompts, stats = read_conversations(MT_BENCH)
    assert stats.format == "mt_bench" and not stats.skipped and len(prompts) == stats.rows_read > 0
    assert all(m["role"] == "user" for prompt in prompts for m in prompt.messages)
    # For training they are unusable: no assistant turn, counted as such.
    training_stats = SourceStats(path=str(MT_BENCH))
    with pytest.raises(RowSkipped) as caught:
        normalize_for_training(prompts[0], training_stats)
    assert caught.value.reason == "no assistant turn" and not caught.value.malformed


def test_unknown_role_and_malformed_lines_are_counted_with_locations(tmp_path: Path, caplog) -> None:
    path = write_jsonl(
        tmp_path / "mixed.jsonl",
        [
            sharegpt_row("ok1", ("human", "Q"), ("gpt", "A")),
            '{"id": "broken", "conversations": [',
            sharegpt_row("tool", ("human", "Q"), ("tool", "result")),
            sharegpt_row("ok2", ("human", "Q"), ("gpt", "A")),
            "[1, 2]",
            {"id": "nolist", "conversations": "text"},
            {"id": "norole", "conversations": [{"value": "v"}]},
            {"id": "nonstring", "conversations": [{"from": "human", "value": 5}]},
            {"id": "other", "messages": []},
        ],
    )
    stats = SourceStats(path=str(path))
    kept = list(iter_conversations(path, stats=stats))
    assert [c.source_id for c in kept] == ["mixed:ok1", "mixed:ok2"]
    assert stats.rows_read == 9
    assert stats.skipped == {
        "malformed JSON": 1,
        "unknown role: tool": 1,
        "row is not an object": 1,
        "bad message": 3,
        "missing key: conversations": 1,
    }
    assert f"{path}:2: malformed JSON" in caplog.text
    assert f"{path}:3: unknown role 'tool'" in caplog.text

    with pytest.raises(UserError, match=rf"{path}:2: malformed JSON .*\(--strict\)"):
        list(iter_conversations(path, strict=True))


def test_strict_fails_on_unknown_role(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "roles.jsonl", [sharegpt_row("x", ("human", "Q"), ("narrator", "A"))])
    with pytest.raises(UserError, match=rf"{path}:1: unknown role 'narrator' \(--strict\)"):
        list(iter_conversations(path, strict=True))


def test_format_detection_and_explicit_format_mismatch(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "weird.jsonl", [{"dialogue": []}])
    with pytest.raises(UserError, match=r"weird\.jsonl:1: cannot detect the row format from keys \['dialogue'\]"):
        list(iter_conversations(path))
    messages_path = write_jsonl(tmp_path / "m.jsonl", [{"messages": [{"role": "user", "content": "x"}]}])
    stats = SourceStats(path=str(messages_path))
    assert list(iter_conversations(messages_path, "sharegpt", stats=stats)) == []
    assert stats.skipped == {"missing key: conversations": 1}
    with pytest.raises(UserError, match="format 'hf' needs an HF datasets directory or a .parquet file"):
        list(iter_conversations(messages_path, "hf"))
    with pytest.raises(UserError, match="data source not found"):
        list(iter_conversations(tmp_path / "nope.jsonl"))


def test_json_array_truncated_tail_and_malformed_record(tmp_path: Path) -> None:
    complete = [sharegpt_row(f"r{i}", ("human", f"Q{i}"), ("gpt", f"A{i}")) for i in range(3)]
    text = json.dumps(complete, indent=1)
    truncated_path = tmp_path / "cut.json"
    truncated_path.write_text(text[: text.rindex('"A2"')], encoding="utf-8")  # cut inside the last record
    stats = SourceStats(path=str(truncated_path))
    assert [c.source_id for c in iter_conversations(truncated_path, stats=stats)] == ["cut:r0", "cut:r1"]
    assert stats.skipped == {"truncated JSON record": 1}
    # A truncated download is expected input: --strict still reads it.
    assert len(list(iter_conversations(truncated_path, strict=True))) == 2

    broken_path = tmp_path / "broken.json"
    broken_path.write_text('[{"conversations": []},\n {"conversations": [}\n, {"conversations": []}]', encoding="utf-8")
    stats = SourceStats(path=str(broken_path))
    assert len(list(iter_conversations(broken_path, stats=stats))) == 1
    assert stats.skipped == {"malformed JSON": 1}
    with pytest.raises(UserError, match=rf"{broken_path}: line 2: record 1: .*\(--strict\)"):
        list(iter_conversations(broken_path, strict=True))


def test_json_array_is_streamed_in_chunks_with_correct_line_numbers(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(json_array, "CHUNK_CHARS", 7)  # records straddle many chunk boundaries
    rows = [sharegpt_row(f"id{i}", ("human", "question " * i), ("gpt", "answer\n" * i)) for i in range(6)]
    path = tmp_path / "chunked.json"
    path.write_text("[\n" + ",\n".join(json.dumps(row) for row in rows) + "\n]\n", encoding="utf-8")
    conversations, stats = read_conversations(path)
    assert [c.source_id for c in conversations] == [f"chunked:id{i}" for i in range(6)]
    assert [c.origin for c in conversations] == [f"{path}:{line}" for line in range(2, 8)]
    assert conversations[5].messages[1]["content"] == "answer\n" * 5
    assert not stats.skipped


@pytest.mark.parametrize("chunk_chars", [None, 5, 1 << 22])
def test_json_array_reader_from_string_or_chunks(monkeypatch, chunk_chars: int | None) -> None:
    text = '[\n {"a": 1},\n {"a": tru},\n 12345,\n "x y" {"b": "cut off'
    if chunk_chars is not None:
        monkeypatch.setattr(json_array, "CHUNK_CHARS", chunk_chars)  # 5: numbers and strings straddle chunks
    reader = json_array.JsonArrayReader(text if chunk_chars is None else io.StringIO(text))
    assert [(e.index, e.line, e.column, e.value, e.problem) for e in reader] == [
        (0, 2, 2, {"a": 1}, ""),
        (1, 3, 2, None, "invalid"),
        (2, 4, 2, 12345, ""),
        (3, 5, 2, "x y", ""),
        (4, 5, 8, None, "separator"),
        (4, 5, 8, None, "cut_off"),
    ]
    assert reader.truncated and not reader.closed and reader.tail_chars == len('{"b": "cut off')
    closed = json_array.JsonArrayReader('\ufeff[1, 2,]')
    assert [e.value for e in closed] == [1, 2] and closed.closed and not closed.truncated


def test_hf_dataset_directory_dataset_dict_and_parquet(tmp_path: Path) -> None:
    import datasets

    records = {
        "id": ["h0", "h1"],
        "conversations": [
            [{"from": "human", "value": "Q0"}, {"from": "gpt", "value": "A0"}],
            [{"from": "human", "value": "Q1"}, {"from": "gpt", "value": "A1"}],
        ],
    }
    dataset = datasets.Dataset.from_dict(records)
    dataset.save_to_disk(str(tmp_path / "single"))
    conversations, stats = read_conversations(tmp_path / "single", "hf")
    assert stats.format == "sharegpt" and [c.source_id for c in conversations] == ["single:h0", "single:h1"]

    datasets.DatasetDict({"train": dataset, "test": dataset.select([1])}).save_to_disk(str(tmp_path / "dict"))
    assert [c.source_id for c in iter_conversations(tmp_path / "dict", split="test")] == ["dict:h1"]
    assert len(list(iter_conversations(tmp_path / "dict"))) == 2  # default split: train
    with pytest.raises(UserError, match=r"split 'dev' not found; set `split:` to one of \['train', 'test'\]"):
        list(iter_conversations(tmp_path / "dict", split="dev"))

    dataset.to_parquet(str(tmp_path / "rows.parquet"))
    conversations, _ = read_conversations(tmp_path / "rows.parquet")
    assert roles_and_texts(conversations[1]) == [("user", "Q1"), ("assistant", "A1")]


def test_limit_caps_rows_read(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "many.jsonl", [sharegpt_row(str(i), ("human", "q"), ("gpt", "a")) for i in range(10)])
    conversations, stats = read_conversations(path, limit=4)
    assert len(conversations) == 4 and stats.rows_read == 4


def conversation(*messages: tuple[str, str]) -> Conversation:
    return Conversation("src:1", [{"role": role, "content": text} for role, text in messages], origin="f.jsonl:1")


def test_training_cleanup_drops_leading_assistant_and_trailing_user_turns() -> None:
    stats = SourceStats(path="f")
    cleaned = normalize_for_training(
        conversation(("system", "S"), ("assistant", "orphan"), ("user", "Q"), ("assistant", "A"), ("user", "dangling")),
        stats,
    )
    assert roles_and_texts(cleaned) == [("system", "S"), ("user", "Q"), ("assistant", "A")]
    assert stats.adjusted == {"leading assistant turns dropped": 1, "trailing user turns dropped": 1}


@pytest.mark.parametrize(
    ("messages", "reason"),
    [
        ((), "empty conversation"),
        ((("system", "only a system prompt"),), "empty conversation"),
        ((("assistant", "A"),), "no user turn"),
        ((("user", "Q1"), ("user", "Q2")), "no assistant turn"),
        ((("user", "  "), ("assistant", "A")), "empty user message"),
        ((("user", "Q"), ("assistant", "")), "empty assistant message"),
    ],
)
def test_untrainable_conversations_are_skipped_with_a_reason(messages, reason: str) -> None:
    with pytest.raises(RowSkipped) as caught:
        normalize_for_training(conversation(*messages), SourceStats(path="f"))
    assert caught.value.reason == reason and not caught.value.malformed
    assert caught.value.detail.startswith("f.jsonl:1: ")


def test_conversation_is_cut_before_an_empty_message() -> None:
    stats = SourceStats(path="f")
    cleaned = normalize_for_training(
        conversation(
            ("user", "Q1"), ("assistant", "A1"), ("user", ""), ("assistant", "A2"), ("user", "Q3"), ("assistant", "A3")
        ),
        stats,
    )
    assert roles_and_texts(cleaned) == [("user", "Q1"), ("assistant", "A1")]
    assert stats.adjusted == {"cut at an empty message": 1}


@pytest.mark.parametrize(
    ("mode", "expected_system"),
    [("keep", ["orig"]), ("drop", []), ("default", ["orig"]), ("override", ["new"])],
)
def test_system_prompt_modes(mode: str, expected_system: list[str]) -> None:
    with_system = conversation(("system", "orig"), ("user", "Q"), ("assistant", "A"))
    cleaned = normalize_for_training(with_system, SourceStats(path="f"), system_mode=mode, system_text="new")
    assert [m["content"] for m in cleaned.messages if m["role"] == "system"] == expected_system
    without_system = conversation(("user", "Q"), ("assistant", "A"))
    cleaned = normalize_for_training(without_system, SourceStats(path="f"), system_mode=mode, system_text="new")
    expected_added = ["new"] if mode in ("default", "override") else []
    assert [m["content"] for m in cleaned.messages if m["role"] == "system"] == expected_added
    assert cleaned.messages[0]["role"] == ("system" if expected_added else "user")
