"""The on-disk format of a prepared dataset (the output of `mtp-train prepare`), and how to read and verify it.

Layout of `<data.output_dir>/`:

- `train/`, `eval/`: HF `datasets` datasets (save_to_disk) with columns `input_ids` (list of int32), `loss_mask`
  (list of uint8: 1 = assistant reply or its end-of-turn token) and `source_id` (string);
- `stats.json`: rows read, kept, skipped by reason, adjustments, truncation, token counts, per split and source;
- `fingerprint.json`: `tokenizer_hash`, `dataset_hash` (see `dataset_content_hash`), the hashes of the inputs
  (`inputs_hash`: recipe target+data sections, tokenizer, source files, options) and the format version;
- `recipe.resolved.yaml`: the recipe the data was made with;
- `regenerated.jsonl`: only with regeneration: the regenerated conversations.

Later stages import this module (never the `prepare` pipeline) and compare fingerprints before mixing caches.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mtp_train.data.templating import effective_chat_template, load_chat_tokenizer
from mtp_train.errors import UserError
from mtp_train.fileio import file_sha256, read_json_object, recover_replaced_directory

if TYPE_CHECKING:
    import datasets

# 2: the tokenizer hash covers tokenizer_config.json's id-relevant keys and added_tokens.json
PREPARED_FORMAT_VERSION = 2
TRAIN_SPLIT = "train"
EVAL_SPLIT = "eval"
SPLITS = (TRAIN_SPLIT, EVAL_SPLIT)
STATS_FILENAME = "stats.json"
FINGERPRINT_FILENAME = "fingerprint.json"
REGENERATED_FILENAME = "regenerated.jsonl"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "tokenizer_config.json")


def prepared_features() -> datasets.Features:
    """The column types of the train/eval datasets."""
    import datasets  # local: about a second to import; the trainer imports this module for tokenizer_fingerprint

    return datasets.Features(
        {
            "input_ids": datasets.List(datasets.Value("int32")),
            "loss_mask": datasets.List(datasets.Value("uint8")),
            "source_id": datasets.Value("string"),
        }
    )


def eval_split_of(source_id: str, seed: int, eval_fraction: float) -> str:
    """ "eval" or "train" for a sample, from a hash of (seed, source_id): stable across runs, machines and ranks."""
    digest = hashlib.sha256(f"{seed}:{source_id}".encode()).digest()
    position = int.from_bytes(digest[:8], "big") / 2**64
    return EVAL_SPLIT if position < eval_fraction else TRAIN_SPLIT


# tokenizer_config.json keys that never change which ids a text becomes: where the files were (paths differ between
# copies of one tokenizer), lengths and sides of padding/truncation, the chat template (hashed as the effective one)
_TOKENIZER_CONFIG_IGNORED = frozenset({"name_or_path", "tokenizer_file", "special_tokens_map_file", "model_max_length",
                                       "chat_template", "padding_side", "truncation_side", "auto_map"})


def tokenizer_hash(tokenizer_dir: str | Path, chat_template: str | None) -> str:
    """sha256 over what decides the tokenizer's ids: its vocabulary files (tokenizer.json first; the vocab files of
    other formats if present), `added_tokens.json`, the keys of `tokenizer_config.json` that change tokenization
    (added tokens and their ids, bos/eos insertion, prefix space, ...: all but `_TOKENIZER_CONFIG_IGNORED`), and the
    effective chat template text."""
    hasher = hashlib.sha256()
    directory = Path(tokenizer_dir)
    for name in (*TOKENIZER_FILES[:-1], "added_tokens.json"):
        file_path = directory / name
        if file_path.is_file():
            hasher.update(name.encode() + b"\0")
            file_sha256(file_path, hasher)
    config_path = directory / TOKENIZER_FILES[-1]
    if config_path.is_file():
        config = read_json_object(config_path, "the tokenizer's configuration")
        relevant = {key: value for key, value in config.items() if key not in _TOKENIZER_CONFIG_IGNORED}
        hasher.update(b"tokenizer_config\0" + json.dumps(relevant, sort_keys=True, default=str).encode("utf-8"))
    hasher.update(b"chat_template\0" + (chat_template or "").encode("utf-8"))
    return hasher.hexdigest()


def path_content_hash(path: str | Path) -> str:
    """sha256 of a file's bytes, or of a directory's files (relative names + bytes, in sorted order)."""
    root = Path(path)
    hasher = hashlib.sha256()
    files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
    for file_path in files:
        if root.is_dir():
            hasher.update(str(file_path.relative_to(root)).encode() + b"\0")
        file_sha256(file_path, hasher)
    return hasher.hexdigest()


def dataset_content_hash(splits: Mapping[str, datasets.Dataset]) -> str:
    """sha256 identifying the token content of the prepared splits, in the given order.

    For each split: its name, NUL, then sha256(row lengths as int64 LE), sha256(all input_ids as int32 LE) and
    sha256(all loss_mask bytes); the result is the sha256 of all of that. Independent of how arrow chunks columns.
    """
    combined = hashlib.sha256()
    for split_name, dataset in splits.items():
        lengths_hash, ids_hash, mask_hash = hashlib.sha256(), hashlib.sha256(), hashlib.sha256()
        if len(dataset):
            table = dataset.with_format("arrow")[:]
            input_ids = table.column("input_ids").combine_chunks()
            loss_mask = table.column("loss_mask").combine_chunks()
            lengths = np.asarray(input_ids.value_lengths().to_numpy(zero_copy_only=False), dtype="<i8")
            lengths_hash.update(lengths.tobytes())
            ids_hash.update(np.asarray(input_ids.flatten().to_numpy(zero_copy_only=False), dtype="<i4").tobytes())
            mask_hash.update(np.asarray(loss_mask.flatten().to_numpy(zero_copy_only=False), dtype="u1").tobytes())
        combined.update(split_name.encode() + b"\0")
        for part in (lengths_hash, ids_hash, mask_hash):
            combined.update(part.digest())
    return combined.hexdigest()


def prompt_before_first_reply(input_ids: Sequence[int], loss_mask: Sequence[int]) -> list[int]:
    """The tokens before a sample's first assistant token: its first prompt, ending with the template's generation
    header (e.g. `<|im_start|>assistant\n`). Evaluation on the held-out split feeds these to the target."""
    for position, flag in enumerate(loss_mask):
        if flag:
            return list(input_ids[:position])
    return list(input_ids)


@dataclass
class PreparedDataset:
    """A prepared dataset opened from disk."""

    path: Path
    train: datasets.Dataset
    eval: datasets.Dataset
    fingerprint: dict[str, Any]
    stats: dict[str, Any]


def load_prepared(directory: str | Path, *, verify: bool = False) -> PreparedDataset:
    """Open `<directory>` written by `prepare`; `verify` recomputes the dataset hash and compares it."""
    import datasets  # local: see prepared_features

    root = Path(directory)
    recover_replaced_directory(root)  # a replace killed between its renames: the previous output back in place
    if not (root / FINGERPRINT_FILENAME).is_file():
        raise UserError(f"{root}: not a prepared dataset (no {FINGERPRINT_FILENAME}); run `mtp-train prepare` first")
    fingerprint = read_json_object(root / FINGERPRINT_FILENAME)
    if fingerprint.get("format_version") != PREPARED_FORMAT_VERSION:
        raise UserError(
            f"{root / FINGERPRINT_FILENAME}: format_version {fingerprint.get('format_version')!r}, expected "
            f"{PREPARED_FORMAT_VERSION} (prepared by another version of mtp_train); re-run `mtp-train prepare "
            "--force` (a directory without the .mtp_train-output.json marker: delete it first)"
        )
    loaded = {split: datasets.load_from_disk(str(root / split)) for split in SPLITS}
    if verify:
        actual = dataset_content_hash(loaded)
        if actual != fingerprint.get("dataset_hash"):
            raise UserError(f"{root}: dataset_hash mismatch (files changed since prepare); re-run prepare --force")
    stats = read_json_object(root / STATS_FILENAME)
    return PreparedDataset(root, loaded[TRAIN_SPLIT], loaded[EVAL_SPLIT], fingerprint, stats)


def tokenizer_fingerprint(model_dir: str | Path, chat_template_path: str | Path | None = None) -> str:
    """The tokenizer hash `prepare` records for data tokenized with `model_dir`'s tokenizer (prepared fingerprint's
    `tokenizer_hash`, the feature manifest's `fingerprints.tokenizer`): the same loader and the same hash, so a
    target whose token ids mean what the prepared data's ids mean gives the equal value. `chat_template_path` is the
    recipe's `data.chat_template` (it replaces the tokenizer's own template, and the template is part of the hash)."""
    tokenizer = load_chat_tokenizer(model_dir, chat_template_path)
    return tokenizer_hash(model_dir, effective_chat_template(tokenizer))


def tokenizer_mismatch(where: str | Path, data_hash: str, data_source: str | None, target_dir: str | Path,
                       target_hash: str) -> str:
    """The message for a target whose tokenizer is not the one that tokenized the data: both tokenizers named (path
    and hash) and the two ways out."""
    source = f" (that of {data_source})" if data_source else ""
    return (
        f"{where}: the data was tokenized by tokenizer {data_hash[:16]}{source}, but the target {target_dir} has "
        f"tokenizer {target_hash[:16]}: its token ids mean other tokens, so features and a head trained on them "
        "would be garbage. Re-run `mtp-train prepare` for this target (then `mtp-train precompute --force`), or use "
        "the target the data was prepared with" + (f" (target.path={data_source})" if data_source else "")
    )
