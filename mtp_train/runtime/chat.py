"""Chat-template helpers shared by every stage that prompts a target."""

from __future__ import annotations

from mtp_train.errors import UserError
from mtp_train.runtime.config import ModelConfig


def encode_chat(tokenizer, messages: list[dict], source: str = "tokenizer") -> list[int]:
    """Render `messages` with the tokenizer's chat template plus the generation prompt; return token ids."""
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(
            f"{source}: the tokenizer has no chat template (add chat_template.jinja to the model directory)"
        )
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    if hasattr(ids, "keys"):  # some transformers versions return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def stop_token_ids(tokenizer, config: ModelConfig) -> tuple[int, ...]:
    """End-of-turn ids: the model's eos ids plus the tokenizer's eos."""
    ids = set(config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))
