"""Feature reader for training: memory-mapped shards, samples split over ranks, a deterministic shuffle per epoch,
token-budget batches and a resumable position.

Each epoch permutes all samples of the split with a generator seeded by (seed, epoch), packs them in that order
into micro-batches of at most `micro_batch_tokens` tokens, and deals the batches round-robin to the ranks (each rank
gets the same number, so data-parallel steps stay in lockstep). The position is (epoch, batch index): saving it in a
checkpoint and restoring it resumes the exact batch sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from mtp_train.errors import UserError
from mtp_train.features.format import decode_hidden, load_manifest, pack_batches
from mtp_train.fileio import file_sha256


@dataclass
class FeatureBatch:
    input_ids: torch.Tensor  # [T] int64, the samples concatenated
    loss_mask: torch.Tensor  # [T] uint8: 1 = assistant token
    hidden: torch.Tensor  # [T, d]: H_t of the target (post final norm)
    lengths: list[int]  # tokens per sample
    sample_index: list[int]
    aux_hidden: torch.Tensor | None = None  # [T, n_aux, d]
    target_argmax: torch.Tensor | None = None  # [T] int64: argmax of lm_head(H_t), when the cache stores it

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


class FeatureReader:
    def __init__(
        self,
        root: str | Path,
        split: str = "train",
        *,
        micro_batch_tokens: int = 4096,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        expected_fingerprints: dict[str, str] | None = None,
        verify_hashes: bool = True,
    ):
        self.root = Path(root)
        self.manifest = load_manifest(self.root)
        if split not in self.manifest["splits"]:
            raise UserError(f"{self.root}: no split {split!r} (has {', '.join(self.manifest['splits'])})")
        for key, value in (expected_fingerprints or {}).items():
            have = self.manifest["fingerprints"].get(key)
            if value is not None and have != value:
                raise UserError(
                    f"{self.root / 'manifest.json'}: fingerprint '{key}' is {have}, expected {value} "
                    "(features were computed for another target/data; re-run precompute for this recipe)"
                )
        self.split, self.rank, self.world_size = split, rank, world_size
        self.micro_batch_tokens, self.seed, self.dtype = micro_batch_tokens, seed, dtype
        self.verify_hashes = verify_hashes
        self.records = self.manifest["splits"][split]["shards"]
        self._handles: dict[int, object] = {}
        self._offsets: list[list[int]] = []
        self.samples: list[tuple[int, int, int]] = []  # (shard, row in shard, length), ordered by sample_index
        unordered = []
        for shard_id, record in enumerate(self.records):
            handle = self._open(shard_id)
            offsets = handle.get_tensor("offsets").tolist()
            sample_index = handle.get_tensor("sample_index").tolist()
            self._offsets.append(offsets)
            for row, index in enumerate(sample_index):
                unordered.append((index, shard_id, row, offsets[row + 1] - offsets[row]))
        unordered.sort()
        self.samples = [(shard, row, length) for _, shard, row, length in unordered]
        if not self.samples:
            raise UserError(f"{self.root}: split {split!r} has no samples")
        self.epoch, self.batch_in_epoch = 0, 0
        self.epoch_batches(0)  # fail now, not mid-run, if the cache is too small for the ranks

    def _open(self, shard_id: int):
        if shard_id in self._handles:
            return self._handles[shard_id]
        from safetensors import safe_open

        record = self.records[shard_id]
        path = self.root / record["name"]
        if not path.is_file():
            raise UserError(f"{path}: shard missing (run verify-features / precompute to repair)")
        if path.stat().st_size != record["nbytes"]:
            raise UserError(f"{path}: {path.stat().st_size} bytes, manifest says {record['nbytes']} (truncated?)")
        if self.verify_hashes and file_sha256(path) != record["sha256"]:
            raise UserError(f"{path}: sha256 differs from the manifest (corrupted); refusing to train on it")
        try:
            handle = safe_open(str(path), framework="pt")
        except Exception as err:
            raise UserError(f"{path}: unreadable shard ({err})") from None
        self._handles[shard_id] = handle
        return handle

    @property
    def num_tokens(self) -> int:
        return sum(length for _, _, length in self.samples)

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """This rank's batches (lists of sample positions) for `epoch`."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        order = torch.randperm(len(self.samples), generator=generator).tolist()
        batches = pack_batches(order, [length for _, _, length in self.samples], self.micro_batch_tokens)
        per_rank = len(batches) // self.world_size
        if per_rank == 0:
            raise UserError(
                f"{self.root}: split {self.split!r} gives {len(batches)} micro-batch(es) of <= {self.micro_batch_tokens} "
                f"tokens, fewer than the {self.world_size} ranks; add data or lower train.micro_batch_tokens"
            )
        return batches[self.rank : per_rank * self.world_size : self.world_size]

    def batches_per_epoch(self) -> int:
        return len(self.epoch_batches(0))

    def load(self, positions: list[int]) -> FeatureBatch:
        ids, masks, hiddens, auxes, argmaxes, lengths = [], [], [], [], [], []
        for i in positions:
            shard_id, row, length = self.samples[i]
            handle = self._open(shard_id)
            start, end = self._offsets[shard_id][row], self._offsets[shard_id][row + 1]
            ids.append(handle.get_slice("input_ids")[start:end])
            masks.append(handle.get_slice("loss_mask")[start:end])
            scale = handle.get_slice("hidden_scale")[start:end] if "hidden_scale" in handle.keys() else None
            hiddens.append(decode_hidden(handle.get_slice("hidden")[start:end], scale, self.dtype))
            if "target_argmax" in handle.keys():
                argmaxes.append(handle.get_slice("target_argmax")[start:end])
            if "aux_hidden" in handle.keys():
                aux_scale = handle.get_slice("aux_hidden_scale")[start:end] if "aux_hidden_scale" in handle.keys() else None
                auxes.append(decode_hidden(handle.get_slice("aux_hidden")[start:end], aux_scale, self.dtype))
            lengths.append(length)
        return FeatureBatch(
            input_ids=torch.cat(ids).long(),
            loss_mask=torch.cat(masks),
            hidden=torch.cat(hiddens),
            lengths=lengths,
            sample_index=list(positions),
            aux_hidden=torch.cat(auxes) if auxes else None,
            target_argmax=torch.cat(argmaxes).long() if len(argmaxes) == len(positions) else None,
        )

    def __iter__(self):
        """Endless iteration from the current position (advances `epoch`/`batch_in_epoch`)."""
        while True:
            batches = self.epoch_batches(self.epoch)
            while self.batch_in_epoch < len(batches):
                positions = batches[self.batch_in_epoch]
                self.batch_in_epoch += 1
                yield self.load(positions)
            self.epoch += 1
            self.batch_in_epoch = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch, "seed": self.seed,
                "world_size": self.world_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("world_size", self.world_size) != self.world_size or state.get("seed", self.seed) != self.seed:
            raise UserError("data position was saved with another world size or seed; cannot resume it exactly")
        self.epoch, self.batch_in_epoch = int(state["epoch"]), int(state["batch_in_epoch"])
