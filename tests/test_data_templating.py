"""Assistant-only loss masks derived by rendering, for the real chat templates of several model families."""

from __future__ import annotations

from pathlib import Path

import pytest

from mtp_train.data.conversations import RowSkipped
from mtp_train.data.templating import AssistantMaskRenderer, load_chat_tokenizer, masked_runs
from mtp_train.errors import UserError
from tests.conftest_data import (
    CHATML_SPECIAL_TOKENS,
    SMOLLM2_CHATML_TEMPLATE,
    TEMPLATE_FAMILIES,
    build_family_tokenizer,
    build_tokenizer,
    write_target_dir,
)

SMOLLM2_DIR = Path(__file__).resolve().parents[1] / "data" / "models" / "smollm2-135m-instruct"

SINGLE_TURN = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help you today?"},
]
MULTI_TURN = [
    {"role": "user", "content": "Write a function that adds two numbers."},
    {"role": "assistant", "content": "Here is some Python code:\n```python\ndef add(a, b):\n    return a + b\n```"},
    {"role": "user", "content": "Thanks! And a list?"},
    {"role": "assistant", "content": "  Sure, here's a list:\n1. apples\n2. pears\n\n"},  # surrounding whitespace
    {"role": "user", "content": "Say something else."},
    {"role": "assistant", "content": "Überraschung! 日本語 🙂"},
]
SYSTEM = {"role": "system", "content": "You are a terse assistant."}

CONVERSATIONS = {
    "single": SINGLE_TURN,
    "multi": MULTI_TURN,
    "system+single": [SYSTEM] + SINGLE_TURN,
    "system+multi": [SYSTEM] + MULTI_TURN,
}


def decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def expected_runs(family: str, messages: list[dict[str, str]]) -> list[str]:
    spec = TEMPLATE_FAMILIES[family]
    return [
        (m["content"].strip() if spec["trims"] else m["content"]) + spec["end_of_turn"]
        for m in messages
        if m["role"] == "assistant"
    ]


@pytest.fixture(scope="module")
def family_tokenizers() -> dict[str, object]:
    return {family: build_family_tokenizer(family) for family in TEMPLATE_FAMILIES}


# Mistral's template rejects system messages (see test_template_errors_skip_the_row).
FAMILY_CASES = [
    (family, name)
    for family in TEMPLATE_FAMILIES
    for name in CONVERSATIONS
    if not (family == "mistral" and name.startswith("system"))
]


@pytest.mark.parametrize(("family", "conversation_name"), FAMILY_CASES)
def test_masked_tokens_are_exactly_the_replies_and_end_of_turn(
    family_tokenizers, family: str, conversation_name: str
) -> None:
    messages = CONVERSATIONS[conversation_name]
    tokenizer = family_tokenizers[family]
    renderer = AssistantMaskRenderer(tokenizer)
    result = renderer.render(messages)

    assert len(result.input_ids) == len(result.loss_mask) and set(result.loss_mask) <= {0, 1}
    assert not result.used_offset_fallback and not result.truncated
    # The ids are the template's rendering, tokenized once (no extra BOS/EOS).
    assert result.input_ids == tokenizer(renderer.render_text(messages), add_special_tokens=False)["input_ids"]
    runs = [decode(tokenizer, run) for run in masked_runs(result.input_ids, result.loss_mask)]
    assert runs == expected_runs(family, messages)
    # Everything else (system prompt, user turns, role headers, newlines after end-of-turn) is unmasked.
    unmasked = decode(tokenizer, [t for t, m in zip(result.input_ids, result.loss_mask) if not m])
    assert "user" in unmasked or "[INST]" in unmasked
    for message in messages:
        if message["role"] != "assistant":
            assert message["content"].strip() in unmasked


def test_llama31_system_block_with_date_is_not_masked(family_tokenizers) -> None:
    tokenizer = family_tokenizers["llama3.1"]
    result = AssistantMaskRenderer(tokenizer).render(SINGLE_TURN)
    first_masked = result.loss_mask.index(1)
    header = decode(tokenizer, result.input_ids[:first_masked])
    assert "Cutting Knowledge Date" in header and header.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_truncation_keeps_the_prefix_of_the_full_mask(family_tokenizers) -> None:
    tokenizer = family_tokenizers["qwen2.5"]
    renderer = AssistantMaskRenderer(tokenizer)
    full = renderer.render(MULTI_TURN)
    for max_tokens in (5, len(full.input_ids) // 2, len(full.input_ids) - 1):
        cut = renderer.render(MULTI_TURN, max_tokens=max_tokens)
        assert cut.truncated and cut.untruncated_length == len(full.input_ids)
        assert cut.input_ids == full.input_ids[:max_tokens]
        assert cut.loss_mask == full.loss_mask[:max_tokens]
    whole = renderer.render(MULTI_TURN, max_tokens=len(full.input_ids))
    assert not whole.truncated and whole.loss_mask == full.loss_mask


def test_offset_fallback_when_merges_cross_the_reply_boundary() -> None:
    # BPE without pre-tokenization learns merges like "assistant\nHello": piecewise tokenization cannot match.
    tokenizer = build_tokenizer(
        CHATML_SPECIAL_TOKENS,
        eos="<|im_end|>",
        chat_template=SMOLLM2_CHATML_TEMPLATE,
        split_on_whitespace_and_punctuation=False,
    )
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]
    renderer = AssistantMaskRenderer(tokenizer)
    result = renderer.render(messages)
    assert result.used_offset_fallback
    (run,) = [decode(tokenizer, ids) for ids in masked_runs(result.input_ids, result.loss_mask)]
    # Every token overlapping the reply is masked: the reply and its end-of-turn, plus at most the header
    # characters that share the first token with it.
    assert run.endswith("Hello there<|im_end|>")
    assert "assistant\n".endswith(run[: -len("Hello there<|im_end|>")])
    text, ((start, end),) = renderer.assistant_char_spans(messages)
    assert text[start:end] == "Hello there<|im_end|>"


def test_template_errors_skip_the_row(family_tokenizers) -> None:
    renderer = AssistantMaskRenderer(family_tokenizers["mistral"])
    with pytest.raises(RowSkipped) as caught:
        renderer.render([SYSTEM] + SINGLE_TURN)
    assert caught.value.reason == "chat template error"
    assert "Conversation roles must alternate" in caught.value.detail


def test_control_tokens_inside_messages_skip_the_row(family_tokenizers) -> None:
    renderer = AssistantMaskRenderer(family_tokenizers["chatml-smollm2"])
    messages = [
        {"role": "user", "content": "What does <|im_end|> mean?"},
        {"role": "assistant", "content": "A marker."},
    ]
    with pytest.raises(RowSkipped) as caught:
        renderer.render(messages)
    assert caught.value.reason == "control token in content" and "<|im_end|>" in caught.value.detail


def test_template_that_rewrites_earlier_turns_is_refused_not_guessed() -> None:
    # Like reasoning templates: earlier replies lose their <think> part once a later turn follows.
    template = (
        "{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}"
        "{{ '<|im_start|>assistant\n' + m.content.split('</think>')[-1] + '<|im_end|>\n' }}"
        "{% else %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    tokenizer = build_tokenizer(CHATML_SPECIAL_TOKENS, eos="<|im_end|>", chat_template=template)
    renderer = AssistantMaskRenderer(tokenizer)
    messages = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "<think>hmm</think>A1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "A2"},
    ]
    with pytest.raises(RowSkipped) as caught:
        renderer.render(messages)
    assert caught.value.reason == "assistant span not derivable" and "assistant message 1" in caught.value.detail
    # Without the rewrite (no <think>), the same template is fine.
    plain = [dict(m, content=m["content"].replace("<think>hmm</think>", "")) for m in messages]
    runs = [decode(tokenizer, ids) for ids in masked_runs(*_ids_and_mask(renderer, plain))]
    assert runs == ["A1<|im_end|>", "A2<|im_end|>"]


def _ids_and_mask(renderer: AssistantMaskRenderer, messages) -> tuple[list[int], list[int]]:
    result = renderer.render(messages)
    return result.input_ids, result.loss_mask


def test_missing_chat_template_says_how_to_supply_one(tmp_path: Path) -> None:
    tokenizer = build_tokenizer(CHATML_SPECIAL_TOKENS, eos="<|im_end|>")
    target = write_target_dir(tmp_path / "target", tokenizer)
    with pytest.raises(UserError, match=r"has no chat template; set `data\.chat_template: path/to/template\.jinja`"):
        load_chat_tokenizer(target)
    template_file = tmp_path / "chatml.jinja"
    template_file.write_text(SMOLLM2_CHATML_TEMPLATE, encoding="utf-8")
    loaded = load_chat_tokenizer(target, template_file)
    runs = [decode(loaded, ids) for ids in masked_runs(*_ids_and_mask(AssistantMaskRenderer(loaded), SINGLE_TURN))]
    assert runs == [SINGLE_TURN[1]["content"] + "<|im_end|>"]
    with pytest.raises(UserError, match="data.chat_template: .*missing.jinja: file not found"):
        load_chat_tokenizer(target, tmp_path / "missing.jinja")
    with pytest.raises(UserError, match="target.path: .* is not a directory"):
        load_chat_tokenizer(tmp_path / "no-model")


@pytest.mark.skipif(not (SMOLLM2_DIR / "tokenizer.json").is_file(), reason="SmolLM2 not fetched (make assets)")
@pytest.mark.slow
@pytest.mark.real_model
def test_real_smollm2_tokenizer_masks_replies_exactly() -> None:
    tokenizer = load_chat_tokenizer(SMOLLM2_DIR)
    renderer = AssistantMaskRenderer(tokenizer)
    for messages in CONVERSATIONS.values():
        # Replies without leading whitespace: the reply starts on a token boundary, the mask is exact.
        messages = [dict(m, content=m["content"].lstrip()) for m in messages]
        result = renderer.render(messages)
        assert not result.used_offset_fallback
        runs = [decode(tokenizer, ids) for ids in masked_runs(result.input_ids, result.loss_mask)]
        assert runs == [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]

    # SmolLM2's BPE has a token for "\n " so a reply starting with a space shares its first token with the
    # header's newline: detected (offset fallback) and that one token is masked with the reply.
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "  Sure."}]
    result = renderer.render(messages)
    assert result.used_offset_fallback
    assert [decode(tokenizer, ids) for ids in masked_runs(result.input_ids, result.loss_mask)] == [
        "\n  Sure.<|im_end|>"
    ]
