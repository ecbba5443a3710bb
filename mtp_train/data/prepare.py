"""The prepare stage (`mtp-train prepare`): conversations → tokenized (input_ids, loss_mask) train/eval datasets.

Pipeline per source, streaming: read rows (`conversations`) → clean up for training (system-prompt policy, leading
assistant / trailing user turns dropped) → optionally regenerate the assistant turns with the target
(`regenerate`) → render with the target's chat template and derive the assistant-only loss mask (`templating`) →
truncate or drop over-long samples → assign train/eval by hashing source_id with the seed. Rows are written with
`datasets.Dataset.from_generator` into a work directory, saved to a staging directory together with stats.json,
fingerprint.json and the resolved recipe, and renamed into place at the end: an interrupted run never leaves a
half-written output behind. Re-running with unchanged inputs is a no-op (see `inputs_hash`), unless --force.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import datasets
from tqdm import tqdm

import mtp_train
from mtp_train.data.conversations import (
    Conversation,
    RowSkipped,
    SourceStats,
    iter_conversations,
    normalize_for_training,
    record_skip,
)
from mtp_train.data.prepared import (
    FINGERPRINT_FILENAME,
    PREPARED_FORMAT_VERSION,
    REGENERATED_FILENAME,
    SPLITS,
    STATS_FILENAME,
    dataset_content_hash,
    eval_split_of,
    path_content_hash,
    prepared_features,
    tokenizer_hash,
)
from mtp_train.data.regenerate import GenerateFn, Message, RegenerationStats, regenerate_conversations
from mtp_train.data.templating import AssistantMaskRenderer, effective_chat_template, load_chat_tokenizer
from mtp_train.errors import UserError
from mtp_train.fileio import (
    OutputLock,
    atomic_write_text,
    check_output_dir,
    read_json_object,
    recover_replaced_directory,
    replace_directory,
    sibling_lock_path,
    write_output_marker,
)
from mtp_train.recipe import Recipe, recipe_hash, save_resolved

logger = logging.getLogger(__name__)


@dataclass
class SplitStats:
    """Samples and tokens written to one split."""

    samples: int = 0
    tokens: int = 0
    assistant_tokens: int = 0


@dataclass
class PrepareStats:
    """Everything counted during one prepare run (written to stats.json)."""

    sources: list[SourceStats] = field(default_factory=list)
    splits: dict[str, SplitStats] = field(default_factory=lambda: {split: SplitStats() for split in SPLITS})
    truncated: int = 0
    offset_fallback: int = 0
    regeneration: RegenerationStats | None = None
    elapsed_s: float = 0.0

    @property
    def rows_read(self) -> int:
        return sum(source.rows_read for source in self.sources)

    @property
    def kept(self) -> int:
        return sum(source.kept for source in self.sources)

    def to_json(self) -> dict[str, Any]:
        skipped: Counter[str] = Counter()
        adjusted: Counter[str] = Counter()
        for source in self.sources:
            skipped.update(source.skipped)
            adjusted.update(source.adjusted)
        split_json = {name: vars(split).copy() for name, split in self.splits.items()}
        return {
            "rows_read": self.rows_read,
            "kept": self.kept,
            "skipped_total": sum(skipped.values()),
            "skipped": dict(sorted(skipped.items())),
            "adjusted": dict(sorted(adjusted.items())),
            "truncated": self.truncated,
            "offset_fallback": self.offset_fallback,
            "tokens": sum(split.tokens for split in self.splits.values()),
            "assistant_tokens": sum(split.assistant_tokens for split in self.splits.values()),
            "splits": split_json,
            "sources": [source.to_json() for source in self.sources],
            "regeneration": vars(self.regeneration).copy() if self.regeneration else None,
            "elapsed_s": round(self.elapsed_s, 3),
            "rows_per_s": round(self.rows_read / self.elapsed_s, 1) if self.elapsed_s > 0 else None,
        }


@dataclass
class PrepareResult:
    """What `prepare_dataset` produced. up_to_date: the existing output already matched and was kept as is."""

    output_dir: Path
    stats: dict[str, Any]
    fingerprint: dict[str, Any]
    up_to_date: bool


# A data-parallel group's sampling seed is offset by this much per group (group 0: the one-process seed).
DP_SEED_STRIDE = 1_000_000_007


class _RegenerationTarget:
    """The target that writes the replies (whole, or this rank's tensor-parallel share of it) with its tokenizer.

    Renders each message list with the chat template (add_generation_prompt=True), generates the batch together
    (one ragged prefill, then batched decode: sequences that finish leave the batch) at `data.regenerate.temperature`
    and `top_p`, each reply up to `data.regenerate.max_new_tokens` tokens and no further than `data.max_seq_len` (what
    truncation would cut is not generated), and returns the decoded replies without the end-of-turn token. A prompt that
    already fills `data.max_seq_len` gets an empty reply: nothing after it would survive truncation, and the
    conversation is cut there."""

    def __init__(self, recipe: Recipe, group: Any, device: Any, precision: Any):
        # local: the runtime (torch, the model) is needed only with data.regenerate; plain prepare runs without it
        from mtp_train.runtime.chat import stop_token_ids
        from mtp_train.runtime.sampler import SamplingParams
        from mtp_train.runtime.tensor_parallel import load_model_tensor_parallel

        self.recipe = recipe
        self.model = load_model_tensor_parallel(recipe.target.path, group, device=device, precision=precision,
                                                backend=recipe.target.attention)
        self.tokenizer = load_chat_tokenizer(recipe.target.path, recipe.data.chat_template)
        self.stops = stop_token_ids(self.tokenizer, self.model.config)
        self.sampling = SamplingParams(temperature=recipe.data.regenerate.temperature,
                                       top_p=recipe.data.regenerate.top_p)

    def replies(self, message_lists: list[list[Message]], seed: int, on_tokens: Any = None) -> list[str]:
        """One reply per message list; `on_tokens(n)` is told each step's newly generated token count."""
        from mtp_train.runtime.chat import encode_chat
        from mtp_train.runtime.generate import generate

        budget, max_new_tokens = self.recipe.data.max_seq_len, self.recipe.data.regenerate.max_new_tokens
        prompts = [encode_chat(self.tokenizer, [dict(m) for m in messages]) for messages in message_lists]
        replies = [""] * len(prompts)
        runnable = [i for i, prompt in enumerate(prompts) if len(prompt) < budget]
        if runnable:
            # Tokens past max_seq_len would be truncated away: not generated.
            limits = [min(max_new_tokens, budget - len(prompts[i])) for i in runnable]
            results, _ = generate(
                self.model, [prompts[i] for i in runnable], limits, self.sampling, stop_token_ids=self.stops,
                seed=seed, on_tokens=(lambda _i, ids: on_tokens(len(ids))) if on_tokens else None,
            )
            for i, result in zip(runnable, results):
                ids = [t for t in result.token_ids if t not in self.stops]
                replies[i] = self.tokenizer.decode(ids, skip_special_tokens=True).strip()
        return replies


class RegenerationRanks:
    """The torchrun ranks of `prepare --regenerate`: W / N data-parallel groups of N = `target.tensor_parallel`
    consecutive ranks, each group one copy of the target split over its ranks (runtime/tensor_parallel.py).

    Rank 0 runs the stage itself (sources, lock, progress file, output) and orders the others through object
    broadcasts: load the target (in rank 0's resolved precision, so every rank takes the same decode path), generate
    a batch, stop. Each batch of conversations is split into contiguous parts, one per data-parallel group; the ranks
    of a group run the same part (their all-reduces line up) and rank 0 gathers the group leaders' replies in group
    order, which is the batch's order. Greedy replies are those of one process (up to the rounding that tensor
    parallelism changes); sampled ones differ, each group drawing from its own seed."""

    def __init__(self, recipe: Recipe):
        import torch

        from mtp_train.runtime.loader import resolve_device
        from mtp_train.runtime.tensor_parallel import ParallelLayout, init_distributed, init_tensor_parallel

        self.layout = ParallelLayout.from_environ(recipe.target.tensor_parallel)
        device = resolve_device(recipe.target.device)
        if device.type == "cuda":
            device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
        self.device = device
        self.dist = init_distributed(device, recipe.distributed.timeout_minutes)
        self.group = init_tensor_parallel(self.layout, device, recipe.distributed.timeout_minutes)
        self.generating = False  # rank 0: the others are inside a batch (a stop order would not meet them)

    def _broadcast(self, order: Any = None) -> Any:
        box = [order]
        self.dist.broadcast_object_list(box, src=0)
        return box[0]

    def load(self, recipe: Recipe, precision: Any) -> _RegenerationTarget:
        """Rank 0: every rank loads its share of the target in `precision`."""
        self._broadcast(("load", precision))
        return _RegenerationTarget(recipe, self.group, self.device, precision)

    def generate(self, target: _RegenerationTarget, message_lists: list[list[Message]], seed: int,
                 on_tokens: Any) -> list[str]:
        """Rank 0: the replies to `message_lists`, in order, generated by all the data-parallel groups."""
        self.generating = True
        self._broadcast(("generate", message_lists, seed))
        mine = self._share(target, message_lists, seed, on_tokens)
        parts: list[Any] = [None] * self.layout.world_size
        self.dist.gather_object(mine, parts, dst=0)
        self.generating = False
        replies: list[str] = []
        for rank in range(0, self.layout.world_size, self.layout.tensor_parallel):  # the group leaders, in order
            group_replies, tokens = parts[rank]
            replies += group_replies
            if rank:
                on_tokens(tokens)
        return replies

    def _share(self, target: _RegenerationTarget, message_lists: list[list[Message]], seed: int,
               on_tokens: Any = None) -> tuple[list[str], int]:
        """This rank's group's part of a batch: its replies and how many tokens it generated."""
        from mtp_train.runtime.tensor_parallel import balanced_range

        start, stop = balanced_range(len(message_lists), self.layout.dp_size, self.layout.dp_rank)
        tokens = [0]

        def count(n: int) -> None:
            tokens[0] += n
            if on_tokens is not None:
                on_tokens(n)

        replies = target.replies(message_lists[start:stop], seed + DP_SEED_STRIDE * self.layout.dp_rank, count)
        return replies, tokens[0]

    def serve(self, recipe: Recipe) -> None:
        """Ranks other than 0: carry out rank 0's orders until it says stop."""
        target = None
        while True:
            order = self._broadcast()
            if order[0] == "stop":
                return
            if order[0] == "load":
                target = _RegenerationTarget(recipe, self.group, self.device, order[1])
                continue
            _, message_lists, seed = order
            assert target is not None, "a generate order before the load order"
            mine = self._share(target, message_lists, seed)
            self.dist.gather_object(mine if self.layout.is_leader else ([], 0), None, dst=0)

    def stop(self) -> None:
        """Rank 0, when the stage ends: the others return. Not while they are inside a batch (rank 0 failed in it):
        then rank 0's exit ends them (torchrun stops the other workers when one fails)."""
        if not self.generating:
            self._broadcast(("stop",))


def _runtime_generate_fn(recipe: Recipe, ranks: RegenerationRanks | None = None) -> GenerateFn:
    """The GenerateFn for `--regenerate`, backed by the target loaded through `mtp_train.runtime`
    (`_RegenerationTarget`): in this process, or with `ranks` (rank 0 under torchrun) over all the ranks. A progress
    bar counts the generated tokens (tokens/s)."""
    from mtp_train.runtime.loader import resolve_device
    from mtp_train.runtime.precision import resolve_section
    from mtp_train.runtime.tensor_parallel import TensorParallelGroup, describe

    device = ranks.device if ranks is not None else resolve_device(recipe.target.device)
    precision = resolve_section(recipe.precision, device)
    print(f"prepare --regenerate: {precision.describe()}", flush=True)
    if ranks is None:
        target = _RegenerationTarget(recipe, TensorParallelGroup(), device, precision)
    else:
        target = ranks.load(recipe, precision)
        print(f"prepare --regenerate: {describe(ranks.layout, target.model.config)}", flush=True)
    calls = [0]
    progress = tqdm(desc="regenerate", unit="tok", unit_scale=True, dynamic_ncols=True)

    def generate_fn(message_lists: list[list[Message]]) -> list[str]:
        seed = recipe.data.seed * 1_000_003 + calls[0]
        calls[0] += 1
        if ranks is None:
            return target.replies(message_lists, seed, progress.update)
        return ranks.generate(target, message_lists, seed, progress.update)

    return generate_fn


@dataclass
class _SamplePipeline:
    """Streams the recipe's sources into sample rows for `Dataset.from_generator`, counting everything."""

    recipe: Recipe
    renderer: AssistantMaskRenderer
    stats: PrepareStats
    strict: bool
    row_limit: int | None
    generate_fn: GenerateFn | None
    regeneration_progress: Path | None
    show_progress: bool
    _seen_source_ids: set[str] = field(default_factory=set)

    def _cleaned(self, conversations: Iterator[Conversation], source_stats: SourceStats) -> Iterator[Conversation]:
        system = self.recipe.data.system_prompt
        for conversation in conversations:
            try:
                cleaned = normalize_for_training(
                    conversation, source_stats, system_mode=system.mode, system_text=system.text
                )
            except RowSkipped as skipped:
                record_skip(source_stats, skipped, self.strict)
                continue
            if cleaned.source_id in self._seen_source_ids:
                suffix = 2
                while f"{cleaned.source_id}~{suffix}" in self._seen_source_ids:
                    suffix += 1
                cleaned.source_id = f"{cleaned.source_id}~{suffix}"
                source_stats.adjusted["duplicate source_id renamed"] += 1
            self._seen_source_ids.add(cleaned.source_id)
            yield cleaned

    def rows(self) -> Iterator[dict[str, Any]]:
        """Sample rows {input_ids, loss_mask, source_id, split}; raises UserError if nothing was kept."""
        data = self.recipe.data
        progress = tqdm(unit=" rows", desc="prepare", disable=not self.show_progress, dynamic_ncols=True)
        # Every source is listed in the stats, including those not reached because a limit was hit first.
        self.stats.sources = [SourceStats(path=source.path, format=source.format) for source in data.sources]
        try:
            for source, source_stats in zip(data.sources, self.stats.sources):
                if self._samples_full() or self._rows_exhausted():
                    break
                yield from self._source_rows(source, source_stats, progress)
        finally:
            progress.close()
        if self.stats.kept == 0:
            skipped = self.stats.to_json()["skipped"]
            raise UserError(f"no samples kept from {self.stats.rows_read} rows read (skipped: {skipped or 'none'})")

    def _samples_full(self) -> bool:
        return self.recipe.data.max_samples is not None and self.stats.kept >= self.recipe.data.max_samples

    def _rows_exhausted(self) -> bool:
        return self.row_limit is not None and self.stats.rows_read >= self.row_limit

    def _source_rows(self, source: Any, source_stats: SourceStats, progress: Any) -> Iterator[dict[str, Any]]:
        data = self.recipe.data
        limits = [limit for limit in (source.limit, self._remaining_rows()) if limit is not None]
        conversations = iter_conversations(
            source.path, source.format, stats=source_stats, strict=self.strict, split=source.split,
            limit=min(limits) if limits else None,
        )
        cleaned = self._cleaned(conversations, source_stats)
        if self.generate_fn is not None:
            assert self.regeneration_progress is not None and self.stats.regeneration is not None
            cleaned = regenerate_conversations(
                cleaned, self.generate_fn, self.regeneration_progress, batch_size=data.regenerate.batch_size,
                stats=self.stats.regeneration, max_turns=data.regenerate.max_turns,
            )
        for conversation in cleaned:
            row = self._tokenized_row(conversation, source_stats)
            progress.update(self.stats.rows_read - progress.n)
            if row is None:
                continue
            yield row
            progress.set_postfix(kept=self.stats.kept, refresh=False)
            if self._samples_full():
                return

    def _remaining_rows(self) -> int | None:
        return None if self.row_limit is None else max(self.row_limit - self.stats.rows_read, 0)

    def _tokenized_row(self, conversation: Conversation, source_stats: SourceStats) -> dict[str, Any] | None:
        data = self.recipe.data
        try:
            for index, message in enumerate(conversation.messages):
                if message["role"] != "system" and not message["content"].strip():
                    detail = f"message {index} ({message['role']}) is empty"
                    raise RowSkipped(f"empty {message['role']} message", detail, malformed=False)
            tokenized = self.renderer.render(conversation.messages, max_tokens=data.max_seq_len)
            if tokenized.truncated and data.overlong == "drop":
                detail = f"{tokenized.untruncated_length} tokens > max_seq_len {data.max_seq_len}"
                raise RowSkipped("longer than max_seq_len", detail, malformed=False)
            if not any(tokenized.loss_mask):
                detail = f"no assistant token within the first {data.max_seq_len} tokens"
                raise RowSkipped("no assistant tokens within max_seq_len", detail, malformed=False)
        except RowSkipped as skipped:
            located = RowSkipped(skipped.reason, f"{conversation.origin}: {skipped.detail}", skipped.malformed)
            record_skip(source_stats, located, self.strict)
            return None

        input_ids, loss_mask = tokenized.input_ids, tokenized.loss_mask
        self.stats.truncated += tokenized.truncated
        self.stats.offset_fallback += tokenized.used_offset_fallback
        split = eval_split_of(conversation.source_id, data.seed, data.eval_fraction)
        split_stats = self.stats.splits[split]
        split_stats.samples += 1
        split_stats.tokens += len(input_ids)
        split_stats.assistant_tokens += sum(loss_mask)
        source_stats.kept += 1
        return {"input_ids": input_ids, "loss_mask": loss_mask, "source_id": conversation.source_id, "split": split}


def _inputs_fingerprint(recipe: Recipe, tokenizer_digest: str, row_limit: int | None) -> dict[str, Any]:
    """Everything the prepared data depends on; equal inputs → the existing output is reused. With
    `data.regenerate` the replies are the target's, computed in the recipe's `precision` (compute, decode, K/V
    cache): those keys too."""
    sources = [{"path": source.path, "sha256": path_content_hash(source.path)} for source in recipe.data.sources]
    fingerprint = {
        "format_version": PREPARED_FORMAT_VERSION,
        "code_version": mtp_train.__version__,
        "recipe_target_data_hash": recipe_hash(recipe, ["target", "data"]),
        "tokenizer_hash": tokenizer_digest,
        "sources": sources,
        "row_limit": row_limit,
    }
    if recipe.data.regenerate.enabled:
        fingerprint["regeneration_precision"] = recipe.precision.model_dump(include={"compute", "decode", "kv_cache"})
    return fingerprint


def prepare_dataset(
    recipe: Recipe,
    *,
    strict: bool = False,
    row_limit: int | None = None,
    force: bool = False,
    generate_fn: GenerateFn | None = None,
    show_progress: bool = True,
    ranks: RegenerationRanks | None = None,
) -> PrepareResult:
    """Run the prepare stage for `recipe` and return where the data went with its stats and fingerprint.

    strict: a malformed row is a UserError instead of a counted skip. row_limit: read at most this many rows over
    all sources. force: rebuild even if the output's inputs_hash matches. generate_fn: replies for regeneration
    (default when `data.regenerate.enabled`: the runtime's, generated over `ranks` when given: rank 0 under
    torchrun, `prepare_on_ranks`); ignored when regeneration is disabled.

    Work happens in the hidden sibling `.<output name>.work/`; on failure only the regeneration progress file is
    kept there (so a rerun resumes it), on success the directory is removed. One prepare per output at a time: a
    second one stops at once, naming the holder of `.<output name>.lock`.
    """
    output_dir = recipe.prepared_dir

    def busy(who: str) -> str:
        return (f"data.output_dir {output_dir}: another prepare ({who}) is writing this dataset; wait for it, stop "
                "it, or choose another data.output_dir")

    with OutputLock(sibling_lock_path(output_dir), busy, label="prepare"):
        return _prepare_locked(recipe, strict=strict, row_limit=row_limit, force=force, generate_fn=generate_fn,
                               show_progress=show_progress, ranks=ranks)


def prepare_on_ranks(recipe: Recipe, *, strict: bool = False, row_limit: int | None = None, force: bool = False,
                     show_progress: bool = True) -> PrepareResult | None:
    """`prepare_dataset` in this process, or under torchrun (WORLD_SIZE > 1) over its ranks: rank 0 runs the stage
    and the target's replies of `data.regenerate` are generated by all ranks (`RegenerationRanks`, with
    `target.tensor_parallel` ranks per copy of the target), so no device needs to hold the whole target. Returns
    rank 0's result; None on the other ranks."""
    if int(os.environ.get("WORLD_SIZE", 1)) <= 1:
        return prepare_dataset(recipe, strict=strict, row_limit=row_limit, force=force, show_progress=show_progress)
    ranks = RegenerationRanks(recipe)
    if ranks.layout.rank != 0:
        ranks.serve(recipe)
        return None
    try:
        return prepare_dataset(recipe, strict=strict, row_limit=row_limit, force=force, show_progress=show_progress,
                               ranks=ranks)
    finally:
        ranks.stop()


def _prepare_locked(recipe: Recipe, *, strict: bool, row_limit: int | None, force: bool,
                    generate_fn: GenerateFn | None, show_progress: bool,
                    ranks: RegenerationRanks | None) -> PrepareResult:
    """`prepare_dataset` with its output's lock held."""
    started = time.perf_counter()
    data = recipe.data
    output_dir = recipe.prepared_dir

    tokenizer = load_chat_tokenizer(recipe.target.path, data.chat_template)
    tokenizer_digest = tokenizer_hash(recipe.target.path, effective_chat_template(tokenizer))
    for source in data.sources:
        if not Path(source.path).exists():
            raise UserError(f"data.sources: {source.path}: not found")
    inputs = _inputs_fingerprint(recipe, tokenizer_digest, row_limit)
    inputs_hash = hashlib.sha256(json.dumps(inputs, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    recover_replaced_directory(output_dir)  # a previous replace killed between its renames
    if not force and _is_up_to_date(output_dir, inputs_hash):
        logger.info("%s is up to date (same recipe, tokenizer and sources); --force rebuilds it", output_dir)
        stats_json = read_json_object(output_dir / STATS_FILENAME)
        return PrepareResult(output_dir, stats_json, read_json_object(output_dir / FINGERPRINT_FILENAME), True)

    check_output_dir(output_dir, "prepared", "data.output_dir")  # never replace what prepare did not write
    stats = PrepareStats()
    work_dir = output_dir.with_name(f".{output_dir.name}.work")
    regeneration_progress: Path | None = None
    if data.regenerate.enabled:
        generate_fn = generate_fn if generate_fn is not None else _runtime_generate_fn(recipe, ranks)
        # The progress file is tied to everything the replies depend on, so changed settings never reuse it.
        settings = recipe_hash(recipe, ["target", "precision"]) + data.regenerate.model_dump_json() + tokenizer_digest
        settings += data.system_prompt.model_dump_json()
        regeneration_progress = work_dir / f"regenerated-{hashlib.sha256(settings.encode()).hexdigest()[:12]}.jsonl"
        stats.regeneration = RegenerationStats()
    else:
        generate_fn = None

    pipeline = _SamplePipeline(
        recipe, AssistantMaskRenderer(tokenizer), stats, strict=strict, row_limit=row_limit, generate_fn=generate_fn,
        regeneration_progress=regeneration_progress, show_progress=show_progress,
    )
    staging_dir = work_dir / "staging"
    cache_dir = work_dir / "hf_cache"
    try:
        for scratch in (staging_dir, cache_dir):
            shutil.rmtree(scratch, ignore_errors=True)
        staging_dir.mkdir(parents=True)
        dataset_hash = _write_splits(pipeline, cache_dir, staging_dir, inputs_hash)

        stats.elapsed_s = time.perf_counter() - started
        stats_json = stats.to_json()
        stats_json["options"] = {"strict": strict, "row_limit": row_limit, "regenerate": data.regenerate.enabled}
        fingerprint = {
            "format_version": PREPARED_FORMAT_VERSION,
            "tokenizer_hash": tokenizer_digest,
            "dataset_hash": dataset_hash,
            "inputs_hash": inputs_hash,
            "inputs": inputs,
            "target_path": recipe.target.path,
            "samples": {split: stats.splits[split].samples for split in SPLITS},
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        atomic_write_text(staging_dir / STATS_FILENAME, json.dumps(stats_json, indent=2) + "\n")
        atomic_write_text(staging_dir / FINGERPRINT_FILENAME, json.dumps(fingerprint, indent=2) + "\n")
        save_resolved(recipe, staging_dir)
        write_output_marker(staging_dir, "prepared")
        if regeneration_progress is not None and regeneration_progress.exists():
            shutil.copyfile(regeneration_progress, staging_dir / REGENERATED_FILENAME)
        replace_directory(staging_dir, output_dir)
    except BaseException as err:
        for scratch in (staging_dir, cache_dir):
            shutil.rmtree(scratch, ignore_errors=True)
        if work_dir.is_dir() and not any(work_dir.iterdir()):
            work_dir.rmdir()
        if isinstance(err, OSError) and not err.filename:  # a full disk inside `datasets`: name where it wrote
            err.filename = str(work_dir)
        raise
    shutil.rmtree(work_dir, ignore_errors=True)
    return PrepareResult(output_dir, stats_json, fingerprint, False)


def _is_up_to_date(output_dir: Path, inputs_hash: str) -> bool:
    """Whether `output_dir` holds a complete prepared dataset made from exactly these inputs."""
    if not all((output_dir / name).exists() for name in (*SPLITS, STATS_FILENAME, FINGERPRINT_FILENAME)):
        return False
    try:
        return read_json_object(output_dir / FINGERPRINT_FILENAME).get("inputs_hash") == inputs_hash
    except UserError:
        return False


def _write_splits(pipeline: _SamplePipeline, cache_dir: Path, staging_dir: Path, inputs_hash: str) -> str:
    """Run the pipeline, save the train/eval datasets under `staging_dir`, return their dataset_content_hash."""
    progress_bars_were_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # our own tqdm bar reports progress
    try:
        all_rows = _generate_dataset(pipeline, cache_dir, inputs_hash)
        saved = {}
        for split in SPLITS:
            selected = all_rows.filter(
                lambda names, wanted=split: [name == wanted for name in names], input_columns="split", batched=True
            )
            selected.remove_columns("split").save_to_disk(str(staging_dir / split))
            saved[split] = datasets.load_from_disk(str(staging_dir / split))
        return dataset_content_hash(saved)
    finally:
        if progress_bars_were_enabled:
            datasets.enable_progress_bars()


def _generate_dataset(pipeline: _SamplePipeline, cache_dir: Path, inputs_hash: str) -> Any:
    """All sample rows as one Dataset (with a `split` column), written under `cache_dir`."""
    features = prepared_features().copy()
    features["split"] = datasets.Value("string")
    try:
        return datasets.Dataset.from_generator(
            pipeline.rows, features=features, cache_dir=str(cache_dir),
            fingerprint=f"prepare-{inputs_hash[:16]}-{time.time_ns()}",
        )
    except Exception as err:  # datasets wraps errors raised inside the generator; surface ours unchanged
        cause: BaseException | None = err
        while cause is not None:
            if isinstance(cause, (UserError, KeyboardInterrupt)):
                raise cause from None
            cause = cause.__cause__ or cause.__context__
        raise
