#!/usr/bin/env python
"""How far each precision path of our runtime is from transformers in fp32, over a prepared split's samples: the
prompt prefill that eval runs in `precision.compute: auto` on this machine, our fp32 runtime, and a bf16 model (what a GPU
or a native-bf16 CPU's precompute computes in).

For each path and sample, one paged prefill of the whole sample (as eval prefills a prompt, reading its keys and
values as the path's K/V cache holds them) gives the logits and the last layer's post-norm states (the features an
MTP head trains on). Against transformers' fp32 logits: the largest |difference| (absolute, and relative to the
sample's largest |logit|), the mean |difference| and the share of positions whose argmax agrees; against our fp32
runtime's states: the relative error of the states (per token ||a - b|| / ||b||, mean and max). Run it as another CPU
kind with `MTP_TRAIN_CPU_AS=avx2` (the paths an AVX2-only CPU takes). The last line is `RESULT key=value ...`.

    python scripts/compare_precision.py --prepared data/prepared/smollm2-135m-mtp            # its eval split
    MTP_TRAIN_CPU_AS=avx2 python scripts/compare_precision.py --prepared data/prepared/smollm2-135m-mtp
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


@dataclass
class Errors:
    """Running figures of one path against the references."""

    max_abs: float = 0.0
    max_rel: float = 0.0  # max over samples of max |Δlogit| / max |reference logit|
    sum_abs: float = 0.0
    elements: int = 0
    argmax_equal: int = 0
    positions: int = 0
    state_rel: list[float] = field(default_factory=list)  # per token ||Δh|| / ||h_fp32||

    def add(self, logits, reference, states, reference_states) -> None:
        diff = (logits - reference).abs()
        self.max_abs = max(self.max_abs, float(diff.max()))
        self.max_rel = max(self.max_rel, float(diff.max() / reference.abs().max()))
        self.sum_abs += float(diff.double().sum())
        self.elements += diff.numel()
        self.argmax_equal += int((logits.argmax(-1) == reference.argmax(-1)).sum())
        self.positions += reference.shape[0]
        rel = (states.float() - reference_states).norm(dim=-1) / reference_states.norm(dim=-1)
        self.state_rel.extend(rel.tolist())

    def fields(self, prefix: str) -> dict[str, str]:
        return {f"{prefix}_max_abs": f"{self.max_abs:.4f}", f"{prefix}_max_rel": f"{self.max_rel:.4f}",
                f"{prefix}_mean_abs": f"{self.sum_abs / self.elements:.5f}",
                f"{prefix}_argmax_agree": f"{self.argmax_equal / self.positions:.5f}",
                f"{prefix}_state_rel_mean": f"{sum(self.state_rel) / len(self.state_rel):.5f}",
                f"{prefix}_state_rel_max": f"{max(self.state_rel):.5f}"}


def paged_prefill(model, ids: list[int]):
    """(logits [T, vocab] fp32, post-norm states [T, hidden]) of one paged prefill of `ids` into a fresh cache."""
    import torch

    from mtp_train.runtime.attention import BatchInfo
    from mtp_train.runtime.kv_cache import PageAllocator, Sequence

    page_size = 16
    allocator = PageAllocator(len(ids) // page_size + 2, page_size=page_size)
    cache, sequence = model.new_kv_cache(allocator), Sequence(0)
    batch = BatchInfo.for_sequences([sequence], [len(ids)], allocator)
    out = model(torch.tensor(ids), batch, cache, return_hidden=True)
    sequence.release(allocator)
    return out.logits.float(), out.hidden


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prepared", default=str(REPO / "data" / "prepared" / "smollm2-135m-mtp"),
                        help="a prepared dataset (`mtp-train prepare`)")
    parser.add_argument("--model", default=str(REPO / "data" / "models" / "smollm2-135m-instruct"))
    parser.add_argument("--split", default="eval", choices=("eval", "train"))
    parser.add_argument("--max-samples", type=int, default=None, help="first N samples of the split (default all)")
    parser.add_argument("--quick", action="store_true", help="4 samples")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from mtp_train.data.prepared import load_prepared
    from mtp_train.runtime.hardware import cpu_facts, machine_fields
    from mtp_train.runtime.loader import load_model
    from mtp_train.runtime.precision import resolve_precision

    split = getattr(load_prepared(args.prepared), args.split)
    limit = 4 if args.quick else args.max_samples
    samples = [list(map(int, row["input_ids"])) for row in split.select(range(min(limit or len(split), len(split))))]
    auto = resolve_precision("auto", "auto", "cpu")
    print(f"machine: {cpu_facts().describe()}; auto: {auto.describe()}")
    print(f"{len(samples)} samples of {args.prepared} ({args.split}), {sum(map(len, samples))} tokens")

    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    paths = {
        "fp32": load_model(args.model, device="cpu", precision=resolve_precision("float32", "float32", "cpu",
                                                                                  kv_cache_dtype="float32")),
        "auto": load_model(args.model, device="cpu", precision=auto),
        "bf16": load_model(args.model, device="cpu", precision=resolve_precision("bfloat16", "bfloat16", "cpu")),
    }
    errors = {name: Errors() for name in paths}
    for ids in samples:
        with torch.no_grad():
            reference = hf(torch.tensor([ids])).logits[0].float()
        results = {name: paged_prefill(model, ids) for name, model in paths.items()}
        fp32_states = results["fp32"][1].float()
        for name, (logits, states) in results.items():
            errors[name].add(logits, reference, states, fp32_states)

    print(f"{'path':6} {'max |Δ|':>9} {'max rel':>8} {'mean |Δ|':>9} {'argmax =':>9} {'state rel mean/max':>19}")
    result = {}
    for name, err in errors.items():
        figures = err.fields(name)
        result.update(figures)
        print(f"{name:6} {figures[name + '_max_abs']:>9} {figures[name + '_max_rel']:>8} "
              f"{figures[name + '_mean_abs']:>9} {figures[name + '_argmax_agree']:>9} "
              f"{figures[name + '_state_rel_mean']:>9}/{figures[name + '_state_rel_max']}")
    result.update({"samples": str(len(samples)), "tokens": str(sum(map(len, samples))),
                   "auto_dtype": auto.dtype, "auto_decode_dtype": auto.decode_dtype,
                   "auto_kv_cache_dtype": auto.kv_cache_dtype or auto.dtype})
    print("RESULT " + " ".join(f"{k}={v}" for k, v in result.items()) + " " + machine_fields(auto.dtype))
    return 0


if __name__ == "__main__":
    sys.exit(main())
