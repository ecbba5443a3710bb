"""Counting the tokens a head is trained to predict, to choose its reduced draft vocabulary (`heads.vocab`).

A head row reading (H_{j-2}, t_{j-1}) predicts token j, and it counts in the losses where token j is an assistant token
(loss_mask[j] = 1, j >= 2). The label of that row can be taken two ways (`source`):

- `target`: the target's argmax of lm_head(H_{j-1}) — what the KL actually trains towards (read from the cache's
  `target_argmax` when precompute stored it, else one chunked lm_head pass over the counted positions);
- `data`: the data's token t_j — free; identical to `target` on greedily self-distilled data (`prepare --regenerate`)
  up to ties.

Counts are cached in `<features>/draft_vocab/<source>-counts.safetensors`, tied to the feature manifest's hash.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from tqdm import tqdm

from mtp_train.features.format import MANIFEST_FILENAME, load_manifest
from mtp_train.features.reader import FeatureReader
from mtp_train.fileio import atomic_write_bytes, file_sha256, safetensors_bytes
from mtp_train.heads.vocab import coverage, select_draft_vocab
from mtp_train.runtime.distributed import all_reduce_host

SOURCES = ("target", "data")
COUNTS_DIRNAME = "draft_vocab"


def counts_path(features_dir: str | Path, source: str) -> Path:
    return Path(features_dir) / COUNTS_DIRNAME / f"{source}-counts.safetensors"


def count_next_tokens(
    features_dir: str | Path,
    source: str,
    vocab_size: int,
    lm_head_weight: torch.Tensor | None = None,  # [V, d]; needed for source="target"
    chunk_rows: int = 512,
    progress: bool = True,
    rank: int = 0,
    world_size: int = 1,
) -> torch.Tensor:
    """[V] int64: how often each target id is the label of a counted row over the training split's features (with
    `world_size` > 1: over this rank's share, samples rank, rank + world_size, ...; sum the ranks' counts)."""
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
    if source == "target" and lm_head_weight is None and not load_manifest(Path(features_dir)).get("target_argmax"):
        raise ValueError("source='target' needs the target's lm_head weight (the cache stores no target_argmax)")
    dtype = lm_head_weight.dtype if lm_head_weight is not None else torch.float32
    reader = FeatureReader(features_dir, "train", micro_batch_tokens=1, dtype=dtype, verify_hashes=False)
    counts = torch.zeros(vocab_size, dtype=torch.long)
    samples = range(rank, len(reader.samples), world_size)
    for position in tqdm(samples, desc=f"draft-vocab ({source})", unit="sample", disable=not progress):
        shard_id, row, _ = reader.samples[position]
        handle = reader._open(shard_id)
        start, end = reader._offsets[shard_id][row], reader._offsets[shard_id][row + 1]
        token_ids = handle.get_slice("input_ids")[start:end].long()  # [n]
        loss_mask = handle.get_slice("loss_mask")[start:end].bool()  # [n]
        labelled = loss_mask.nonzero().squeeze(1)
        labelled = labelled[labelled >= 2]  # token j predicted by row j-2
        if labelled.numel() == 0:
            continue
        if source == "data":
            labels = token_ids[labelled]
        elif "target_argmax" in handle.keys():  # stored by precompute: label of row j-2 = argmax of lm_head(H_{j-1})
            labels = handle.get_slice("target_argmax")[start:end].long()[labelled - 1]
        else:
            hidden = reader.load([position]).hidden.to(lm_head_weight.device)  # [n, d]
            label_chunks = []
            for chunk in labelled.split(chunk_rows):
                logits = hidden[chunk - 1].to(lm_head_weight.dtype) @ lm_head_weight.T  # [c, V]
                label_chunks.append(logits.argmax(-1).cpu())
            labels = torch.cat(label_chunks)
        counts += torch.bincount(labels, minlength=vocab_size)
    return counts


def load_or_count(
    features_dir: str | Path,
    source: str,
    vocab_size: int,
    lm_head_weight: torch.Tensor | None = None,
    progress: bool = True,
    distributed: bool = False,
) -> torch.Tensor:
    """Cached `count_next_tokens`: read the counts file when it matches the current feature manifest, else count
    and write it. `distributed`: every rank of the initialized process group calls this; they split the counting,
    sum it, and rank 0 writes the file."""
    features_dir = Path(features_dir)
    path = counts_path(features_dir, source)
    digest = file_sha256(features_dir / MANIFEST_FILENAME)
    if path.is_file():
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            if metadata.get("manifest_sha256") == digest and metadata.get("source") == source:
                counts = handle.get_tensor("token_counts")
                if counts.numel() == vocab_size:
                    return counts
    rank, world_size = 0, 1
    if distributed:
        rank, world_size = dist.get_rank(), dist.get_world_size()
    counts = count_next_tokens(features_dir, source, vocab_size, lm_head_weight, progress=progress and rank == 0,
                               rank=rank, world_size=world_size)
    if world_size > 1:
        counts = all_reduce_host(counts)  # int64 sums, exact; reduced on the backend's device (NCCL: the GPU)
    if rank == 0:
        metadata = {"source": source, "manifest_sha256": digest, "labels": str(int(counts.sum()))}
        atomic_write_bytes(path, safetensors_bytes({"token_counts": counts}, metadata))
    return counts


def coverage_table(token_counts: torch.Tensor, sizes: list[int]) -> list[dict]:
    """Per draft-vocabulary size N: the share of counted labels inside the top-N."""
    rows = []
    for size in sizes:
        size = min(size, token_counts.numel())
        rows.append({"draft_vocab_size": size, "coverage": coverage(token_counts, select_draft_vocab(token_counts, size))})
    return rows
