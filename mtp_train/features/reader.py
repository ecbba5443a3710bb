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
import torch.distributed as dist
from safetensors import safe_open

from mtp_train.errors import UserError
from mtp_train.features.checks import is_shard_name, shard_header, shard_problems, split_problems
from mtp_train.features.format import MANIFEST_FILENAME, decode_hidden, load_manifest, pack_batches
from mtp_train.fileio import file_sha256
from mtp_train.data.prepared import tokenizer_fingerprint, tokenizer_mismatch


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


def shard_file_problem(root: Path, record: dict) -> str | None:
    """What is wrong with one shard's file against its manifest record (missing, another size, another sha256), or
    None."""
    path = root / record["name"]
    try:
        if not path.is_file():
            return f"{path}: shard missing"
        if path.stat().st_size != record["nbytes"]:
            return f"{path}: {path.stat().st_size} bytes, manifest says {record['nbytes']} (truncated?)"
        if file_sha256(path) != record["sha256"]:
            return f"{path}: sha256 differs from the manifest (corrupted)"
    except OSError as err:
        return f"{path}: unreadable ({err.strerror or err})"
    return None


def verify_split_hashes(root: Path, split: str, records: list[dict], rank: int = 0, world_size: int = 1) -> None:
    """Check the sha256 of every shard of `split` once among `world_size` processes: shard i is hashed by process
    i % world_size, and the verdicts are gathered (`all_gather_object` on the default process group) so every
    process refuses together, with the same message, or none does. Every training rank reads the same cache, so
    each rank hashing the whole split would read it world_size times over before training starts (hundreds of GB
    per rank for an 8B target's cache of 100M tokens); spread, the split is read once, 1/world_size of it per rank.
    Hashing at start-up, rather than trusting the hashes recorded at write, catches a shard damaged since (a copy, a
    bad disk); with a node-local copy of the cache per node, each shard is hashed on one node's copy only
    (`mtp-train verify-features` checks a whole copy). Every rank still checks every shard's size and header when it
    opens it. Raises UserError naming the files that differ and what to run."""
    mine = []  # (shard position, problem) for this process's shards
    for position in range(rank, len(records), world_size):
        if is_shard_name(split, records[position]["name"]):  # other names: named by split_problems, never read
            if problem := shard_file_problem(root, records[position]):
                mine.append((position, problem))
    if world_size > 1:
        gathered: list = [None] * world_size
        dist.all_gather_object(gathered, mine)
        mine = [found for rank_found in gathered for found in rank_found]
    problems = [problem for _, problem in sorted(mine)]
    if problems:
        shown = "\n  ".join(problems[:5]) + (f"\n  ... and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise UserError(f"{root}: {len(problems)} shard file(s) of split {split!r} differ from the manifest; refusing "
                        f"to train on them:\n  {shown}\nRun `mtp-train verify-features {root}` for the full report, "
                        "and rebuild the cache with `mtp-train precompute --force`.")


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
        target_dir: str | Path | None = None,
        chat_template: str | Path | None = None,
        aux_layers: tuple[int, ...] | None = None,
        hash_share: tuple[int, int] = (0, 1),
    ):
        """`expected_fingerprints`: manifest fingerprints the cache must have (e.g. {"target": ...}). `target_dir`
        (optional): the target this run uses; its tokenizer (with `chat_template`, the recipe's
        `data.chat_template`) must be the one that tokenized the data. Start-up checks the manifest against the
        split's shards (the checks verify-features runs, features/checks.py) and, with `verify_hashes`, every shard's
        sha256 once among the processes of `hash_share` (`verify_split_hashes`).
        `aux_layers` (an eagle3 head's inputs): batches carry exactly these stored layers, in this order, as
        `aux_hidden`; a cache that does not store them all is refused, naming `precompute.aux_layers`. None: every
        stored aux layer, as stored.
        `hash_share`: (this process's rank, the number of processes sharing the hashing). With more than one, the
        default process group must be up and every one of them must build this reader (hashing ends in a
        collective); the training ranks pass their rank and world size for the eval reader too, whose data they do
        not split."""
        self.root = Path(root)
        self.manifest = load_manifest(self.root)  # names missing keys
        manifest_path = self.root / MANIFEST_FILENAME
        if split not in self.manifest["splits"]:
            raise UserError(f"{self.root}: no split {split!r} (has {', '.join(self.manifest['splits'])})")
        data_tokenizer = self.manifest["fingerprints"]["tokenizer"]
        if data_tokenizer is None:
            raise UserError(f"{manifest_path}: fingerprints.tokenizer is null: a cache written by an older mtp-train "
                            "(before caches recorded the tokenizer); run `mtp-train precompute` again")
        for key, value in (expected_fingerprints or {}).items():
            have = self.manifest["fingerprints"].get(key)
            if value is None or have == value:
                continue
            if key == "tokenizer":
                raise UserError(tokenizer_mismatch(manifest_path, have, self.manifest.get("tokenizer_source"),
                                                   target_dir or "of this run", value))
            raise UserError(
                f"{manifest_path}: fingerprint '{key}' is {have}, expected {value} "
                "(features were computed for another target/data; re-run precompute for this recipe)"
            )
        if target_dir is not None and "tokenizer" not in (expected_fingerprints or {}):
            target_tokenizer = tokenizer_fingerprint(target_dir, chat_template)
            if target_tokenizer != data_tokenizer:
                raise UserError(tokenizer_mismatch(manifest_path, data_tokenizer,
                                                   self.manifest.get("tokenizer_source"), target_dir, target_tokenizer))
        self.aux_index = self._aux_index(aux_layers)
        self.split, self.rank, self.world_size = split, rank, world_size
        self.micro_batch_tokens, self.seed, self.dtype = micro_batch_tokens, seed, dtype
        self.records = self.manifest["splits"][split]["shards"]
        self._handles: dict[int, object] = {}
        self._offsets: list[list[int]] = []
        self.samples: list[tuple[int, int, int]] = []  # (shard, row in shard, length), ordered by sample_index
        if verify_hashes:
            verify_split_hashes(self.root, split, self.records, *hash_share)
        problems = split_problems(self.root, self.manifest, split)
        unordered = []
        for shard_id, record in enumerate(self.records):
            if not is_shard_name(split, record["name"]):
                continue  # named by split_problems; never opened
            handle = self._open(shard_id)
            if header_problems := shard_problems(record, shard_header(handle), self.manifest):
                problems.extend(header_problems)
                continue
            offsets = handle.get_tensor("offsets").tolist()
            sample_index = handle.get_tensor("sample_index").tolist()
            self._offsets.append(offsets)
            for row, index in enumerate(sample_index):
                unordered.append((index, shard_id, row, offsets[row + 1] - offsets[row]))
        unordered.sort()
        indices = [index for index, *_ in unordered]
        num_samples = self.manifest["splits"][split]["num_samples"]
        if not problems and indices != list(range(num_samples)):
            repeated = sorted({i for i, j in zip(indices, indices[1:]) if i == j})
            absent = sorted(set(range(num_samples)) - set(indices))
            problems.append(f"{split}: the shards do not hold samples 0..{num_samples - 1} once each (repeated: "
                            f"{repeated[:10]}, absent: {absent[:10]})")
        if problems:
            shown = "\n  ".join(problems[:5]) + (f"\n  ... and {len(problems) - 5} more" if len(problems) > 5 else "")
            raise UserError(
                f"{manifest_path}: the manifest does not match the shards of split {split!r}; refusing to train on "
                f"it:\n  {shown}\nRun `mtp-train verify-features {self.root}` for the full report, and rebuild the "
                "cache with `mtp-train precompute --force`."
            )
        self.samples = [(shard, row, length) for _, shard, row, length in unordered]
        if not self.samples:
            raise UserError(f"{self.root}: split {split!r} has no samples")
        self.epoch, self.batch_in_epoch = 0, 0
        self.epoch_batches(0)  # fail now, not mid-run, if the cache is too small for the ranks

    def _aux_index(self, aux_layers: tuple[int, ...] | None) -> list[int] | None:
        """Positions of `aux_layers` among the cache's stored aux layers (None: all of them, as stored)."""
        if aux_layers is None:
            return None
        stored = [int(j) for j in self.manifest["aux_layers"]]
        missing = [j for j in aux_layers if j not in stored]
        if missing:
            raise UserError(
                f"{self.root / MANIFEST_FILENAME}: the feature cache stores the outputs of target layers {stored} "
                f"(precompute.aux_layers when it was built), but the head reads layers {list(aux_layers)} "
                f"({missing} not stored); set precompute.aux_layers: {list(aux_layers)} and rebuild the cache with "
                "`mtp-train precompute --force`"
            )
        return [stored.index(j) for j in aux_layers]

    def _open(self, shard_id: int):
        if shard_id in self._handles:
            return self._handles[shard_id]

        record = self.records[shard_id]
        path = self.root / record["name"]
        if not path.is_file():
            raise UserError(f"{path}: shard missing (run verify-features / precompute to repair)")
        if path.stat().st_size != record["nbytes"]:
            raise UserError(f"{path}: {path.stat().st_size} bytes, manifest says {record['nbytes']} (truncated?)")
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
            if "aux_hidden" in handle.keys() and self.aux_index != []:
                aux_scale = handle.get_slice("aux_hidden_scale")[start:end] if "aux_hidden_scale" in handle.keys() else None
                aux = decode_hidden(handle.get_slice("aux_hidden")[start:end], aux_scale, self.dtype)  # [n, n_aux, d]
                auxes.append(aux if self.aux_index is None else aux[:, self.aux_index])
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
        missing = [key for key in ("epoch", "batch_in_epoch", "seed", "world_size") if key not in state]
        if missing:
            raise UserError(f"data position without {', '.join(missing)}: saved by an older mtp-train; start over "
                            "with --resume never or another train.run_dir")
        if state["world_size"] != self.world_size or state["seed"] != self.seed:
            raise UserError("data position was saved with another world size or seed; cannot resume it exactly")
        self.epoch, self.batch_in_epoch = int(state["epoch"]), int(state["batch_in_epoch"])
