"""`mtp-train precompute`: run the target through our runtime over the prepared data and cache its hidden states.

Runs alone or under `torchrun --nproc_per_node=N -m mtp_train precompute ...` (multi-node too). The work plan is a
pure function of the prepared data, the world size and the recipe: samples are sorted by length and dealt
round-robin to ranks (balanced, disjoint), each rank cuts its list into shards of `samples_per_shard`, and packs
each shard into batches of at most `tokens_per_batch` tokens run as one ragged prefill (no padding, no logits).
With `target.tensor_parallel` N (`--tp N`) the "ranks" of that plan are the W / N data-parallel groups of N
consecutive ranks (runtime/tensor_parallel.py): the N ranks of a group run one target split over them on the same
batches, and the group's leader writes the group's shards and progress file (named by the group's index).
A shard is recorded in the rank's progress file only after its file is completely written (atomic rename), so a
rerun after a kill skips finished shards and recomputes the rest identically.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import torch
import torch.distributed as dist
from tqdm import tqdm

from mtp_train.data.prepared import load_prepared, tokenizer_fingerprint, tokenizer_mismatch
from mtp_train.errors import UserError
from mtp_train.features.format import (
    FORMAT_VERSION,
    MANIFEST_FILENAME,
    decode_hidden,
    encode_hidden,
    load_manifest,
    pack_batches,
    progress_path,
    shard_name,
    shard_sha256_ok,
    write_shard,
)
from mtp_train.features.vllm_target import VllmTarget, engine_devices
from mtp_train.fileio import (
    OutputLock,
    check_output_dir,
    read_json_object,
    sibling_lock_path,
    write_json_atomic,
    write_output_marker,
)
from mtp_train.fingerprint import target_fingerprint
from mtp_train.recipe import canonical_hash, recipe_to_dict, save_resolved, with_precision
from mtp_train.runtime.attention import BatchInfo
from mtp_train.runtime.config import load_config
from mtp_train.runtime.distributed import init_process_group
from mtp_train.runtime.loader import resolve_device
from mtp_train.runtime.precision import TORCH_DTYPES, resolve_section
from mtp_train.runtime.tensor_parallel import (
    ParallelLayout,
    describe,
    init_tensor_parallel,
    load_model_tensor_parallel,
)

log = logging.getLogger(__name__)
SPLITS = ("train", "eval")
VLLM_WORK_DIR = ".vllm"  # backend vllm: its worker's log and the per-sample files on their way


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @staticmethod
    def from_environ() -> "DistEnv":
        return DistEnv(
            int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))
        )


def plan_rank_shards(lengths: list[int], rank: int, world_size: int, samples_per_shard: int) -> list[list[int]]:
    """This rank's shards as lists of sample indices: longest first, dealt round-robin over ranks."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    mine = order[rank::world_size]
    return [mine[k : k + samples_per_shard] for k in range(0, len(mine), samples_per_shard)]


def _split_lengths(dataset) -> list[int]:
    column = dataset.with_format("arrow")[:].column("input_ids").combine_chunks()
    return column.value_lengths().to_pylist()


def _target_argmax(weight: torch.Tensor, hidden: torch.Tensor, storage_dtype: str, chunk_rows: int = 1024
                   ) -> torch.Tensor:
    """[T] int64: argmax of the target's lm_head (`weight` [V, d]) over H as stored (rounded to `storage_dtype` and
    back), so the label matches what training recomputes from the cache; `chunk_rows` rows at a time ([rows, vocab]
    logits)."""

    hidden = hidden.to(weight.device)
    labels = []
    for chunk in hidden.split(chunk_rows):
        stored, scale = encode_hidden(chunk, storage_dtype)
        restored = decode_hidden(stored, scale, weight.dtype)
        labels.append((restored @ weight.T).argmax(-1))
    return torch.cat(labels)


def _settings_hash(recipe) -> str:
    """The hash of the settings the stored states depend on: the precompute section and the `precision` keys
    precompute reads (under the names the cache's manifest gives them, storage_dtype and kv_dtype, so that a cache
    keeps its fingerprint); with the runtime backend without the backend's keys, so that caches written before there
    was a choice of backend keep their fingerprint; with vLLM without where its interpreter lives (its version is
    compared on its own)."""

    data = recipe_to_dict(recipe)
    section = {**data["precompute"], "storage_dtype": data["precision"]["features"],
               "kv_dtype": data["precision"]["kv_cache"]}
    if section["backend"] == "runtime":
        del section["backend"], section["vllm"]
    else:
        del section["vllm"]["python"]
    return canonical_hash({"precompute": section})


def _header(recipe, prepared, target_fp: str, world_size: int, hidden_size: int) -> dict[str, Any]:

    return {
        "format_version": FORMAT_VERSION,
        "fingerprints": {
            "target": target_fp,
            "tokenizer": prepared.fingerprint.get("tokenizer_hash"),
            "dataset": prepared.fingerprint.get("dataset_hash"),
            "recipe": _settings_hash(recipe)[:16],
        },
        "target_path": str(recipe.target.path),
        "tokenizer_source": prepared.fingerprint.get("target_path"),
        "chat_template": recipe.data.chat_template,
        "target_dtype": recipe.precision.compute,
        "storage_dtype": recipe.precision.features,
        "hidden_size": hidden_size,
        "aux_layers": list(recipe.precompute.aux_layers),
        "target_argmax": recipe.precompute.target_argmax,
        "world_size": world_size,
    }


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _resolve_features_precision(section, device: torch.device, dist, rank: int):
    """The recipe's `precision` resolved once for precompute (by rank 0, every rank takes its answer): the compute
    dtype of the prefills, and the K/V cache the stored states are computed as if over (`precision.kv_cache`). The
    stored hidden states train a head that is served over the target's paged K/V cache, whose rows are rounded once
    as they are written (bf16 where decode reads bf16 or int8 weights: an fp32 model on an AVX2-only CPU); over
    unrounded K/V the states differ by that rounding, and near-ties of the target's argmax resolve otherwise than in
    serving (docs/benchmarks.md, "Precision on CPUs"). `auto` is the cache `eval` decodes over (decode timing
    included)."""
    precision = resolve_section(section, device, phases=("prefill", "kv_cache")) if rank == 0 else None
    if dist is not None:
        box = [precision]
        dist.broadcast_object_list(box, src=0)
        precision = box[0]
    return precision


def _check_token_ids(splits: dict[str, Any], vocab_size: int, prepared_dir: Path, target_path: str) -> None:
    """Refuse prepared data holding a token id the target has no embedding row for (a tokenizer whose added tokens
    lie beyond the model's vocabulary, or ids edited by hand): named here, by split, sample and id, instead of an
    IndexError (or a CUDA device assert) inside the first forward that meets it."""

    for split, dataset in splits.items():
        if len(dataset) == 0:
            continue
        ids = dataset.with_format("arrow")[:].column("input_ids").combine_chunks().flatten()
        low, high = pc.min_max(ids).values()
        if low.as_py() >= 0 and high.as_py() < vocab_size:
            continue
        for index, row in enumerate(dataset.select_columns(["input_ids", "source_id"])):
            bad = [t for t in row["input_ids"] if not 0 <= t < vocab_size]
            if bad:
                raise UserError(
                    f"{prepared_dir / split}: sample {index} (source {row['source_id']!r}) holds token id {bad[0]}, "
                    f"outside the target's vocabulary (vocab_size {vocab_size} in {Path(target_path) / 'config.json'}"
                    "): the tokenizer that prepared the data makes ids this model has no embedding for (added "
                    "tokens?). Use the tokenizer that belongs to the model, then re-run `mtp-train prepare --force`")


def _check_finite(hidden: torch.Tensor, aux, batch_lengths: list[int], batch_indices: list[int], split: str,
                  prepared_dir: Path, dtype: str) -> None:
    """Refuse to store states that are NaN or infinite (an overflow in float16, a damaged checkpoint): the samples
    named, nothing of the batch written."""
    finite = torch.isfinite(hidden).all(dim=-1)  # [T]
    if aux is not None:
        finite &= torch.isfinite(aux).flatten(1).all(dim=-1)
    if bool(finite.all()):
        return
    bad = [index for index, ok in zip(batch_indices, finite.split(batch_lengths)) if not bool(ok.all())]
    raise UserError(f"{prepared_dir / split}: the target's hidden states are NaN or infinite for sample(s) "
                    f"{', '.join(map(str, bad[:8]))}{' and more' if len(bad) > 8 else ''} (computed in {dtype}); "
                    "nothing of that batch was stored. float16 overflows in large activations: use precision.compute "
                    "bfloat16 or float32; otherwise check the model's weights (`mtp-train generate` on one prompt)")


def _check_tokenizer(recipe, prepared) -> None:
    """Refuse a target whose tokenizer is not the one that tokenized the prepared data (same hash as `prepare`)."""

    data_tokenizer = prepared.fingerprint.get("tokenizer_hash")
    if data_tokenizer is None:
        return
    target_tokenizer = tokenizer_fingerprint(recipe.target.path, recipe.data.chat_template)
    if target_tokenizer != data_tokenizer:
        where = Path(recipe.prepared_dir) / "fingerprint.json"
        raise UserError(tokenizer_mismatch(where, data_tokenizer, prepared.fingerprint.get("target_path"),
                                           recipe.target.path, target_tokenizer))


def _compare_headers(existing: dict[str, Any], current: dict[str, Any], where: Path) -> None:
    # target_dtype: the compute dtype as resolved (a cache whose shards mix bf16- and fp32-computed states would train
    # a head on two targets at once)
    defaults = {"backend": "runtime"}  # caches written before there was a choice of backend
    for key in ("format_version", "backend", "vllm_version", "target_dtype", "storage_dtype", "hidden_size",
                "aux_layers", "target_argmax", "world_size", "kv_dtype"):
        if existing.get(key, defaults.get(key)) != current.get(key, defaults.get(key)):
            raise UserError(
                f"{where}: existing cache has {key}={existing.get(key, defaults.get(key))!r}, this run "
                f"{current.get(key, defaults.get(key))!r}; refusing to "
                "mix (use the same settings to resume, another precompute.output_dir, or --force to start over)"
            )
    for key, value in current["fingerprints"].items():
        if existing.get("fingerprints", {}).get(key) != value:
            raise UserError(
                f"{where}: fingerprint '{key}' differs from the existing cache "
                f"({existing.get('fingerprints', {}).get(key)} vs {value}); refusing to append (another "
                "precompute.output_dir, or --force to start over)"
            )


class _GlobalProgress:
    """Rank 0's progress bar over all ranks' tokens. Other ranks publish their token count in a small heartbeat
    file every few seconds (`.heartbeat-r{rank}`); rank 0 adds them to its own."""

    def __init__(self, root: Path, env: DistEnv, total_tokens: int, done_tokens: int):

        self.root, self.env = root, env
        self.own_tokens = done_tokens
        self.bar = tqdm(total=total_tokens, unit="tok", unit_scale=True, desc="precompute", disable=env.rank != 0,
                        smoothing=0.1)
        self._last = 0.0
        self._publish()
        self.bar.update(min(total_tokens, self._all_tokens()))

    def _heartbeat(self, rank: int) -> Path:
        return self.root / f".heartbeat-r{rank}"

    def _publish(self) -> None:
        if self.env.rank != 0:
            tmp = self.root / f".heartbeat-r{self.env.rank}.tmp"
            tmp.write_text(str(self.own_tokens))
            os.replace(tmp, self._heartbeat(self.env.rank))

    def _all_tokens(self) -> int:
        total = self.own_tokens
        for rank in range(1, self.env.world_size):
            try:
                total += int(self._heartbeat(rank).read_text() or 0)
            except (OSError, ValueError):
                pass
        return total

    def advance(self, tokens: int) -> None:
        self.own_tokens += tokens
        now = time.monotonic()
        if now - self._last < 2.0:
            return
        self._last = now
        self._show()

    def _show(self) -> None:
        """Rank 0: the bar at all ranks' tokens; other ranks: publish their own."""
        self._publish()
        if self.env.rank == 0:
            self.bar.n = min(self.bar.total, self._all_tokens())
            self.bar.refresh()

    def close(self) -> None:
        self._show()
        self.bar.close()


class _NoProgress:
    """A follower rank of a tensor-parallel group: its leader counts the group's tokens."""

    def advance(self, tokens: int) -> None:
        pass

    def close(self) -> None:
        pass


def run_precompute(recipe, force: bool = False, env: DistEnv | None = None) -> Path:
    """Compute (or finish) the feature cache of `recipe`; returns its directory. Collective under torchrun. One
    precompute per cache at a time: rank 0 holds `.<cache name>.lock` beside it (pid, host, command), and a second
    run stops at once naming the holder, before it deletes or writes anything (a killed run's cleanup of temporary
    files could otherwise remove a live run's)."""
    env = env or DistEnv.from_environ()
    group_device = _group_device(recipe)  # before the lock: "cuda" without CUDA stops here
    root = recipe.features_dir

    def busy(who: str) -> str:
        return (f"precompute.output_dir {root}: another precompute ({who}) is writing this cache; wait for it, stop "
                "it, or choose another precompute.output_dir")

    lock, refused = None, None
    if env.rank == 0:
        try:
            lock = OutputLock(sibling_lock_path(root), busy, label="precompute").acquire()
        except UserError as err:
            refused = str(err)
    dist = _init_distributed(env, group_device, recipe.distributed.timeout_minutes)
    if dist is not None:  # every rank stops with rank 0's refusal instead of waiting for it at a barrier
        box = [refused]
        dist.broadcast_object_list(box, src=0)
        refused = box[0]
    if refused:
        raise UserError(refused)
    try:
        return _run_precompute_locked(recipe, force, env, dist)
    finally:
        if lock is not None:
            lock.release()


class _RuntimeTarget:
    """The target run by this package's runtime (optionally tensor-parallel over torchrun ranks): the same interface
    as `vllm_target.VllmTarget`."""

    def __init__(self, recipe, env: DistEnv, dist, layout, group):

        device = resolve_device(recipe.target.device)  # "cuda" without CUDA is an error, not a silent CPU run
        if device.type == "cuda":
            device = torch.device(f"cuda:{env.local_rank}")
        precision = _resolve_features_precision(recipe.precision, device, dist, env.rank)
        self.recipe = with_precision(recipe, precision.recipe_values())
        if env.rank == 0:
            print(f"precompute: {precision.describe()}", flush=True)
        model = load_model_tensor_parallel(recipe.target.path, group, dtype=precision.dtype, device=device,
                                          backend=recipe.target.attention)
        if env.rank == 0 and layout.tensor_parallel > 1:
            print(f"precompute: {describe(layout, model.config)}", flush=True)
        model.kv_cache_dtype = TORCH_DTYPES[precision.kv_cache_dtype or precision.dtype]
        # Keys and values are rounded where the cache is narrower than the compute dtype (a model whose cache keeps
        # its own dtype, DeepSeek's latents, says so through `kv_cache_torch_dtype`: never rounded).
        self.kv_round = model.kv_cache_torch_dtype if model.kv_cache_torch_dtype != model.dtype else None
        self.model, self.device, self.layout = model, device, layout
        self.dtype = precision.dtype
        self.kv_dtype = _dtype_name(self.kv_round or model.dtype)  # the K/V the stored states attended over
        self.lm_head_weight = model.lm_head.weight
        self.aux_layers = tuple(recipe.precompute.aux_layers)

    def header_fields(self) -> dict[str, Any]:
        return {"backend": "runtime", "kv_dtype": self.kv_dtype,
                "tensor_parallel": self.layout.tensor_parallel}  # informational: TP changes rounding, not layout

    def forward(self, ids: list[torch.Tensor], lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(H [T, d], aux [T, len(aux_layers), d] or None); None on a follower of a tensor-parallel group."""

        out = self.model(torch.cat(ids).to(self.device),
                         BatchInfo.without_cache(lengths, self.device, kv_dtype=self.kv_round),
                         compute_logits=False, return_hidden=True, aux_layers=self.aux_layers)
        if not self.layout.is_leader:  # its part of the group's forward is done
            return None
        aux = torch.stack([out.aux_hidden[j] for j in self.aux_layers], dim=1) if self.aux_layers else None
        return out.hidden, aux

    def flops(self, lengths: list[int], argmax_rows: int) -> float:
        return self.model.prefill_flops(lengths, argmax_rows)

    def close(self, abort: bool = False) -> None:
        pass


def _run_precompute_locked(recipe, force: bool, env: DistEnv, dist) -> Path:
    """`run_precompute` with the cache's lock held by rank 0."""

    pre = recipe.precompute
    if pre.backend == "vllm" and recipe.target.tensor_parallel > 1:
        raise UserError("precompute.backend vllm spreads the target with vLLM's own parallelism "
                        "(precompute.vllm.tensor_parallel_size, pipeline_parallel_size), not target.tensor_parallel: "
                        "leave it at 1 (torchrun ranks are data parallelism: one engine each)")
    if pre.backend == "vllm" and recipe.precision.kv_cache != "auto":
        raise UserError(f"precision.kv_cache {recipe.precision.kv_cache} is the runtime's K/V cache; with "
                        "precompute.backend vllm the stored states attend over vLLM's cache "
                        "(precompute.vllm.kv_cache_dtype): leave precision.kv_cache auto for precompute")
    layout = ParallelLayout(env.rank, env.world_size, recipe.target.tensor_parallel)
    group = init_tensor_parallel(layout, _group_device(recipe), recipe.distributed.timeout_minutes)
    # Shards, progress files and heartbeats belong to data-parallel groups: `writer` numbers them (== env without TP).
    writer = DistEnv(layout.dp_rank, layout.dp_size, env.local_rank)
    root = recipe.features_dir
    prepared_dir = recipe.prepared_dir
    prepared = load_prepared(prepared_dir)
    splits = {"train": prepared.train, "eval": prepared.eval}
    config = load_config(recipe.target.path)
    _check_tokenizer(recipe, prepared)  # before --force deletes anything and before any forward
    _check_token_ids(splits, config.vocab_size, Path(prepared_dir), recipe.target.path)
    num_layers = config.num_hidden_layers
    bad_layers = [j for j in pre.aux_layers if j >= num_layers]
    if bad_layers:
        raise UserError(f"precompute.aux_layers: {bad_layers} out of range; the target has {num_layers} layers (0-based)")
    check_output_dir(root, "features", "precompute.output_dir")  # a directory precompute did not write: untouched
    _barrier(dist)  # every rank has checked before rank 0 deletes anything

    if force and env.rank == 0 and root.exists():
        shutil.rmtree(root)
    _barrier(dist)

    split_lengths = {split: _split_lengths(ds) for split, ds in splits.items()}
    if pre.backend == "vllm":

        if _vllm_cache_is_complete(recipe, prepared, config, root, env.world_size):
            return root
        if env.rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            write_output_marker(root, "features")
        _barrier(dist)
        # Data parallelism: each torchrun rank runs an engine of its own over its share of the samples.
        devices = engine_devices(pre.vllm, env.local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                                 torch.cuda.device_count() if recipe.target.device != "cpu" else 0)
        work_dir = root / VLLM_WORK_DIR / (f"rank{env.rank}" if env.world_size > 1 else "")
        target = VllmTarget(recipe, config, work_dir, max(max(v, default=1) for v in split_lengths.values()), devices)
        print(f"precompute: rank {env.rank} starting vLLM ({target.capture.python}"
              + (f", CUDA devices {devices}" if devices is not None else "")
              + f"; its log: {target.capture.log_path})", flush=True)
        try:
            info = target.start(want_lm_head=pre.target_argmax)
        except BaseException:
            target.close(abort=True)
            raise
        print(f"precompute: vLLM {info['vllm']} on {info['device']}, computing in {info['dtype']}, K/V cache "
              f"{target.kv_dtype}", flush=True)
        recipe = with_precision(recipe, {"compute": info["dtype"]})
    else:
        target = _RuntimeTarget(recipe, env, dist, layout, group)
        recipe = target.recipe
    try:
        result = _compute(recipe, target, env, dist, layout, group, writer, prepared, splits, split_lengths,
                          config.hidden_size, target_fingerprint(recipe.target.path))
    except BaseException:
        target.close(abort=True)  # an error or ^C: vLLM's engine ends now, not after its batch
        raise
    target.close()
    return result


def _vllm_cache_is_complete(recipe, prepared, config, root: Path, world_size: int) -> bool:
    """A finished cache checked without starting vLLM (a minute or more): the engine's facts (the dtype `auto`
    resolved to, vLLM's version, the K/V dtype) taken from its manifest, everything else compared as always."""
    if not (root / MANIFEST_FILENAME).is_file():
        return False

    manifest = load_manifest(root)
    dtype = manifest.get("target_dtype") if recipe.precision.compute == "auto" else recipe.precision.compute
    header = _header(with_precision(recipe, {"compute": dtype}), prepared,
                     target_fingerprint(recipe.target.path), world_size, config.hidden_size)
    header.update(backend="vllm", vllm_version=manifest.get("vllm_version"), kv_dtype=manifest.get("kv_dtype"))
    _compare_headers(manifest, header, root / MANIFEST_FILENAME)
    print(f"precompute: {root} is already complete ({_summary(manifest)}); nothing to do")
    return True


def _compute(recipe, target, env: DistEnv, dist, layout, group, writer: DistEnv, prepared, splits, split_lengths,
             hidden_size: int, target_fp: str) -> Path:
    """The shards this writer has left, computed by `target` and written; the manifest once all are done."""

    pre = recipe.precompute
    root = recipe.features_dir
    prepared_dir = recipe.prepared_dir
    header = _header(recipe, prepared, target_fp, writer.world_size, hidden_size)
    header.update(target.header_fields())

    if (root / MANIFEST_FILENAME).is_file():
        manifest = load_manifest(root)
        _compare_headers(manifest, header, root / MANIFEST_FILENAME)
        if env.rank == 0:
            print(f"precompute: {root} is already complete ({_summary(manifest)}); nothing to do")
        _barrier(dist)
        return root

    root.mkdir(parents=True, exist_ok=True)
    if env.rank == 0:
        write_output_marker(root, "features")
    my_progress = progress_path(root, writer.rank)
    done: dict[str, dict[str, Any]] = {}
    refused = None  # the leader's reason to stop, passed to its group so that no rank waits for it
    if layout.is_leader:
        for stale in [*root.glob(f"*/.shard-r{writer.rank}-*.tmp-*"),
                      *root.glob(f".progress-r{writer.rank}.json.tmp-*")]:
            stale.unlink(missing_ok=True)  # a write interrupted by a kill
        if my_progress.is_file():
            try:
                existing = read_json_object(my_progress)
                _compare_headers(existing["header"], header, my_progress)
            except UserError as err:
                refused = str(err)
            else:
                # Keep only shards whose file is intact; a damaged one is recomputed.
                done = {name: rec for name, rec in existing["shards"].items() if shard_sha256_ok(root, rec)}
    # The group's ranks run the same forwards: the leader's view of what is left.
    done, refused = group.broadcast_object((done, refused))
    if refused:
        raise UserError(refused)
    if env.rank == 0:
        save_resolved(recipe, root)

    work: list[tuple[str, int, list[int], list[int]]] = []  # (split, shard index, sample indices, lengths)
    total_tokens = done_tokens = 0
    for split, lengths in split_lengths.items():
        total_tokens += sum(lengths)  # all ranks: rank 0's bar shows the global view
        for index, shard in enumerate(plan_rank_shards(lengths, writer.rank, writer.world_size,
                                                       pre.samples_per_shard)):
            name = shard_name(split, writer.rank, index)
            if name in done:
                done_tokens += done[name]["num_tokens"]
            else:
                work.append((split, index, shard, lengths))

    progress = _GlobalProgress(root, writer, total_tokens, done_tokens) if layout.is_leader else _NoProgress()
    started = time.perf_counter()
    computed_tokens = 0
    computed_flops = 0.0
    try:
        for split, index, shard, lengths in work:
            dataset = splits[split]
            samples = []
            for batch_indices in pack_batches(shard, lengths, pre.tokens_per_batch):
                rows = dataset.select(batch_indices)
                ids = [torch.tensor(r, dtype=torch.int64) for r in rows["input_ids"]]
                masks = [torch.tensor(m, dtype=torch.uint8) for m in rows["loss_mask"]]
                batch_lengths = [len(t) for t in ids]
                out = target.forward(ids, batch_lengths)
                if out is None:  # a follower of a tensor-parallel group: its part of the forward is done
                    continue
                hidden, aux_stack = out
                _check_finite(hidden, aux_stack, batch_lengths, batch_indices, split, Path(prepared_dir),
                              target.dtype)
                hidden_rows = hidden.cpu().split(batch_lengths)
                argmax_rows = (
                    _target_argmax(target.lm_head_weight, hidden, recipe.precision.features).cpu().split(batch_lengths)
                    if pre.target_argmax
                    else [None] * len(ids)
                )
                aux_rows = aux_stack.cpu().split(batch_lengths) if aux_stack is not None else [None] * len(ids)
                for sample_index, token_ids, mask, hidden, argmax, aux in zip(
                    batch_indices, ids, masks, hidden_rows, argmax_rows, aux_rows
                ):
                    samples.append(
                        {"sample_index": sample_index, "input_ids": token_ids, "loss_mask": mask, "hidden": hidden,
                         "target_argmax": argmax, "aux_hidden": aux}
                    )
                progress.advance(sum(batch_lengths))
                computed_tokens += sum(batch_lengths)
                computed_flops += target.flops(batch_lengths, sum(batch_lengths) if pre.target_argmax else 0)
            if not layout.is_leader:
                continue
            name = shard_name(split, writer.rank, index)
            record = write_shard(root / name, samples, recipe.precision.features)
            done[name] = {"name": name, "split": split, "rank": writer.rank, "index": index, **record}
            write_json_atomic(my_progress, {"header": header, "shards": done})
    finally:
        progress.close()
    elapsed = time.perf_counter() - started
    if computed_tokens:
        log.info("rank %d: %d tokens in %.1f s (%.0f tokens/s)", env.rank, computed_tokens, elapsed,
                 computed_tokens / max(elapsed, 1e-9))
    own = {"tokens": computed_tokens, "seconds": elapsed, "flops": computed_flops}
    ranks = [own]
    if dist is not None:
        ranks = [None] * env.world_size
        dist.all_gather_object(ranks, own)
    _barrier(dist)
    if env.rank == 0:
        throughput = _throughput(ranks, target.dtype)
        manifest = _merge_manifest(root, header, split_lengths, throughput)
        print(f"precompute: wrote {root} ({_summary(manifest)})")
        if throughput:
            print(f"precompute: {_describe_throughput(throughput)}")
    _barrier(dist)
    return root


def _throughput(ranks: list[dict[str, Any]], dtype: str) -> dict[str, Any] | None:
    """This run's speed over all ranks: tokens/s and, where the target's FLOPs are counted, GFLOP/s (None if nothing
    ran)."""
    tokens = sum(r["tokens"] for r in ranks)
    seconds = max(r["seconds"] for r in ranks)
    if not tokens or seconds <= 0:
        return None
    flops = sum(r["flops"] for r in ranks)
    gflops = flops / seconds / 1e9 if flops else None  # None: an engine whose work is not counted here (vLLM)
    return {"compute_dtype": dtype, "tokens": tokens, "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds, 1), "gflops": None if gflops is None else round(gflops, 2)}


def _describe_throughput(t: dict[str, Any]) -> str:
    line = f"{t['tokens']} tokens in {t['seconds']:.0f} s, {t['tokens_per_s']:.0f} tok/s"
    if t.get("gflops") is not None:
        line += f", {t['gflops']:.1f} GFLOP/s ({t['compute_dtype']})"
    return line


def _merge_manifest(root: Path, header: dict[str, Any], split_lengths: dict[str, list[int]],
                    throughput: dict[str, Any] | None = None) -> dict[str, Any]:
    records = []
    for rank in range(header["world_size"]):
        path = progress_path(root, rank)
        if not path.is_file():
            raise UserError(f"{path}: missing after all ranks finished (a rank failed?); rerun to resume")
        records.extend(read_json_object(path)["shards"].values())
    manifest = {
        **header,
        "splits": {
            split: {
                "num_samples": len(lengths),
                "num_tokens": sum(lengths),
                "shards": sorted((r for r in records if r["split"] == split), key=lambda r: (r["rank"], r["index"])),
            }
            for split, lengths in split_lengths.items()
        },
    }
    for split, info in manifest["splits"].items():
        covered = sum(r["num_samples"] for r in info["shards"])
        if covered != info["num_samples"]:
            raise UserError(f"{root}: split {split} has {covered} of {info['num_samples']} samples in shards; rerun")
    nbytes = sum(r["nbytes"] for info in manifest["splits"].values() for r in info["shards"])
    tokens = sum(info["num_tokens"] for info in manifest["splits"].values())
    manifest["bytes_per_token"] = round(nbytes / max(tokens, 1), 2)
    if throughput:
        manifest["throughput"] = throughput  # this run's (a resumed run: only the part it computed)
    write_json_atomic(root / MANIFEST_FILENAME, manifest)
    return manifest


def _summary(manifest: dict[str, Any]) -> str:
    parts = [
        f"{split}: {info['num_samples']} samples, {info['num_tokens']} tokens, {len(info['shards'])} shards"
        for split, info in manifest["splits"].items()
    ]
    kv = f", states over {manifest['kv_dtype']} K/V" if manifest.get("kv_dtype") else ""
    return "; ".join(parts) + f"; {manifest['storage_dtype']}, {manifest.get('bytes_per_token')} bytes/token{kv}"


def _group_device(recipe) -> torch.device:
    """The device the ranks' process group reduces on: the target's (`target.device`), or the CPU with the vLLM
    backend (the ranks only coordinate, their engines own the GPUs, and this process must not take one)."""
    if recipe.precompute.backend == "vllm":
        return torch.device("cpu")
    return resolve_device(recipe.target.device)


def _init_distributed(env: DistEnv, device: torch.device, timeout_minutes: float):
    """The process group of the ranks (None for one rank), for collectives on `device` that time out after
    `timeout_minutes`."""
    if env.world_size <= 1:
        return None
    init_process_group(device, timeout_minutes)
    return dist


def _barrier(dist) -> None:
    if dist is not None:
        dist.barrier()
