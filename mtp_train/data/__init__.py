"""Conversation data: loading (ShareGPT / messages / MT-bench / HF datasets), chat-template rendering with exact
assistant-only loss masks, self-distillation regeneration, and the prepared-dataset format.

Submodules (none imports torch/transformers/datasets at import time, so `mtp-train --help` stays fast):

- `conversations`: rows → `Conversation`s with normalized roles; skip accounting (`SourceStats`, `RowSkipped`);
- `templating`: `load_chat_tokenizer`, `AssistantMaskRenderer` (input_ids + loss_mask for any chat template);
- `regenerate`: `regenerate_conversations(conversations, generate_fn, progress_path)`, resumable;
- `prepared`: the on-disk format of `prepare`'s output (`load_prepared`, fingerprints, split assignment);
- `json_array`: a (possibly cut-off) JSON array read element by element;
- `prepare`: the prepare stage (`prepare_dataset`; the command is `mtp_train.commands.prepare`).

Import from the submodules (nothing is re-exported here).
"""
