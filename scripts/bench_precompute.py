#!/usr/bin/env python
"""Precompute speed: our runtime (ragged prefill, no padding, no logits) vs transformers forward with
`output_hidden_states=True` (padded batches), both in the compute dtype `precision.compute: auto` picks here (`--dtype` to
force one), on the same batches of ShareGPT conversations; when that is not bf16, our runtime forced to bf16 beside it;
the fraction of this machine's measured matmul peak; bytes/token and reconstruction error of each feature storage
dtype. Ends with a `RESULT` line naming the machine."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=None)
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--tokens-per-batch", type=int, default=4096)
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 (both contenders)")
    parser.add_argument("--quick", action="store_true", help="16 conversations, 1 repeat")
    args = parser.parse_args()
    if args.quick:
        args.conversations, args.repeats = 16, 1
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from mtp_train.assets import dataset_dir, ensure_default_model, fetch_dataset
    from mtp_train.features.format import STORAGE_DTYPES, decode_hidden, encode_hidden
    from mtp_train.features.precompute import pack_batches
    from mtp_train.runtime.attention import BatchInfo
    from mtp_train.runtime.loader import load_model, load_tokenizer

    target = args.target or ensure_default_model()
    tokenizer = load_tokenizer(target)
    sharegpt = dataset_dir("sharegpt") / "sharegpt.jsonl"
    if not sharegpt.is_file():
        fetch_dataset("sharegpt")
    sequences = []
    with sharegpt.open() as stream:
        for line in stream:
            conv = json.loads(line)["conversations"]
            if len(conv) < 2 or conv[0]["role"] != "user":
                continue
            ids = tokenizer.apply_chat_template(conv[:2], tokenize=True, return_dict=False)
            sequences.append(list(ids)[: args.max_seq_len])
            if len(sequences) == args.conversations:
                break
    lengths = [len(s) for s in sequences]
    order = sorted(range(len(sequences)), key=lambda i: -lengths[i])
    batches = pack_batches(order, lengths, args.tokens_per_batch)
    total_tokens = sum(lengths)

    from mtp_train.runtime.hardware import machine_fields, measure_matmul_gflops
    from mtp_train.runtime.precision import resolve_precision

    precision = resolve_precision(args.dtype, "auto", "cpu", phases=("prefill",))
    print(f"compute: {precision.describe('prefill')}")
    ours = load_model(target, dtype=precision.dtype, device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=precision.torch_dtype).eval()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def run_ours(model=ours):
        out = []
        for batch in batches:
            ids = torch.tensor([t for i in batch for t in sequences[i]])
            h = model(ids, BatchInfo.without_cache([lengths[i] for i in batch]), compute_logits=False, return_hidden=True)
            out.append(h.hidden)
        return out

    def run_hf():
        out = []
        for batch in batches:
            width = max(lengths[i] for i in batch)
            ids = torch.full((len(batch), width), pad_id)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, i in enumerate(batch):
                ids[row, : lengths[i]] = torch.tensor(sequences[i])
                mask[row, : lengths[i]] = 1
            with torch.no_grad():
                h = hf(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
            out.append(torch.cat([h[row, : lengths[i]] for row, i in enumerate(batch)]))
        return out

    run_ours(), run_hf()  # warm-up
    ours_tps, hf_tps = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        ours_hidden = run_ours()
        ours_tps.append(total_tokens / (time.perf_counter() - start))
        start = time.perf_counter()
        hf_hidden = run_hf()
        hf_tps.append(total_tokens / (time.perf_counter() - start))
    max_diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(ours_hidden, hf_hidden))
    rel_diff = statistics.mean(
        ((a.float() - b.float()).norm(dim=-1) / b.float().norm(dim=-1)).mean().item() for a, b in zip(ours_hidden, hf_hidden)
    )
    ratio = statistics.median(o / h for o, h in zip(ours_tps, hf_tps))
    print(f"{len(sequences)} conversations, {total_tokens} tokens, {len(batches)} batches of <= {args.tokens_per_batch} tokens")
    print(f"ours {statistics.mean(ours_tps):.0f} tok/s, transformers {statistics.mean(hf_tps):.0f} tok/s, ratio {ratio:.2f}")
    print(f"ours vs transformers hidden states (both {precision.dtype}): max abs diff {max_diff:.4f}, "
          f"mean relative L2 {rel_diff:.2e}")
    flops = ours.prefill_flops(lengths)
    peak = measure_matmul_gflops(precision.torch_dtype)
    achieved = flops / total_tokens * statistics.mean(ours_tps) / 1e9
    print(f"ours: {achieved:.1f} GFLOP/s = {achieved / peak:.0%} of this machine's measured {precision.dtype} matmul "
          f"peak ({peak:.1f} GFLOP/s, {torch.get_num_threads()} threads)")
    bf16_fields = ""
    if precision.dtype != "bfloat16":
        forced = load_model(target, dtype="bfloat16", device="cpu")
        run_ours(forced)  # warm-up
        start = time.perf_counter()
        run_ours(forced)
        bf16_tps = total_tokens / (time.perf_counter() - start)
        speedup = statistics.mean(ours_tps) / bf16_tps
        print(f"ours forced to bf16: {bf16_tps:.0f} tok/s; {precision.dtype} is {speedup:.2f}x faster")
        bf16_fields = f"ours_bf16_tok_s={bf16_tps:.1f} {precision.dtype}_vs_bf16={speedup:.3f} "
        del forced

    # Storage error is measured on fp32 features (the bf16 run's states are already bf16-rounded).
    ours32 = load_model(target, dtype="float32", device="cpu")
    first = batches[0]
    ids = torch.tensor([t for i in first for t in sequences[i]])
    hidden = ours32(ids, BatchInfo.without_cache([lengths[i] for i in first]), compute_logits=False,
                    return_hidden=True).hidden
    storage = {}
    for name in STORAGE_DTYPES:
        stored, scale = encode_hidden(hidden, name)
        nbytes = stored.numel() * stored.element_size() + (scale.numel() * 4 if scale is not None else 0)
        err = (decode_hidden(stored, scale) - hidden).norm(dim=-1) / hidden.norm(dim=-1)
        storage[name] = (nbytes / hidden.shape[0], err.mean().item())
        print(f"storage {name:12s}: {nbytes / hidden.shape[0]:7.1f} bytes/token (hidden only), "
              f"mean relative L2 error {err.mean().item():.2e}")
    fields = " ".join(
        f"{name}_bytes_per_token={b:.0f} {name}_rel_err={e:.2e}" for name, (b, e) in storage.items()
    )
    print(f"RESULT ours_tok_s={statistics.mean(ours_tps):.1f} hf_tok_s={statistics.mean(hf_tps):.1f} "
          f"ratio={ratio:.3f} tokens={total_tokens} {bf16_fields}gflops={achieved:.1f} peak_gflops={peak:.1f} "
          f"fraction_of_peak={achieved / peak:.3f} {fields} threads={torch.get_num_threads()} "
          f"{machine_fields(precision.dtype)}")


if __name__ == "__main__":
    main()
