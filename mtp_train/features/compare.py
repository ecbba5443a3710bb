"""Compare two feature caches of the same prepared data, sample by sample: e.g. one computed with a tensor-parallel
target against one computed with the whole target (`scripts/compare_features.py`). The shard layouts may differ
(another number of data-parallel groups): samples are matched by split and `sample_index`.

Token ids and loss masks must be equal; hidden states (and aux states) are compared as stored (decoded to fp32).
"Within bf16 rounding" means each stored value is the one the reference stores or a neighbour of it: the figure
`max_ulps` is the largest |a − b| in units of the storage dtype's spacing at max(|a|, |b|) (1 = the next
representable value, what two computations that differ in their last fp32 bits can round to). Values under 1/256 of
their token's RMS count in the spacing at that floor: their last bits are set by the fp32 round-off of the whole row
(~1e-7 of its scale), which is more than a bf16 step of a value that small; the element-wise relative error uses
the same floor (|a − b| / max(|b|, rms / 256)), the per-token one is ||a − b|| / ||b||.

Computed in bf16 (the `auto` dtype on CPUs with native bf16 and on GPUs), two correct runs differ by far more than
one storage step: every matmul rounds its output to bf16 and a different split rounds differently (measured in
docs/scaling.md, "Tensor parallelism"); compare each against an fp32-computed cache to see which is closer.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from mtp_train.errors import UserError
from mtp_train.features.format import decode_hidden, load_manifest

_MANTISSA_BITS = {"bfloat16": 7, "float16": 10, "float8_e4m3": 3}


@dataclass
class TensorDiff:
    """|a − b| statistics of one tensor kind over all compared rows ([tokens, d] rows)."""

    max_abs: float = 0.0
    max_rel: float = 0.0  # max over elements of |a − b| / max(|b|, rms(token's row) / 256)
    mean_rel: float = 0.0  # mean over elements of the same
    max_row_rel: float = 0.0  # max over tokens of ||a − b|| / ||b||
    mean_row_rel: float = 0.0
    max_ulps: float = 0.0  # storage-dtype steps, see the module docstring
    elements_differing: float = 0.0  # fraction of elements not bit-equal
    _sum_rel: float = field(default=0.0, repr=False)
    _sum_row_rel: float = field(default=0.0, repr=False)
    _elements: int = field(default=0, repr=False)
    _rows: int = field(default=0, repr=False)
    _differing: int = field(default=0, repr=False)

    def add(self, a: torch.Tensor, b: torch.Tensor, mantissa_bits: int) -> None:
        a, b = a.double().reshape(-1, a.shape[-1]), b.double().reshape(-1, b.shape[-1])
        if b.numel() == 0:
            return
        diff = (a - b).abs()
        rms = b.pow(2).mean(dim=-1, keepdim=True).sqrt()
        rel = diff / torch.maximum(b.abs(), rms * 2.0**-8).clamp_min(1e-30)
        row_rel = diff.norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-30)
        magnitude = torch.maximum(torch.maximum(a.abs(), b.abs()), rms * 2.0**-8).clamp_min(1e-30)
        spacing = torch.exp2(torch.floor(torch.log2(magnitude)) - mantissa_bits)
        self.max_abs = max(self.max_abs, float(diff.max()))
        self.max_rel = max(self.max_rel, float(rel.max()))
        self.max_row_rel = max(self.max_row_rel, float(row_rel.max()))
        self.max_ulps = max(self.max_ulps, float((diff / spacing).max()))
        self._sum_rel += float(rel.sum())
        self._sum_row_rel += float(row_rel.sum())
        self._elements += diff.numel()
        self._rows += diff.shape[0]
        self._differing += int((diff != 0).sum())
        self.mean_rel = self._sum_rel / max(self._elements, 1)
        self.mean_row_rel = self._sum_row_rel / max(self._rows, 1)
        self.elements_differing = self._differing / max(self._elements, 1)

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if not k.startswith("_")}


@dataclass
class CacheComparison:
    samples: int = 0
    tokens: int = 0
    hidden: TensorDiff = field(default_factory=TensorDiff)
    aux_hidden: TensorDiff | None = None
    argmax_agreement: float | None = None  # fraction of tokens whose stored target argmax is equal

    def as_dict(self) -> dict:
        out = {"samples": self.samples, "tokens": self.tokens, "hidden": self.hidden.as_dict()}
        if self.aux_hidden is not None:
            out["aux_hidden"] = self.aux_hidden.as_dict()
        if self.argmax_agreement is not None:
            out["argmax_agreement"] = self.argmax_agreement
        return out


def _split_samples(root: Path, manifest: dict, split: str) -> dict[int, dict[str, torch.Tensor]]:
    samples: dict[int, dict[str, torch.Tensor]] = {}
    for record in manifest["splits"][split]["shards"]:
        t = load_file(root / record["name"])
        hidden = decode_hidden(t["hidden"], t.get("hidden_scale"))
        aux = decode_hidden(t["aux_hidden"], t.get("aux_hidden_scale")) if "aux_hidden" in t else None
        offsets = t["offsets"].tolist()
        for s, index in enumerate(t["sample_index"].tolist()):
            a, b = offsets[s], offsets[s + 1]
            samples[index] = {"input_ids": t["input_ids"][a:b], "loss_mask": t["loss_mask"][a:b],
                              "hidden": hidden[a:b], "aux_hidden": None if aux is None else aux[a:b],
                              "target_argmax": t["target_argmax"][a:b] if "target_argmax" in t else None}
    return samples


def compare_caches(candidate: str | Path, reference: str | Path) -> CacheComparison:
    """Statistics of `candidate` against `reference` over every sample of every split; `UserError` when they are not
    caches of the same data and target (fingerprints, sample sets, token ids or loss masks differ)."""
    candidate, reference = Path(candidate), Path(reference)
    mine, theirs = load_manifest(candidate), load_manifest(reference)
    for key in ("target", "tokenizer", "dataset"):
        if mine["fingerprints"].get(key) != theirs["fingerprints"].get(key):
            raise UserError(f"{candidate}: fingerprint '{key}' differs from {reference}'s: not caches of the same "
                            "target and data")
    if mine["storage_dtype"] != theirs["storage_dtype"]:
        raise UserError(f"{candidate}: storage_dtype {mine['storage_dtype']} vs {theirs['storage_dtype']} in "
                        f"{reference}")
    bits = _MANTISSA_BITS[mine["storage_dtype"]]
    result = CacheComparison()
    agree = argmax_tokens = 0
    for split in theirs["splits"]:
        a, b = _split_samples(candidate, mine, split), _split_samples(reference, theirs, split)
        if a.keys() != b.keys():
            raise UserError(f"{candidate}: split {split} holds {len(a)} samples, {reference} {len(b)} (or others)")
        for index, ref in b.items():
            got = a[index]
            same_tokens = torch.equal(got["input_ids"], ref["input_ids"])
            if not (same_tokens and torch.equal(got["loss_mask"], ref["loss_mask"])):
                raise UserError(f"{candidate}: split {split} sample {index}: token ids or loss mask differ")
            result.samples += 1
            result.tokens += ref["input_ids"].numel()
            result.hidden.add(got["hidden"], ref["hidden"], bits)
            if ref["aux_hidden"] is not None and got["aux_hidden"] is not None:
                result.aux_hidden = result.aux_hidden or TensorDiff()
                result.aux_hidden.add(got["aux_hidden"], ref["aux_hidden"], bits)
            if ref["target_argmax"] is not None and got["target_argmax"] is not None:
                agree += int((got["target_argmax"] == ref["target_argmax"]).sum())
                argmax_tokens += ref["target_argmax"].numel()
    if argmax_tokens:
        result.argmax_agreement = agree / argmax_tokens
    return result
