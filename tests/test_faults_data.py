"""Fault tests for bad data and bad `generate` input (issue 14, items 5 and 6): every bad input is named.

- A data row holding bytes that are not UTF-8 is skipped, counted ("invalid UTF-8") and named by file:line in every
  container `prepare` reads (JSON Lines, a JSON array, parquet, an HF datasets directory); `--strict` fails on it by
  name. Before the fix, `prepare` died with a UnicodeDecodeError inside `datasets`, naming neither file nor line.
- Other broken files (an empty file, text that is not JSON, rows that are not objects, text after a JSON array) are
  named too.
- `generate` refuses an empty prompt and other degenerate arguments by name before it loads a model.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import pytest

from mtp_train.data import json_array
from mtp_train.data.conversations import SourceStats, iter_conversations, iter_raw_rows, read_conversations
from mtp_train.data.prepare import prepare_dataset
from mtp_train.errors import UserError
from mtp_train.recipe import load_recipe
from tests.conftest_data import (
    CHATML_SPECIAL_TOKENS,
    SMOLLM2_CHATML_TEMPLATE,
    build_tokenizer,
    sharegpt_row,
    write_target_dir,
)

BAD_BYTES = b"\xff\xfe caf\xe9"  # not UTF-8 (0xff can never start a character; 0xe9 is Latin-1 for "é")


def _sharegpt(i: int) -> dict:
    return sharegpt_row(f"r{i}", ("human", f"Question {i}"), ("gpt", f"Answer {i}"))


def _messages(i: int) -> dict:
    turns = [{"role": "user", "content": f"Q {i}"}, {"role": "assistant", "content": f"A {i}"}]
    return {"id": f"m{i}", "messages": turns}


def _mt_bench(i: int) -> dict:
    return {"question_id": i, "category": "writing", "turns": [f"Prompt {i}", "And then?"]}


def _plant(encoded: bytes, marker: str) -> bytes:
    """`encoded` with the first `marker` (a word inside a string value) followed by BAD_BYTES."""
    assert marker.encode() in encoded
    return encoded.replace(marker.encode(), marker.encode() + BAD_BYTES, 1)


def _jsonl_with_bad_line(path: Path, rows: list[dict], bad_line: int, marker: str) -> Path:
    """Rows as JSON Lines; line `bad_line` (1-based) gets BAD_BYTES after `marker`."""
    lines = [json.dumps(row).encode() for row in rows]
    lines[bad_line - 1] = _plant(lines[bad_line - 1], marker)
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


# --------------------------------------------------------------------------------------------------------------------
# Reading: each container names the row
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("row_format", "make_row", "marker"),
    [("sharegpt", _sharegpt, "Question 2"), ("messages", _messages, "Q 2"), ("mt_bench", _mt_bench, "Prompt 2")],
)
@pytest.mark.parametrize("declared", [False, True], ids=["auto", "declared"])
def test_jsonl_row_with_invalid_utf8_is_skipped_counted_and_named(
    tmp_path: Path, caplog, row_format, make_row, marker, declared
) -> None:
    path = _jsonl_with_bad_line(tmp_path / "rows.jsonl", [make_row(i) for i in range(5)], 3, marker)
    stats = SourceStats(path=str(path))
    with caplog.at_level(logging.WARNING, logger="mtp_train.data.conversations"):
        conversations = list(iter_conversations(path, row_format if declared else "auto", stats=stats))
    assert len(conversations) == 4 and stats.rows_read == 5
    assert stats.skipped == {"invalid UTF-8": 1}
    assert declared or stats.format == row_format  # a declared format is the caller's to record
    column = json.dumps(make_row(2)).index(marker) + len(marker) + 1
    assert f"skipped: {path}:3: not UTF-8 text (byte 0xff at column {column})" in caplog.text
    with pytest.raises(UserError, match=rf"^{path}:3: not UTF-8 text \(byte 0xff at column {column}\) \(--strict\)$"):
        list(iter_conversations(path, row_format, strict=True))


def test_json_array_record_with_invalid_utf8_is_named_at_its_first_line_and_reading_goes_on(tmp_path: Path) -> None:
    text = json.dumps([_sharegpt(i) for i in range(5)], indent=1).encode()
    path = tmp_path / "chats.json"
    path.write_bytes(_plant(text, "Answer 3"))
    lines = text.decode().splitlines()
    record_line = [n for n, line in enumerate(lines, start=1) if line == " {"][3]
    byte_line = next(n for n, line in enumerate(lines, start=1) if "Answer 3" in line)
    byte_column = lines[byte_line - 1].index("Answer 3") + len("Answer 3") + 1

    conversations, stats = read_conversations(path)
    assert [c.source_id for c in conversations] == ["chats:r0", "chats:r1", "chats:r2", "chats:r4"]
    assert stats.skipped == {"invalid UTF-8": 1} and stats.rows_read == 5
    expected = (
        rf"^{path}:{record_line}: record 3: not UTF-8 text \(byte 0xff at line {byte_line}, column {byte_column}\)"
        r" \(--strict\)$"
    )
    with pytest.raises(UserError, match=expected):
        read_conversations(path, strict=True)


def test_json_array_read_in_small_chunks_names_the_bad_byte_and_keeps_valid_multibyte_text(
    tmp_path: Path, monkeypatch
) -> None:
    """Chunks of 7 characters: multi-byte characters and the bad bytes straddle chunk boundaries."""
    monkeypatch.setattr(json_array, "CHUNK_CHARS", 7)
    good = [sharegpt_row(f"u{i}", ("human", "Überraschung 日本語 🙂"), ("gpt", f"Ça va {i}")) for i in range(4)]
    lines = [json.dumps(row, ensure_ascii=False).encode() for row in good]
    lines[2] = _plant(lines[2], "Ça va")
    path = tmp_path / "utf8.json"
    path.write_bytes(b"[\n" + b",\n".join(lines) + b"\n]\n")
    conversations, stats = read_conversations(path)
    assert [c.source_id for c in conversations] == ["utf8:u0", "utf8:u1", "utf8:u3"]
    assert conversations[0].messages[0]["content"] == "Überraschung 日本語 🙂"
    assert stats.skipped == {"invalid UTF-8": 1}
    column = len(json.dumps(good[2], ensure_ascii=False).split("Ça va")[0]) + len("Ça va") + 1
    expected = rf"{path}:4: record 2: not UTF-8 text \(byte 0xff at line 4, column {column}\)"
    with pytest.raises(UserError, match=expected):
        read_conversations(path, strict=True)


def test_invalid_utf8_outside_a_string_ends_a_json_array_by_name(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    first, last = json.dumps(_sharegpt(0)).encode(), json.dumps(_sharegpt(2)).encode()
    path.write_bytes(b"[\n" + first + b',\n {"id": \xff},\n' + last + b"\n]")
    conversations, stats = read_conversations(path)
    assert [c.source_id for c in conversations] == ["broken:r0"]  # stops there: the record's end is a guess
    assert stats.skipped == {"invalid UTF-8": 1}
    expected = rf"{path}:3: record 1: not UTF-8 text \(byte 0xff at line 3, column 9\); stopping here \(--strict\)"
    with pytest.raises(UserError, match=expected):
        read_conversations(path, strict=True)


def test_invalid_utf8_in_the_first_bytes_of_a_file_is_a_row_not_a_crash(tmp_path: Path) -> None:
    """The container is sniffed from the first characters: a bad byte there must not raise either."""
    path = tmp_path / "first.jsonl"
    path.write_bytes(b'{"id": "\xff", "conversations": []}\n' + json.dumps(_sharegpt(1)).encode() + b"\n")
    conversations, stats = read_conversations(path)
    assert [c.source_id for c in conversations] == ["first:r1"] and stats.skipped == {"invalid UTF-8": 1}


def _arrow_table_with_invalid_utf8(num_rows: int, bad_row: int):
    """A {id, conversations} Arrow table whose reply in `bad_row` holds BAD_BYTES: built from raw buffers, the way
    a writer that skips Arrow's UTF-8 check would write it (pyarrow's own constructors refuse such strings)."""
    import pyarrow as pa

    replies = [f"Answer {i}".encode() for i in range(num_rows)]
    replies[bad_row] += BAD_BYTES
    values = [text for reply in replies for text in (b"Question", reply)]
    offsets = [0]
    for value in values:
        offsets.append(offsets[-1] + len(value))
    strings = pa.Array.from_buffers(
        pa.string(), len(values), [None, pa.array(offsets, pa.int32()).buffers()[1], pa.py_buffer(b"".join(values))]
    )
    turns = pa.StructArray.from_arrays([pa.array(["human", "gpt"] * num_rows), strings], names=["from", "value"])
    conversations = pa.ListArray.from_arrays(pa.array(range(0, 2 * num_rows + 1, 2), pa.int32()), turns)
    return pa.table({"id": [f"h{i}" for i in range(num_rows)], "conversations": conversations})


@pytest.mark.parametrize("container", ["parquet", "hf"])
def test_arrow_row_with_invalid_utf8_is_skipped_and_named(tmp_path: Path, container: str) -> None:
    import datasets
    import pyarrow.parquet as pq

    table = _arrow_table_with_invalid_utf8(300, bad_row=260)  # the bad row is in the second batch of 256
    if container == "parquet":
        path = tmp_path / "chats.parquet"
        pq.write_table(table, path)
    else:
        path = tmp_path / "chats_hf"
        datasets.Dataset(table).save_to_disk(str(path))
    conversations, stats = read_conversations(path, "hf")
    assert len(conversations) == 299 and stats.rows_read == 300 and stats.skipped == {"invalid UTF-8": 1}
    assert conversations[259].source_id.endswith(":h259") and conversations[259].messages[1]["content"] == "Answer 259"
    assert conversations[260].source_id.endswith(":h261")
    expected = rf"^{path} row 260: not UTF-8 text \(byte 0xff in a string value\) \(--strict\)$"
    with pytest.raises(UserError, match=expected):
        read_conversations(path, "hf", strict=True)


# --------------------------------------------------------------------------------------------------------------------
# Other broken files
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("content", [b"", b"  \n\n", b"\xef\xbb\xbf\n"], ids=["zero-bytes", "blank", "bom-only"])
def test_an_empty_file_is_refused_by_name(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_bytes(content)
    with pytest.raises(UserError, match=rf"^{path}: the file is empty \(no JSON records\)"):
        read_conversations(path)


def test_text_that_is_not_json_names_every_line(tmp_path: Path, caplog) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("hello world\n\nthis is not JSON\n", encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="mtp_train.data.conversations"):
        conversations, stats = read_conversations(path)
    assert conversations == [] and stats.skipped == {"malformed JSON": 2}
    assert f"{path}:1: malformed JSON (Expecting value at column 1)" in caplog.text
    assert f"{path}:3: malformed JSON (Expecting value at column 1)" in caplog.text
    array_path = tmp_path / "array.json"
    array_path.write_text("[not JSON at all", encoding="utf-8")
    expected = rf"^{array_path}: line 1: record 0: Expecting value; stopping here \(--strict\)"
    with pytest.raises(UserError, match=expected):
        read_conversations(array_path, strict=True)


def test_jsonl_rows_that_are_not_objects_are_named_even_first(tmp_path: Path) -> None:
    """The first row is skipped like the others, not taken as the row format sample (which needs an object)."""
    path = tmp_path / "mixed.jsonl"
    path.write_text('"just text"\n42\n' + json.dumps(_sharegpt(2)) + "\n", encoding="utf-8")
    conversations, stats = read_conversations(path)  # format auto
    assert [c.source_id for c in conversations] == ["mixed:r2"] and stats.format == "sharegpt"
    assert stats.skipped == {"row is not an object": 2}
    with pytest.raises(UserError, match=rf"^{path}:1: expected a JSON object per row, got str \(--strict\)$"):
        read_conversations(path, strict=True)


def test_text_after_a_json_array_is_named_not_dropped_silently(tmp_path: Path) -> None:
    path = tmp_path / "twice.json"
    path.write_text(json.dumps([_sharegpt(0)]) + "\n" + json.dumps([_sharegpt(1)]) + "\n", encoding="utf-8")
    conversations, stats = read_conversations(path)
    assert [c.source_id for c in conversations] == ["twice:r0"] and stats.skipped == {"malformed JSON": 1}
    with pytest.raises(UserError, match=rf"^{path}:2: text after the closing '\]' of the JSON array at column 1"):
        read_conversations(path, strict=True)


def test_jsonl_with_a_byte_order_mark_reads_its_first_row(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(_sharegpt(0)).encode() + b"\n" + json.dumps(_sharegpt(1)).encode())
    conversations, stats = read_conversations(path, strict=True)
    assert [c.source_id for c in conversations] == ["bom:r0", "bom:r1"] and not stats.skipped


def test_raw_rows_of_a_clean_file_are_unchanged(tmp_path: Path) -> None:
    """No false alarm: valid non-ASCII text (and JSON's own \\udcxx escapes) reads as before."""
    rows = [sharegpt_row("a", ("human", "naïve café 🙂"), ("gpt", "\udcff escaped, not a raw byte"))]
    path = tmp_path / "clean.jsonl"
    path.write_text(json.dumps(rows[0]) + "\n", encoding="utf-8")
    [row] = list(iter_raw_rows(path))
    assert row.error is None and row.record == rows[0]


# --------------------------------------------------------------------------------------------------------------------
# The prepare stage end to end
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chatml_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = build_tokenizer(
        CHATML_SPECIAL_TOKENS, bos="<|im_start|>", eos="<|im_end|>", chat_template=SMOLLM2_CHATML_TEMPLATE
    )
    return write_target_dir(tmp_path_factory.mktemp("faults-data") / "tiny-chatml", tokenizer)


def _recipe(root: Path, target: Path, sources: list[tuple[Path, str]]):
    recipe_path = root / "recipe.yaml"
    source_lines = "".join(f"    - path: {path}\n      format: {fmt}\n" for path, fmt in sources)
    recipe_path.write_text(
        f"target:\n  path: {target}\ndata:\n  sources:\n{source_lines}  max_seq_len: 128\n  eval_fraction: 0.0\n"
        f"  output_dir: {root / 'prepared'}\n",
        encoding="utf-8",
    )
    return load_recipe(recipe_path)


def test_prepare_skips_counts_and_names_invalid_utf8_rows(tmp_path: Path, chatml_target: Path) -> None:
    """The issue's reproduction: before the fix, prepare died with a UnicodeDecodeError inside `datasets`."""
    jsonl = _jsonl_with_bad_line(tmp_path / "chats.jsonl", [_sharegpt(i) for i in range(6)], 2, "Question 1")
    array = tmp_path / "more.json"
    array.write_bytes(_plant(json.dumps([_messages(i) for i in range(4)], indent=1).encode(), "A 2"))
    recipe = _recipe(tmp_path, chatml_target, [(jsonl, "sharegpt"), (array, "messages")])

    result = prepare_dataset(recipe, show_progress=False)
    assert result.stats["rows_read"] == 10 and result.stats["kept"] == 8
    assert result.stats["skipped"] == {"invalid UTF-8": 2}
    assert [source["skipped"] for source in result.stats["sources"]] == [{"invalid UTF-8": 1}] * 2

    recipe.data.output_dir = str(tmp_path / "strict")
    with pytest.raises(UserError, match=rf"^{jsonl}:2: not UTF-8 text \(byte 0xff at column \d+\) \(--strict\)$"):
        prepare_dataset(recipe, strict=True, show_progress=False)
    assert not (tmp_path / "strict").exists()


def test_prepare_names_an_empty_source(tmp_path: Path, chatml_target: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps(_sharegpt(0)) + "\n", encoding="utf-8")
    recipe = _recipe(tmp_path, chatml_target, [(good, "sharegpt"), (empty, "auto")])
    with pytest.raises(UserError, match=rf"^{empty}: the file is empty"):
        prepare_dataset(recipe, show_progress=False)


# --------------------------------------------------------------------------------------------------------------------
# generate: degenerate input is refused before a model is loaded
# --------------------------------------------------------------------------------------------------------------------


def _generate_args(*argv: str) -> argparse.Namespace:
    from mtp_train.cli import build_parser

    # A target that does not exist: a check that came after loading would fail with another message.
    return build_parser().parse_args(["generate", "--target", "/nonexistent/model", *argv])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], r"^give the user message with --prompt TEXT \(repeatable\) or --prompts-file FILE$"),
        (["--prompt", ""], r"^--prompt is empty: give the user message$"),
        (["--prompt", "hi", "--prompt", " "], r"^--prompt is empty \(only whitespace\)"),
        (["--prompt", " \n\t"], r"^--prompt is empty \(only whitespace\): give the user message$"),
        (["--prompt", "hi", "--system", ""], r"^--system is empty"),
        (["--prompt", "hi", "--system", "  "], r"^--system is empty"),
        (["--prompt", "hi", "--max-new-tokens", "0"], r"^--max-new-tokens must be >= 1, got 0$"),
        (["--prompt", "hi", "--temperature", "nan"], r"^--temperature must be a finite number, got nan$"),
        (["--prompt", "hi", "--top-p", "inf"], r"^--top-p must be a finite number, got inf$"),
        (["--prompt", "hi", "--seed", str(2**64)], r"^--seed must be in -2\*\*63 \.\. 2\*\*64-1"),
        (["--prompt", "hi", "--head", "h", "--num-speculative-tokens", "0"], r"^--num-speculative-tokens must be in"),
    ],
)
def test_generate_refuses_degenerate_input_by_name(argv: list[str], message: str) -> None:
    args = _generate_args(*argv)
    with pytest.raises(UserError, match=message):
        args.func(args)
