"""The 2-rank side of tests/test_tensor_parallel.py, launched once by it with
`torchrun --nproc_per_node=2 -m tests.tp_worker RESULTS.json MODEL_DIR...` (gloo, one thread per rank).

For each tiny model and each decode path (the model's own torch path, and the CPU decode kernels), every rank loads
the whole model (the TP=1 reference) and its TP=2 share (`load_model_tensor_parallel`), runs the same forwards through
both (prefill without a cache, prefill into a paged cache, decode steps, a verify of 4 tokens, a 2-sequence decode
batch, a verify batch of 18 rows) and records the largest |TP=2 − TP=1| of the logits and hidden states; then greedy
speculative decoding with an MTP head over the TP=2 target against plain greedy decoding of the TP=2 and of the TP=1
target. Rank 0 writes RESULTS.json; the test asserts on it."""

from __future__ import annotations

import json
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from mtp_train.heads import DraftHead, HeadConfig
from mtp_train.runtime.attention import BatchInfo
from mtp_train.runtime.generate import generate
from mtp_train.runtime.kv_cache import PageAllocator, Sequence
from mtp_train.runtime.loader import load_model
from mtp_train.runtime.decode_runner import KernelDecoderLayer, head_runner
from mtp_train.runtime.precision import resolve_precision
from mtp_train.runtime.spec import speculative_generate
from mtp_train.runtime.tensor_parallel import ParallelLayout, init_tensor_parallel, load_model_tensor_parallel


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def _forwards(model, ids: list[int]) -> dict[str, torch.Tensor]:
    """Named outputs of the same forwards any model runs: cache-free prefill, cached prefill, decode, verify, batch."""
    out: dict[str, torch.Tensor] = {}
    n = len(ids)
    tokens = torch.tensor(ids)
    res = model(tokens, BatchInfo.without_cache([n - 7, 7]), return_hidden=True)
    out["prefill/logits"], out["prefill/hidden"] = res.logits, res.hidden
    allocator = PageAllocator(32, page_size=4)
    cache = model.new_kv_cache(allocator)
    first, second = Sequence(0), Sequence(1)
    res = model(tokens[:12], BatchInfo.for_sequences([first], [12], allocator), cache, return_hidden=True)
    out["cached_prefill/logits"], out["cached_prefill/hidden"] = res.logits, res.hidden
    for step, token in enumerate(ids[12:15]):
        res = model(torch.tensor([token]), BatchInfo.for_sequences([first], [1], allocator), cache, return_hidden=True)
        out[f"decode{step}/logits"], out[f"decode{step}/hidden"] = res.logits, res.hidden
    res = model(tokens[15:19], BatchInfo.for_sequences([first], [4], allocator, advance=False), cache,
                return_hidden=True)
    out["verify/logits"], out["verify/hidden"] = res.logits, res.hidden
    model(tokens[:9], BatchInfo.for_sequences([second], [9], allocator), cache)
    res = model(tokens[19:21], BatchInfo.for_sequences([first, second], [1, 1], allocator), cache, return_hidden=True)
    out["decode_batch/logits"], out["decode_batch/hidden"] = res.logits, res.hidden
    # A verify batch of 2 × 9 rows: above the kernels' 16-row limit, their prepacked-GEMM path (`_many_rows`).
    res = model(tokens[:18], BatchInfo.for_sequences([first, second], [9, 9], allocator, advance=False), cache,
                return_hidden=True)
    out["verify_batch/logits"], out["verify_batch/hidden"] = res.logits, res.hidden
    out["kv_cache_heads"] = torch.tensor(cache.layers[0][0].shape[2])
    return out


def _case(path: str, decode_path: str, group) -> dict:
    precision = resolve_precision("float32", "float32") if decode_path == "kernels" else None
    reference = load_model(path, dtype="float32", device="cpu", precision=precision)
    sharded = load_model_tensor_parallel(path, group, dtype="float32", device="cpu", precision=precision)
    ids = torch.randint(2, reference.config.vocab_size, (21,), generator=torch.Generator().manual_seed(3)).tolist()
    expected, got = _forwards(reference, ids), _forwards(sharded, ids)
    result = {"max_abs_diff": {k: _diff(expected[k], got[k]) for k in expected if k != "kv_cache_heads"},
              "kv_cache_heads": int(got["kv_cache_heads"]), "full_kv_heads": int(expected["kv_cache_heads"]),
              "local_heads": sharded.model.layers[0].self_attn.num_heads,
              "used_kernels": isinstance(sharded.model.layers[0], KernelDecoderLayer)}
    # Greedy speculation with an MTP head (the TP=1 target's last layer, copied) over the TP=2 target.
    torch.manual_seed(0)
    head_config = HeadConfig.for_target(reference.config, kind="mtp", init="last_layer")
    reference_head = DraftHead.from_target(reference, head_config)
    head = DraftHead.from_target(sharded, HeadConfig.for_target(sharded.config, kind="mtp", init="random"))
    head.load_state_dict(reference_head.state_dict())
    if precision is not None:
        head = head_runner(head, precision, "target")
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, reference.config.vocab_size, (n,), generator=gen).tolist() for n in (5, 11)]
    plain_tp1, _ = generate(reference, prompts, 12, page_size=4)
    plain, _ = generate(sharded, prompts, 12, page_size=4)
    spec, stats = speculative_generate(sharded, head, prompts, 12, 3, page_size=4)
    result["greedy"] = {"plain_tp2": [r.token_ids for r in plain], "plain_tp1": [r.token_ids for r in plain_tp1],
                        "speculative_tp2": [r.token_ids for r in spec], "accepted_tokens": stats.accepted_tokens}
    return result


def main() -> None:
    out_path, model_dirs = Path(sys.argv[1]), sys.argv[2:]
    layout = ParallelLayout.from_environ(tensor_parallel=2)
    # A short timeout: a rank that fails while the other waits in a collective ends the run instead of hanging.
    dist.init_process_group(backend="gloo", timeout=timedelta(seconds=60))
    group = init_tensor_parallel(layout, "cpu", timeout_minutes=1)
    results: dict = {}
    for path in model_dirs:
        for decode_path in ("torch", "kernels"):
            name = f"{Path(path).name}/{decode_path}"
            try:
                results[name] = _case(path, decode_path, group)
            except Exception:  # recorded for the test's message; the other rank fails the same way
                results[name] = {"error": traceback.format_exc()}
    gathered = [None] * layout.world_size
    dist.all_gather_object(gathered, results)
    if layout.rank == 0:
        out_path.write_text(json.dumps({"ranks": gathered}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
