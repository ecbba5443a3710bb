"""Helpers for the data tests: tiny offline tokenizers, real chat templates, synthetic conversation files.

Not a conftest: a helper module, imported as `from tests.conftest_data import ...` (see tests/conftest.py). No model
hub is contacted: tokenizers are trained in memory with the `tokenizers` library in a few milliseconds, and the chat
templates are the ones shipped with the real models (SmolLM2-Instruct, Llama-3-Instruct, Llama-3.1-Instruct without
its tool-calling branches, Qwen2.5-Instruct, Mistral-7B-Instruct-v0.1).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# --------------------------------------------------------------------------------------------------------------------
# Chat templates
# --------------------------------------------------------------------------------------------------------------------

SMOLLM2_CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Llama-3.1-Instruct's template with the tool-calling branches removed (the system block with the knowledge
# cutoff and date is always rendered, even without a system message).
LLAMA31_TEMPLATE = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

QWEN25_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Mistral-7B-Instruct-v0.1: no generation prompt, the reply follows "[/INST]" directly and ends with eos; roles
# must alternate and a system message is an error.
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)

CHATML_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA3_SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
MISTRAL_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]

# A family = (chat template, special tokens, bos, eos, end-of-turn text the model generates after a reply,
# whether the template trims the reply's surrounding whitespace).
TEMPLATE_FAMILIES: dict[str, dict[str, Any]] = {
    "chatml-smollm2": dict(
        template=SMOLLM2_CHATML_TEMPLATE,
        special=CHATML_SPECIAL_TOKENS,
        bos="<|im_start|>",
        eos="<|im_end|>",
        end_of_turn="<|im_end|>",
        trims=False,
    ),
    "llama3": dict(
        template=LLAMA3_TEMPLATE,
        special=LLAMA3_SPECIAL_TOKENS,
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        end_of_turn="<|eot_id|>",
        trims=True,
    ),
    "llama3.1": dict(
        template=LLAMA31_TEMPLATE,
        special=LLAMA3_SPECIAL_TOKENS,
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        end_of_turn="<|eot_id|>",
        trims=True,
    ),
    "qwen2.5": dict(
        template=QWEN25_TEMPLATE,
        special=CHATML_SPECIAL_TOKENS,
        bos=None,
        eos="<|im_end|>",
        end_of_turn="<|im_end|>",
        trims=False,
    ),
    "mistral": dict(
        template=MISTRAL_TEMPLATE,
        special=MISTRAL_SPECIAL_TOKENS,
        bos="<s>",
        eos="</s>",
        end_of_turn="</s>",
        trims=False,
    ),
}

TRAINING_CORPUS = [
    "Hello! How can I help you today? I am a helpful assistant.",
    "The quick brown fox jumps over the lazy dog. The answer is 42.",
    "Here is some Python code:\n```python\ndef add(a, b):\n    return a + b\n```\n",
    "Sure, here's a list:\n1. apples\n2. oranges\n3. pears\n\nAnything else?",
    "system user assistant You are a helpful assistant. Cutting Knowledge Date Today",
    "Überraschung! Ça va? 日本語のテキスト 🙂 emoji and accents.",
]


def build_tokenizer(
    special_tokens: Iterable[str],
    *,
    bos: str | None = None,
    eos: str | None = None,
    chat_template: str | None = None,
    split_on_whitespace_and_punctuation: bool = True,
    vocab_size: int = 600,
) -> Any:
    """A tiny byte-level BPE fast tokenizer trained in memory (GPT-2 style pre-tokenization by default).

    With `split_on_whitespace_and_punctuation=False` the BPE runs over the whole text, so merges can cross the
    boundary between a template's header and a reply (this forces the character-offset fallback).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = list(dict.fromkeys(special_tokens))
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(
        add_prefix_space=False, use_regex=split_on_whitespace_and_punctuation
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=special,
        show_progress=False,
    )
    corpus = TRAINING_CORPUS * 4
    if not split_on_whitespace_and_punctuation:  # teach merges that cross "header\n" + "reply" boundaries
        corpus += ["<|im_start|>assistant\nHello there\nHello\nHi\nHere"] * 8
    backend.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def build_family_tokenizer(family: str) -> Any:
    """A tiny tokenizer carrying the chat template and special tokens of one TEMPLATE_FAMILIES entry."""
    spec = TEMPLATE_FAMILIES[family]
    return build_tokenizer(spec["special"], bos=spec["bos"], eos=spec["eos"], chat_template=spec["template"])


def write_target_dir(directory: Path, tokenizer: Any) -> Path:
    """A target model directory holding only the tokenizer files and a config.json (what `prepare` needs)."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(directory))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": len(tokenizer)}
    (directory / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory


def write_jsonl(path: Path, rows: Iterable[Any]) -> Path:
    """Rows as JSON Lines (a row that is a str is written verbatim, e.g. to plant a malformed line)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [row if isinstance(row, str) else json.dumps(row, ensure_ascii=False) for row in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def sharegpt_row(row_id: str, *turns: tuple[str, str], system: str | None = None) -> dict[str, Any]:
    """A ShareGPT record with `from`/`value` messages."""
    row: dict[str, Any] = {"id": row_id, "conversations": [{"from": who, "value": text} for who, text in turns]}
    if system is not None:
        row["system"] = system
    return row
