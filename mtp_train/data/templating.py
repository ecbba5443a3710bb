"""Chat-template rendering with an assistant-only loss mask that is exact for any chat template.

The mask is derived by rendering, never by matching a template-specific pattern. For the assistant message at
index i of a conversation:

- `prefix`  = render(messages[:i], add_generation_prompt=True): everything before the reply, generation header
  included (for templates that ignore add_generation_prompt, e.g. Mistral's, this is just the history);
- `through` = render(messages[:i+1]): the same conversation ending with the reply;
- `probe`   = render(messages[:i] + [assistant: SENTINEL]): its text after the sentinel is the template's *turn
  suffix* (e.g. "<|im_end|>\\n", "<|eot_id|>", "</s>"), which `through` must end with, so the reply's content
  ends exactly where that suffix starts (a template that trims or rewrites the content is handled too).

The masked characters are `through[len(prefix) : content_end + end_of_turn]`, where end_of_turn runs to the end
of the first special token in the turn suffix (the token the model emits to stop: `<|im_end|>`, `<|eot_id|>`,
`</s>`), so the trailing newline a template adds after it is not trained on. Each span is checked to render
identically inside the whole conversation (the prefix property); a conversation whose template renders an earlier
turn differently once later turns exist is skipped ("assistant span not derivable"), never guessed.

Characters → tokens: the whole text is tokenized once (these are the ids we keep). If tokenizing the text piece by
piece (cut at the span boundaries) gives exactly the same ids, the mask follows the pieces and is exact. Otherwise
(a merge crosses a boundary, or a SentencePiece tokenizer adds a prefix space per piece) tokens are masked by
character offsets: a token is masked when it overlaps a span; such samples are counted as "offset fallback" (e.g.
SmolLM2's BPE has a "\\n " token, so a reply starting with a space shares its first token with the header's newline).

Truncation to `max_tokens` keeps the first tokens of the whole tokenization; assistant turns starting past the cut
are not located at all, and the piecewise check tokenizes only as far as the cut (plus a little lookahead so the last
kept token is not split differently because the text ends there).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mtp_train.data.conversations import Message, RowSkipped
from mtp_train.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# A string no template rewrites (no whitespace to trim, no markup) and no real message contains.
_SENTINEL = "MTPTRAINREPLYSENTINEL7f3a9c"

# Characters past a truncation point tokenized with the last piece (see the module docstring).
_TRUNCATION_LOOKAHEAD_CHARS = 256

CHAT_TEMPLATE_HINT = "set `data.chat_template: path/to/template.jinja` in the recipe (or --set data.chat_template=...)"


@dataclass
class TokenizedConversation:
    """A rendered, tokenized conversation.

    input_ids: the token ids of the rendered conversation (its first `max_tokens` when truncated). loss_mask: 1 where
    the token belongs to an assistant reply or the end-of-turn token(s) closing it, else 0. used_offset_fallback:
    the mask came from character offsets because piecewise tokenization did not reproduce the ids (see the module
    docstring).
    """

    input_ids: list[int]
    loss_mask: list[int]
    used_offset_fallback: bool
    untruncated_length: int
    """Tokens of the whole rendered conversation (> len(input_ids) when `render` truncated it)."""

    @property
    def truncated(self) -> bool:
        return self.untruncated_length > len(self.input_ids)


class SpanNotDerivable(RowSkipped):
    """The template renders a conversation in a way that hides where an assistant reply lies."""

    def __init__(self, detail: str) -> None:
        super().__init__("assistant span not derivable", detail, malformed=True)


def load_chat_tokenizer(
    target_path: str | Path, chat_template_path: str | Path | None = None
) -> PreTrainedTokenizerBase:
    """The target's tokenizer (AutoTokenizer on the local directory, never a hub id) with a usable chat template.

    `chat_template_path` (the recipe's `data.chat_template`) replaces or supplies the template. A tokenizer without
    any template is a UserError that says how to supply one.
    """
    # local: transformers takes about a second, and the trainer, eval and feature reader import this module (through
    # data.prepared's tokenizer_fingerprint) whether or not they load a tokenizer
    from transformers import AutoTokenizer

    target_dir = Path(target_path)
    if not target_dir.is_dir():
        raise UserError(
            f"target.path: {target_dir} is not a directory (run `mtp-train fetch-assets` or point target.path at an "
            "HF model directory)"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(target_dir), local_files_only=True)
    except Exception as err:  # transformers raises OSError/ValueError/KeyError depending on what is missing
        raise UserError(
            f"{target_dir}: cannot load a tokenizer from this directory ({type(err).__name__}: {err})"
        ) from None
    if chat_template_path is not None:
        template_file = Path(chat_template_path)
        if not template_file.is_file():
            raise UserError(f"data.chat_template: {template_file}: file not found")
        try:
            tokenizer.chat_template = template_file.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise UserError(
                f"data.chat_template: {template_file}: not UTF-8 text (byte 0x{err.object[err.start]:02x} at offset "
                f"{err.start})"
            ) from None
    if effective_chat_template(tokenizer) is None:
        raise UserError(f"{target_dir}: the tokenizer has no chat template; {CHAT_TEMPLATE_HINT}")
    return tokenizer


def effective_chat_template(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The template string `apply_chat_template` would use, or None when the tokenizer has none."""
    try:
        return tokenizer.get_chat_template()
    except ValueError:
        return None


class AssistantMaskRenderer:
    """Renders conversations with a tokenizer's chat template into (input_ids, loss_mask).

    Built once per tokenizer: it precomputes the control-token strings (rows whose text contains one are skipped,
    since they would be tokenized as control tokens and break the turn structure) and the special-token strings
    that can end an assistant turn.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        if effective_chat_template(tokenizer) is None:
            raise UserError(f"the tokenizer has no chat template; {CHAT_TEMPLATE_HINT}")
        self.tokenizer = tokenizer
        added_tokens = {token.content: token for token in tokenizer.added_tokens_decoder.values()}
        special = {content for content, token in added_tokens.items() if token.special}
        special.update(token for token in tokenizer.all_special_tokens if token)
        self._special_token_pattern = _longest_first_pattern(special)
        self._added_token_pattern = _longest_first_pattern(set(added_tokens))  # also finds control tokens in content

    # -- rendering ---------------------------------------------------------------------------------------------------

    def render_text(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
        """The chat template applied to `messages`, as text."""
        try:
            rendered = self.tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as err:  # jinja2 TemplateError from raise_exception, or a template's own TypeError
            detail = f"chat template failed: {type(err).__name__}: {err}"
            raise RowSkipped("chat template error", detail, malformed=True) from None
        assert isinstance(rendered, str)
        return rendered

    def end_of_turn_length(self, turn_suffix: str) -> int:
        """Characters of the turn suffix the model generates: through the first special token in it.

        Falls back to any added token, then to the suffix without trailing whitespace (plain-text templates).
        """
        for pattern in (self._special_token_pattern, self._added_token_pattern):
            match = pattern.search(turn_suffix) if pattern else None
            if match:
                return match.end()
        return len(turn_suffix.rstrip())

    def assistant_char_spans(
        self, messages: Sequence[Message], full_text: str | None = None, stop_at: int | None = None
    ) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and, per assistant message, the [start, end) characters to train on.

        `full_text`: the conversation already rendered (saves a render). `stop_at`: ignore assistant turns starting
        at or after this character (they fall beyond a truncation point).
        """
        if full_text is None:
            full_text = self.render_text(messages)
        spans: list[tuple[int, int]] = []
        for index, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            history = list(messages[:index])
            prefix = self.render_text(history, add_generation_prompt=True)
            if stop_at is not None and len(prefix) >= stop_at:
                break
            through = self.render_text(history + [message])
            if not through.startswith(prefix):
                raise SpanNotDerivable(
                    f"assistant message {index}: the history rendered with the generation prompt is not a prefix "
                    "of the history rendered with the reply"
                )
            content_end = self._content_end(history, message, prefix, through, index)
            span_end = content_end + self.end_of_turn_length(through[content_end:])
            if not full_text.startswith(through[:span_end]):
                raise SpanNotDerivable(
                    f"assistant message {index}: the template renders this turn differently once later turns follow"
                )
            spans.append((len(prefix), span_end))
        return full_text, spans

    def _content_end(self, history: list[Message], message: Message, prefix: str, through: str, index: int) -> int:
        """Where the reply's content ends in `through`: before the template's turn suffix (found with a sentinel)."""
        probe = self.render_text(history + [{"role": "assistant", "content": _SENTINEL}])
        sentinel_at = probe.rfind(_SENTINEL)
        if sentinel_at >= len(prefix) and probe.startswith(prefix):
            turn_suffix = probe[sentinel_at + len(_SENTINEL) :]
            content_end = len(through) - len(turn_suffix)
            if through.endswith(turn_suffix) and content_end >= len(prefix):
                return content_end
        # The suffix depends on the content: find the (possibly trimmed) content itself after the prefix.
        content = message["content"].strip()
        found_at = through.rfind(content, len(prefix)) if content else -1
        if found_at < 0:
            raise SpanNotDerivable(f"assistant message {index}: its content does not appear in the rendered turn")
        return found_at + len(content)

    # -- tokenizing --------------------------------------------------------------------------------------------------

    def contains_control_token(self, messages: Sequence[Message]) -> str | None:
        """The first control-token string found in any message's content, or None."""
        if self._added_token_pattern is None:
            return None
        for message in messages:
            match = self._added_token_pattern.search(message["content"])
            if match:
                return match.group(0)
        return None

    def _encode(self, texts: list[str], with_offsets: bool) -> list[tuple[list[int], list[tuple[int, int]] | None]]:
        """(ids, character offsets or None) per text, without the tokenizer's own BOS/EOS (the template has them)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None) if self.tokenizer.is_fast else None
        if backend is not None:  # the `tokenizers` object itself: same ids, without transformers' per-call overhead
            encodings = backend.encode_batch(texts, add_special_tokens=False)
            return [(encoding.ids, encoding.offsets if with_offsets else None) for encoding in encodings]
        encoded = self.tokenizer(texts, add_special_tokens=False)
        return [(list(ids), None) for ids in encoded["input_ids"]]

    def _masked(
        self,
        text: str,
        input_ids: list[int],
        offsets: list[tuple[int, int]] | None,
        spans: Sequence[tuple[int, int]],
        max_tokens: int | None,
    ) -> TokenizedConversation:
        untruncated_length = len(input_ids)
        text_end = len(text)
        if max_tokens is not None and len(input_ids) > max_tokens:
            input_ids = input_ids[:max_tokens]
            if offsets is not None:
                offsets = offsets[:max_tokens]
                text_end = offsets[-1][1]  # the kept tokens reach this far

        boundaries = sorted({0, len(text), *(start for start, _ in spans), *(end for _, end in spans)})
        pieces = [(start, end) for start, end in zip(boundaries, boundaries[1:]) if start < text_end]
        if not pieces:  # nothing rendered
            return TokenizedConversation([], [], False, untruncated_length)
        # The piece holding the truncation point is tokenized a little beyond it, so the last kept token is not
        # split differently just because the text ends there; if that is not enough, up to the piece's end.
        last_start, last_end = pieces[-1]
        for last_piece_end in dict.fromkeys((min(last_end, text_end + _TRUNCATION_LOOKAHEAD_CHARS), last_end)):
            tried = pieces[:-1] + [(last_start, last_piece_end)]
            piece_ids = [ids for ids, _ in self._encode([text[a:b] for a, b in tried], with_offsets=False)]
            if [token for ids in piece_ids for token in ids][: len(input_ids)] == input_ids:
                loss_mask: list[int] = []
                for (start, end), ids in zip(tried, piece_ids):
                    inside = any(span_start <= start and end <= span_end for span_start, span_end in spans)
                    loss_mask.extend([int(inside)] * len(ids))
                return TokenizedConversation(input_ids, loss_mask[: len(input_ids)], False, untruncated_length)

        if offsets is None:
            raise SpanNotDerivable("piecewise tokenization differs and this tokenizer gives no character offsets")
        loss_mask = [
            int(any(token_end > span_start and token_start < span_end for span_start, span_end in spans))
            for token_start, token_end in offsets
        ]
        return TokenizedConversation(input_ids, loss_mask, True, untruncated_length)

    def render(self, messages: Sequence[Message], max_tokens: int | None = None) -> TokenizedConversation:
        """Render and tokenize a conversation with its assistant-only loss mask, keeping at most `max_tokens`
        tokens (assistant turns past that point are not even located). Raises RowSkipped."""
        control_token = self.contains_control_token(messages)
        if control_token is not None:
            raise RowSkipped(
                "control token in content", f"a message contains the control token {control_token!r}", malformed=False
            )
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        full_text = self.render_text(messages)
        ((input_ids, offsets),) = self._encode([full_text], with_offsets=True)
        stop_at = None
        if max_tokens is not None and len(input_ids) > max_tokens and offsets is not None:
            stop_at = offsets[max_tokens - 1][1]
        _, spans = self.assistant_char_spans(messages, full_text, stop_at=stop_at)
        return self._masked(full_text, input_ids, offsets, spans, max_tokens)


def _longest_first_pattern(strings: set[str]) -> re.Pattern[str] | None:
    if not strings:
        return None
    return re.compile("|".join(re.escape(text) for text in sorted(strings, key=len, reverse=True)))


def masked_runs(input_ids: Sequence[int], loss_mask: Sequence[int]) -> list[list[int]]:
    """The maximal runs of consecutive masked token ids (one run per assistant turn when the mask is exact)."""
    runs: list[list[int]] = []
    previous = 0
    for token, flag in zip(input_ids, loss_mask):
        if flag:
            if not previous:
                runs.append([])
            runs[-1].append(token)
        previous = flag
    return runs
