"""A top-level JSON array read element by element (from a string, or a text stream in chunks), made for arrays
cut off by a truncated download: every complete element before the cut comes out. A bad element or a missing comma
comes out with a `problem`; the caller stops there or reads on (after the bad element, found by bracket matching).

Bytes that are not UTF-8: open the file with `errors=UNDECODABLE_ERRORS` ("surrogateescape"), which turns each such
byte into one lone surrogate instead of raising, so the reader keeps its place; an element whose text holds one comes
out with `undecodable` saying which byte and where (`find_undecodable` finds them in any text decoded that way).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, TextIO

from mtp_train.errors import UserError

CHUNK_CHARS = 1 << 22  # characters per read from a stream
_WHITESPACE = " \t\r\n"
UNDECODABLE_ERRORS = "surrogateescape"  # the `errors=` to open files with: a non-UTF-8 byte b becomes chr(0xDC00 + b)
# What "surrogateescape" makes of a byte that is not UTF-8 (0x80..0xFF). A strict UTF-8 decode never yields these
# characters (JSON's "\\udc80" escapes are ASCII in the text), so finding one means the file held such a byte.
_UNDECODABLE = re.compile("[\udc80-\udcff]")


def find_undecodable(text: str, start: int = 0, end: int | None = None) -> tuple[int, int] | None:
    """(index in `text`, byte value) of the first byte of text[start:end] that was not UTF-8, or None; `text` was
    decoded with errors="surrogateescape"."""
    match = _UNDECODABLE.search(text, start, len(text) if end is None else end)
    return None if match is None else (match.start(), ord(match.group()) - 0xDC00)


@dataclass
class ArrayElement:
    """One element (`index` from 0; 1-based `line`/`column` of its start). problem: "" for a decoded `value`,
    "invalid" (complete but not JSON), "separator" (the comma before it is missing) or "cut_off" (the text ends
    inside it; always the last element), with the decoder's (or the separator check's) `message`. undecodable:
    "" or, when the element's text holds a byte that is not UTF-8, which and where (e.g. "byte 0xff at line 12,
    column 7"); its `value` then holds the escaped characters, not text to use."""

    index: int
    line: int
    column: int
    value: Any = None
    problem: Literal["", "invalid", "separator", "cut_off"] = ""
    message: str = ""
    undecodable: str = ""


class JsonArrayReader:
    """The `ArrayElement`s of the array in `source` (the text, or a stream read `CHUNK_CHARS` at a time; open files
    with `errors=UNDECODABLE_ERRORS` so that a non-UTF-8 byte is reported on its element). Afterwards
    `closed`: the `]` was reached; `truncated`: the text ended before it; `tail_chars`: characters of a cut-off last
    element; `trailing`: None, or (line, column, the first characters) of text after the closing `]` (a file
    holds one array: anything after it is not read). `position`: characters consumed so far (for progress bars);
    `label` names the source in errors."""

    def __init__(self, source: str | TextIO, label: str = "<string>") -> None:
        self.label = label
        self._stream = None if isinstance(source, str) else source
        self._buffer = source if isinstance(source, str) else ""
        self._at_eof = isinstance(source, str)
        self._pos = 0  # read position in _buffer
        self._dropped = 0  # characters dropped from the front of _buffer by refills
        # Line bookkeeping: `_line` is the line of _buffer[_counted_to], which starts at absolute offset _line_start.
        self._line, self._line_start, self._counted_to = 1, 0, 0
        self.closed = self.truncated = False
        self.tail_chars = 0
        self.trailing: tuple[int, int, str] | None = None

    @property
    def position(self) -> int:
        return self._dropped + self._pos

    def locate(self) -> tuple[int, int]:
        """1-based (line, column) of the read position (counted incrementally: the position only moves forward)."""
        newlines = self._buffer.count("\n", self._counted_to, self._pos)
        if newlines:
            self._line += newlines
            self._line_start = self._dropped + self._buffer.rindex("\n", self._counted_to, self._pos) + 1
        self._counted_to = self._pos
        return self._line, self.position - self._line_start + 1

    def _refill(self) -> bool:
        """Append the next chunk, dropping what lies before the read position; False at the end of the text."""
        if self._at_eof or self._stream is None:
            return False
        self.locate()  # count the newlines of the part about to be dropped
        chunk = self._stream.read(CHUNK_CHARS)
        self._at_eof = len(chunk) < CHUNK_CHARS
        self._dropped += self._pos
        self._buffer = self._buffer[self._pos :] + chunk
        self._pos = self._counted_to = 0
        return bool(chunk)

    def _peek(self) -> str:
        """The next non-whitespace character ('' at the end of the text), moving the read position onto it."""
        while True:
            buffer = self._buffer
            while self._pos < len(buffer) and buffer[self._pos] in _WHITESPACE:
                self._pos += 1
            if self._pos < len(buffer):
                return buffer[self._pos]
            if not self._refill():
                return ""

    def __iter__(self) -> Iterator[ArrayElement]:
        decoder = json.JSONDecoder()
        if self._peek() == "\ufeff":  # a byte order mark
            self._pos += 1
        if self._peek() != "[":
            found = self._buffer[self._pos : self._pos + 20]
            raise UserError(f"{self.label}: expected a JSON array (a leading '['), found {found!r}")
        self._pos += 1
        index = 0
        while True:
            char = self._peek()
            if char in ("]", ""):  # the end of the array, or of the text before it
                self.closed, self.truncated = char == "]", char == ""
                self._pos += len(char)
                if self.closed and self._peek():
                    self.trailing = (*self.locate(), self._buffer[self._pos : self._pos + 20])
                return
            element = self._decode(decoder, ArrayElement(index, *self.locate()))
            yield element
            if element.problem == "cut_off":
                return
            index += 1
            char = self._peek()
            if char == ",":
                self._pos += 1
            elif char not in ("]", ""):  # read on as if the comma were there
                message = f"expected ',' or ']' after record {index}, got {char!r}"
                yield ArrayElement(index, *self.locate(), problem="separator", message=message)

    def _decode(self, decoder: json.JSONDecoder, element: ArrayElement) -> ArrayElement:
        """Fill `element` from the read position on, reading more chunks while it is incomplete."""
        while True:
            try:
                element.value, end = decoder.raw_decode(self._buffer, self._pos)
            except json.JSONDecodeError as err:
                element.message = err.msg
                value_end = _value_end(self._buffer, self._pos)
                if value_end is None and self._refill():
                    continue
                if value_end is None:
                    element.problem = "cut_off"
                    self.truncated = True
                    self.tail_chars = len(self._buffer) - self._pos
                    self._pos = len(self._buffer)
                else:
                    element.problem = "invalid"
                    self._note_undecodable(element, max(value_end, self._pos + 1))
                    self._pos = max(value_end, self._pos + 1)  # a stray ',' is an empty element: step over it
                return element
            if end == len(self._buffer) and self._refill():
                continue  # a number or literal may go on in the next chunk
            self._note_undecodable(element, end)
            self._pos = end
            return element

    def _note_undecodable(self, element: ArrayElement, end: int) -> None:
        """Set `element.undecodable` if its text, from the read position to `end` in the buffer, holds a non-UTF-8
        byte (the element starts at the read position, on line `element.line`)."""
        found = find_undecodable(self._buffer, self._pos, end)
        if found is None:
            return
        index, byte = found
        line = element.line + self._buffer.count("\n", self._pos, index)
        line_start = self._buffer.rfind("\n", self._pos, index)
        column = index - line_start if line_start >= 0 else element.column + index - self._pos
        element.undecodable = f"byte 0x{byte:02x} at line {line}, column {column}"


def _value_end(text: str, start: int) -> int | None:
    """Index just past the JSON value starting at `start` by bracket/string matching, or None if the text ends
    first (the value is cut off). Used only after a decode error, to tell truncation from bad syntax."""
    depth = 0
    in_string = escaped = False
    for k in range(start, len(text)):
        c = text[k]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
                if depth == 0:
                    return k + 1
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth <= 0:
                return k + 1
        elif depth == 0 and c in ", \t\r\n":
            return k
    return None
