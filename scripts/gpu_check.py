#!/usr/bin/env python
"""The pipeline on one GPU in under ten minutes, with no network: the check to run on a lent H100/H200 (or any
CUDA machine) before trusting a multi-GPU run. `--cpu` runs the same sections on the CPU with the CUDA-only parts
skipped (the test suite runs it, so this script cannot rot).

Sections (each ends ok, failed or skipped with the reason; a failure does not stop the others):

- env: Python, torch, CUDA and NCCL versions, the GPU, and the optional packages (deepspeed, flashinfer,
  transformers), as `mtp-train env` reports them.
- parity: our runtime's logits against transformers' on tiny random models built on the spot (Llama with GQA, Qwen3
  with its q/k norms, Mistral with a sliding window), a ragged batch through the paged cache, in fp32 (max |Δ| over
  the logits' std) and bf16 (our relative L2 error against transformers' fp32 logits, next to transformers' own bf16
  error; argmax agreement); SmolLM2 too when its directory exists (`--smollm2`; default: the one `fetch-assets` made).
- precompute: a tiny pipeline (a random Llama with a ChatML tokenizer trained on the spot, synthetic ShareGPT chats)
  prepared and precomputed on the device, then checked as `mtp-train verify-features` checks a cache.
- train: 20 ZeRO-2 steps (bf16 on a GPU) in two `mtp-train train` processes: 10 steps, then a resume to 20; the
  second must start at step 10.
- eval: the trained head drafts for the target, and the target for itself (every draft accepted): greedy
  speculative output identical to plain decoding at batch 1 and 4, τ (tokens per target forward), and the host
  synchronizations per target forward (CUDA: `torch.cuda.set_sync_debug_mode`; CPU: the calls that would
  synchronize there, `runtime/host_sync.py`).
- attention: the torch backend against a dense fp32 computation of the same paged batches (every device), and its
  timings (on CPU at smaller sizes).
- flashinfer: the FlashInfer attention backend against the torch one (logits of decode, verify, tree and ragged
  prefill batches, greedy tokens of a whole model), and one attention layer's decode and prefill time at batch 1 and
  8 for both. Skipped without CUDA or without `flashinfer-python` (the `gpu` extra).

Prints one line per section and a final `RESULT key=value ...` line; `--out DIR` also writes `gpu_check.json` there.
Exit status 0 when no section failed.

On a machine with no network, carry what its image lacks as wheels: scripts/gpu_wheelhouse.sh builds them and prints
the command to run there (docs/scaling.md, "Checking a GPU machine"). The script needs no install of mtp_train: it
puts its own checkout first on the path.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

# The repository first: the script runs from a checkout where mtp_train need not be pip-installed (the GPU machine
# gets the working tree and a wheelhouse, scripts/gpu_wheelhouse.sh), and it imports the test suite's tiny-pipeline
# builders (tests/pipeline_fixtures.py). Every mtp_train import comes after this line.
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from mtp_train.assets import DEFAULT_MODEL, MODEL_MARKER
from mtp_train.assets import model_dir as asset_dir
from mtp_train.assets.build import is_present

TRAIN_STEPS = 20
EVAL_BATCH_SIZES = (1, 4)
TIMING_BATCH_SIZES = (1, 8)


class Skipped(Exception):
    """A section that cannot run here (no CUDA, a package missing): reported with its reason, not a failure."""


@dataclass
class Section:
    name: str
    status: str = "ok"  # ok | failed | skipped
    reason: str = ""
    figures: dict = field(default_factory=dict)
    seconds: float = 0.0


@dataclass
class Context:
    device: torch.device
    work: Path
    smollm2: Path | None
    tiny_recipe: object = None  # the tiny pipeline's recipe (precompute → train → eval)
    tiny_overrides: list = field(default_factory=list)

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def compute_dtype(self) -> str:
        """Training and precompute run in bf16 on a GPU (as users run them), fp32 on CPU (the CPU suite's default)."""
        return "bfloat16" if self.on_cuda else "float32"


def _version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


# ---------------------------------------------------------------------------------------------------------------
# sections
# ---------------------------------------------------------------------------------------------------------------


def check_env(ctx: Context) -> dict:
    figures = {"python": platform.python_version(), "torch": torch.__version__, "device": str(ctx.device),
               "deepspeed": _version("deepspeed"), "flashinfer": _version("flashinfer-python"),
               "transformers": _version("transformers"), "cpu_threads": torch.get_num_threads()}
    if ctx.on_cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        figures.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                       capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda,
                       nccl=".".join(map(str, torch.cuda.nccl.version())), bf16=torch.cuda.is_bf16_supported())
    for name, value in figures.items():
        print(f"  {name}: {value}")
    return figures


def _hf_logits(model_dir: Path, sequences: list[list[int]], dtype: torch.dtype, device: torch.device) -> list:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager").to(device).eval()
    with torch.no_grad():
        return [model(torch.tensor([ids], device=device)).logits[0].float() for ids in sequences]


def _runtime_logits(model, sequences: list[list[int]]) -> list:
    """Our logits of every position of each sequence: one ragged prefill of the first halves into the paged cache,
    then one verify batch of the second halves (both paths of a serving step)."""
    from mtp_train.runtime.attention import BatchInfo
    from mtp_train.runtime.kv_cache import PageAllocator, Sequence

    allocator = PageAllocator(64, page_size=4)
    cache = model.new_kv_cache(allocator)
    views = [Sequence(i) for i in range(len(sequences))]
    halves = [len(ids) // 2 for ids in sequences]
    device = model.device
    first = BatchInfo.for_sequences(views, halves, allocator, device)
    out_first = model(torch.tensor([t for ids, h in zip(sequences, halves) for t in ids[:h]], device=device), first,
                      cache)
    rest = [len(ids) - h for ids, h in zip(sequences, halves)]
    second = BatchInfo.for_sequences(views, rest, allocator, device)
    out_second = model(torch.tensor([t for ids, h in zip(sequences, halves) for t in ids[h:]], device=device), second,
                       cache)
    return [torch.cat([a, b]).float() for a, b in zip(out_first.logits.split(halves), out_second.logits.split(rest))]


def _relative_l2(logits: list, reference: list) -> float:
    """The largest ‖logits − reference‖ / ‖reference‖ over the sequences."""
    return max(float((a - b).norm() / b.norm()) for a, b in zip(logits, reference))


def check_parity(ctx: Context) -> dict:
    from mtp_train.runtime.loader import load_model
    from tests.tiny_models import save_tiny_model

    models = {
        "llama": dict(model_type="llama"),
        "qwen3": dict(model_type="qwen3", head_dim=32),
        "mistral-window": dict(model_type="mistral", sliding_window=7),
    }
    dirs = {name: save_tiny_model(ctx.work / "parity" / name, seed=i, hidden_size=128, num_attention_heads=4,
                                  **spec) for i, (name, spec) in enumerate(models.items())}
    if ctx.smollm2 is not None:
        dirs["smollm2"] = ctx.smollm2
    gen = torch.Generator().manual_seed(0)
    figures, problems = {}, []
    for name, model_dir in dirs.items():
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        sequences = [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in (23, 9, 16)]
        reference = _hf_logits(model_dir, sequences, torch.float32, ctx.device)
        scale = float(torch.cat(reference).std())
        ours32 = _runtime_logits(load_model(model_dir, dtype="float32", device=ctx.device), sequences)
        fp32_err = max(float((a - b).abs().max()) for a, b in zip(ours32, reference)) / scale
        figures[f"{name}_fp32_max_rel"] = f"{fp32_err:.2e}"
        if fp32_err > 1e-3:
            problems.append(f"{name}: fp32 logits differ from transformers' by {fp32_err:.2e} of their std")
        hf16 = _hf_logits(model_dir, sequences, torch.bfloat16, ctx.device)
        ours16 = _runtime_logits(load_model(model_dir, dtype="bfloat16", device=ctx.device), sequences)
        ours_err, hf_err = _relative_l2(ours16, reference), _relative_l2(hf16, reference)
        agree = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(ours16, reference)) / sum(
            len(s) for s in sequences)
        figures[f"{name}_bf16_rel_l2"] = f"{ours_err:.4f}"
        figures[f"{name}_bf16_hf_rel_l2"] = f"{hf_err:.4f}"
        figures[f"{name}_bf16_argmax"] = f"{agree:.3f}"
        # bf16 rounds differently in every implementation: ours must be about as close to the fp32 truth as
        # transformers' own bf16 is.
        if ours_err > 2 * hf_err + 0.01 or agree < 0.9:
            problems.append(f"{name}: bf16 relative L2 error {ours_err:.4f} (transformers' bf16: {hf_err:.4f}), "
                            f"argmax agreement {agree:.3f}")
        print(f"  {name}: fp32 max |Δ| {fp32_err:.2e} of the logits' std; bf16 relative L2 {ours_err:.4f} "
              f"(transformers' bf16 {hf_err:.4f}), argmax agreement {agree:.3f}")
    if problems:
        raise AssertionError("; ".join(problems))
    return figures


def check_precompute(ctx: Context) -> dict:
    from mtp_train.features.precompute import run_precompute
    from mtp_train.features.verify import verify_features
    from tests.pipeline_fixtures import tiny_pipeline

    root = ctx.work / "pipeline"
    extra = {"target.device": ctx.device.type, "precision.compute": ctx.compute_dtype,
             "train.zero_stage": 2, "train.max_steps": TRAIN_STEPS // 2, "train.save_every": TRAIN_STEPS // 2,
             "train.eval_every": TRAIN_STEPS, "train.micro_batch_tokens": 256}
    ctx.tiny_recipe, ctx.tiny_overrides = tiny_pipeline(root, num_conversations=48, **extra)
    start = time.perf_counter()
    run_precompute(ctx.tiny_recipe)
    seconds = time.perf_counter() - start
    manifest = json.loads((ctx.tiny_recipe.features_dir / "manifest.json").read_text())
    report = verify_features(ctx.tiny_recipe.features_dir, ctx.tiny_recipe.target.path, progress=False)
    if not report.ok:
        raise AssertionError("verify-features: " + "; ".join(report.problems[:3]))
    tokens = sum(split["num_tokens"] for split in manifest["splits"].values())
    print(f"  {tokens} tokens in {seconds:.1f} s, {manifest['storage_dtype']}")
    return {"tokens": tokens, "seconds": round(seconds, 1), "storage_dtype": manifest["storage_dtype"]}


def _train_process(ctx: Context, max_steps: int) -> dict:
    """`mtp-train train` in its own process (its own process group, as torchrun would start it); its summary."""
    from tests.pipeline_fixtures import free_port

    command = [sys.executable, "-m", "mtp_train", "train", "--recipe", str(REPO / "recipes" / "smollm2-135m-mtp.yaml")]
    for override in [*ctx.tiny_overrides, f"train.max_steps={max_steps}"]:
        command += ["--set", override]
    # A port of its own: one inherited from this process (a process group it or its parent started) is taken.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "WANDB_MODE": "disabled", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):  # a single process, whatever launched this one
        env.pop(name, None)
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=420)
    if done.returncode != 0:
        raise AssertionError(f"`mtp-train train` (max_steps {max_steps}) exited {done.returncode}:\n"
                             + "\n".join((done.stdout + done.stderr).splitlines()[-25:]))
    return json.loads((ctx.tiny_recipe.run_dir / "summary.json").read_text())


def check_train(ctx: Context) -> dict:
    if ctx.tiny_recipe is None:
        raise Skipped("needs the precompute section's cache")
    if _version("deepspeed") == "not installed":
        raise Skipped("deepspeed is not installed")
    first = _train_process(ctx, TRAIN_STEPS // 2)
    second = _train_process(ctx, TRAIN_STEPS)
    if second["resumed_at_step"] != TRAIN_STEPS // 2 or second["steps"] != TRAIN_STEPS:
        raise AssertionError(f"the second session resumed at step {second['resumed_at_step']} and ended at "
                             f"{second['steps']}; expected {TRAIN_STEPS // 2} and {TRAIN_STEPS}")
    print(f"  {first['steps']} steps, then resumed at {second['resumed_at_step']} to {second['steps']}; "
          f"{second['tokens_per_s']} tokens/s, {second['compute_dtype']}, held-out step-1 top-1 "
          f"{second.get('val/step1/top1', float('nan')):.3f}")
    return {"steps": second["steps"], "resumed_at_step": second["resumed_at_step"],
            "tokens_per_s": second["tokens_per_s"], "compute_dtype": second["compute_dtype"]}


def _count_syncs(fn):
    """(fn's result, host synchronizations it made): CUDA's sync debug mode warns once per synchronizing call."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return result, sum("synchroniz" in str(w.message) for w in caught)


def _count_host_reads(fn):
    """(fn's result, the calls of our code that would synchronize on CUDA): the CPU's stand-in for `_count_syncs`
    (`runtime/host_sync.py`; it also counts the rotary table's CPU-only size read, one per forward)."""
    from mtp_train.runtime.host_sync import count_host_syncs

    with count_host_syncs() as syncs:
        result = fn()
    return result, syncs.count


def check_eval(ctx: Context) -> dict:
    from mtp_train.export.load import load_draft
    from mtp_train.runtime.chat import encode_chat
    from mtp_train.runtime.generate import generate
    from mtp_train.runtime.loader import load_model, load_tokenizer
    from mtp_train.runtime.precision import resolve_precision
    from mtp_train.runtime.spec import speculative_generate

    recipe = ctx.tiny_recipe
    head_dir = None if recipe is None else recipe.run_dir / "head"
    if head_dir is None or not head_dir.is_dir():
        raise Skipped("needs the train section's head")
    precision = resolve_precision(ctx.compute_dtype, ctx.compute_dtype, ctx.device)
    target = load_model(recipe.target.path, device=ctx.device, precision=precision)
    tokenizer = load_tokenizer(recipe.target.path)
    draft = load_draft(target, tokenizer, precision, head=str(head_dir))
    questions = ["hello world", "the model drafts tokens", "python code data", "train loss step rank shard"]
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": q}]) for q in questions]
    figures, problems = {}, []
    for batch_size in EVAL_BATCH_SIZES:
        batch = prompts[:batch_size]
        plain, _ = generate(target, batch, 32)

        def run():
            return speculative_generate(target, draft, batch, 32, num_speculative_tokens=3)

        (spec, stats), syncs = _count_syncs(run) if ctx.on_cuda else _count_host_reads(run)
        identical = all(a.token_ids == b.token_ids for a, b in zip(spec, plain))
        ties, faults = _divergences(target, batch, plain, spec)
        tau = stats.new_tokens / max(stats.target_sequence_forwards, 1)  # per sequence, prefill included
        figures[f"b{batch_size}_identical"] = int(identical)
        figures[f"b{batch_size}_near_ties"] = len(ties)
        figures[f"b{batch_size}_new_tokens"] = stats.new_tokens
        figures[f"b{batch_size}_tau"] = round(tau, 3)
        figures[f"b{batch_size}_acceptance"] = round(stats.accepted_tokens / max(stats.drafted_tokens, 1), 3)
        figures[f"b{batch_size}_syncs_per_forward"] = round(syncs / max(stats.target_forwards, 1), 2)
        print(f"  batch {batch_size}: identical to plain {identical}, τ {tau:.2f}, "
              f"{syncs / max(stats.target_forwards, 1):.1f} host syncs per target forward"
              + ("" if ctx.on_cuda else " (counted: the calls that would synchronize on CUDA)"))
        for tie in ties:  # a verify's rounding tipped a near-tie (the tiny random model's margins are small)
            print(f"  batch {batch_size}: {tie}")
        if faults:
            problems.append(f"batch {batch_size}: greedy speculative output differs from plain decoding: "
                            + "; ".join(faults))
        # The target drafting for itself (target–draft schedule) accepts every draft: the accept, commit and cache
        # compaction paths at full length, which a barely trained tiny head never reaches (a draft step and a verify
        # round apart: a near-tie may reject one draft).
        self_spec, self_stats = speculative_generate(target, target, batch, 32, num_speculative_tokens=3)
        self_identical = all(a.token_ids == b.token_ids for a, b in zip(self_spec, plain))
        self_ties, self_faults = _divergences(target, batch, plain, self_spec)
        self_acceptance = self_stats.accepted_tokens / max(self_stats.drafted_tokens, 1)
        figures[f"b{batch_size}_self_draft_identical"] = int(self_identical)
        figures[f"b{batch_size}_self_draft_near_ties"] = len(self_ties)
        figures[f"b{batch_size}_self_draft_acceptance"] = round(self_acceptance, 3)
        if self_faults or self_acceptance < (0.9 if self_ties else 0.99):
            problems.append(f"batch {batch_size}: the target drafting for itself: "
                            + ("; ".join(self_faults) or f"acceptance {self_acceptance:.3f} (expected 1.0)"))
    if problems:
        raise AssertionError("; ".join(problems))
    return figures


def _divergences(target, prompts, plain, other) -> tuple[list[str], list[str]]:
    """(near-ties, faults): each sequence of `other` that parts from its `plain` greedy decoding, described, as a
    near-tie (margin within twice the verify's measured rounding: `evaluate/margins.py`) or a fault."""
    from mtp_train.evaluate.margins import explain_divergence

    ties, faults = [], []
    for index, (ids, a, b) in enumerate(zip(prompts, plain, other)):
        divergence = explain_divergence(target, ids, a.token_ids, b.token_ids)
        if divergence is not None:
            (ties if divergence.is_tie else faults).append(f"sequence {index} {divergence.describe()}")
    return ties, faults


ATTENTION_SHAPE = dict(heads=32, kv_heads=8, head_dim=128)  # Llama-3-8B's attention


def _attention_batches(device: torch.device, dtype: torch.dtype, kv_heads: int, head_dim: int):
    """Paged batches of every kind the runtime runs, over one layer's random cache: (name, BatchInfo, new tokens)
    and the cache (K, V). Ragged prefixes (37, 300 and 5 cached tokens) and, for the prefill, ragged prompts."""
    from mtp_train.runtime.attention import BatchInfo, ancestor_mask
    from mtp_train.runtime.kv_cache import PageAllocator, Sequence

    allocator = PageAllocator(512, page_size=16)
    shape = (allocator.num_pages, allocator.page_size, kv_heads, head_dim)
    cache = (torch.randn(shape, device=device, dtype=dtype), torch.randn(shape, device=device, dtype=dtype))
    batches = []
    for name, prefix, new in (("decode", [37, 300, 5], [1, 1, 1]), ("verify", [37, 300, 5], [4, 4, 4]),
                              ("prefill", [0, 0, 0], [61, 17, 130]), ("tree", [37, 300, 5], [5, 5, 5])):
        views = [Sequence(i) for i in range(len(prefix))]
        for view, cached in zip(views, prefix):
            view.reserve(cached, allocator)
            view.num_cached = cached
        if name == "tree":  # a root, two children, a grandchild under each
            positions = [[n + depth for depth in (0, 1, 1, 2, 2)] for n in prefix]
            batch = BatchInfo.for_tree(views, positions, [ancestor_mask([-1, 0, 0, 1, 2])] * len(views), allocator,
                                       device)
        else:
            batch = BatchInfo.for_sequences(views, new, allocator, device)
        batches.append((name, batch, sum(new)))
    lengths = [61, 17, 130]  # precompute's ragged prefill: no cache, each sequence attends to its own tokens
    batches.append(("ragged", BatchInfo.without_cache(lengths, device), sum(lengths)))
    return batches, cache


def _dense_attention(q, k, v, cache, batch, scale: float, window: int | None) -> torch.Tensor:
    """The attention a paged batch means, computed densely in fp32 from its page table: the reference both backends
    are held to. Writes the new K/V into `cache` as a backend does; without a cache (None) each sequence attends to
    its own new tokens."""
    bounds, group = batch.qo_indptr.tolist(), q.shape[1] // k.shape[1]
    if cache is not None:
        k_flat, v_flat = cache[0].view(-1, *cache[0].shape[2:]), cache[1].view(-1, *cache[1].shape[2:])
        k_flat[batch.slot_mapping] = k.to(k_flat.dtype)
        v_flat[batch.slot_mapping] = v.to(v_flat.dtype)
        page_bounds, pages = batch.kv_page_indptr.tolist(), batch.kv_page_indices.tolist()
    outputs = []
    for b, kv_len in enumerate(batch.kv_lens):
        if cache is None:
            keys, values = k[bounds[b]:bounds[b + 1]], v[bounds[b]:bounds[b + 1]]
        else:
            slots = [page * batch.page_size + i for page in pages[page_bounds[b]:page_bounds[b + 1]]
                     for i in range(batch.page_size)][:kv_len]
            keys, values = k_flat[slots], v_flat[slots]
        keys = keys.float().repeat_interleave(group, dim=1)  # [kv_len, heads, head_dim]
        values = values.float().repeat_interleave(group, dim=1)
        q_b = q[bounds[b]:bounds[b + 1]].float()  # [n_q, heads, head_dim]
        q_positions = batch.positions[bounds[b]:bounds[b + 1]]
        key_positions = torch.arange(kv_len, device=q.device)
        allowed = key_positions[None, :] <= q_positions[:, None]
        if window is not None:
            allowed &= key_positions[None, :] > q_positions[:, None] - window
        if batch.tree_masks is not None:  # the tree region: ancestors only
            width = batch.tree_masks[b].shape[1]
            allowed[:, kv_len - width:] = batch.tree_masks[b]
        scores = torch.einsum("qhd,khd->hqk", q_b, keys) * scale
        probs = scores.masked_fill(~allowed[None], float("-inf")).softmax(-1)
        outputs.append(torch.einsum("hqk,khd->qhd", probs, values))
    return torch.cat(outputs)


def _attention_errors(backend, device: torch.device, dtype: torch.dtype, reference=None) -> dict[str, float]:
    """Max |Δ| of `backend` against `reference` (a backend; default the dense computation) on every batch kind, with
    and without a sliding window."""
    heads, kv_heads, head_dim = ATTENTION_SHAPE.values()
    batches, cache = _attention_batches(device, dtype, kv_heads, head_dim)
    gen = torch.Generator(device=device).manual_seed(0)
    errors = {}
    for name, batch, num_tokens in batches:
        for window in (None, 64):
            q = torch.randn(num_tokens, heads, head_dim, device=device, dtype=dtype, generator=gen)
            k = torch.randn(num_tokens, kv_heads, head_dim, device=device, dtype=dtype, generator=gen)
            v = torch.randn(num_tokens, kv_heads, head_dim, device=device, dtype=dtype, generator=gen)

            def layer_cache():
                return tuple(t.clone() for t in cache) if batch.uses_cache else None

            ours = backend.attend(q, k, v, layer_cache(), batch, head_dim**-0.5, window)
            theirs = (_dense_attention(q, k, v, layer_cache(), batch, head_dim**-0.5, window) if reference is None
                      else reference.attend(q, k, v, layer_cache(), batch, head_dim**-0.5, window))
            errors[f"{name}{'_window' if window else ''}"] = float((ours.float() - theirs.float()).abs().max())
    return errors


def _time_ms(fn, device: torch.device, repeats: int = 20) -> float:
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - start) / repeats * 1e3


def _attention_timings(backends: list, device: torch.device, cached: int, prompt: int, repeats: int) -> dict:
    """One layer's attention per backend (its plan made once per batch, as a forward shares it over the layers), in
    bf16: decode (1 new token after `cached`) and prefill (`prompt` new tokens), at batch 1 and 8."""
    from mtp_train.runtime.attention import BatchInfo
    from mtp_train.runtime.kv_cache import PageAllocator, Sequence

    heads, kv_heads, head_dim = ATTENTION_SHAPE.values()
    figures = {}
    for batch_size in TIMING_BATCH_SIZES:
        for phase, (prefix, new) in (("decode", (cached, 1)), ("prefill", (0, prompt))):
            allocator = PageAllocator(batch_size * (-(-(prefix + new) // 16)), page_size=16)
            shape = (allocator.num_pages, 16, kv_heads, head_dim)
            cache = (torch.randn(shape, device=device, dtype=torch.bfloat16),
                     torch.randn(shape, device=device, dtype=torch.bfloat16))
            views = [Sequence(i) for i in range(batch_size)]
            for view in views:
                view.reserve(prefix, allocator)
                view.num_cached = prefix
            batch = BatchInfo.for_sequences(views, [new] * batch_size, allocator, device, advance=False)
            q = torch.randn(batch_size * new, heads, head_dim, device=device, dtype=torch.bfloat16)
            k = torch.randn(batch_size * new, kv_heads, head_dim, device=device, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            for backend in backends:
                figures[f"{phase}_b{batch_size}_{backend.name}_ms"] = round(_time_ms(
                    lambda: backend.attend(q, k, v, cache, batch, head_dim**-0.5, None), device, repeats), 3)
    return figures


def check_attention(ctx: Context) -> dict:
    """The torch backend (CPU and CUDA) against the dense computation of each paged batch kind, and its timings."""
    from mtp_train.runtime.attention import get_backend

    backend = get_backend("torch", ctx.device)
    errors = _attention_errors(backend, ctx.device, torch.float32)
    print("  torch vs dense (fp32): " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    worst = max(errors.values())
    if worst > 1e-4:
        raise AssertionError(f"the torch backend differs from the dense computation by {worst:.2e} (fp32)")
    timings = (_attention_timings([backend], ctx.device, cached=2048, prompt=512, repeats=20) if ctx.on_cuda else
               _attention_timings([backend], ctx.device, cached=256, prompt=64, repeats=2))  # the smoke mode's
    print("  " + ", ".join(f"{k} {v}" for k, v in timings.items()))
    return {"torch_max_abs": f"{worst:.1e}", **timings}


def check_flashinfer(ctx: Context) -> dict:
    """FlashInfer against the torch backend in bf16 on every batch kind, greedy tokens of a whole model with each,
    and both backends' timings."""
    if not ctx.on_cuda:
        raise Skipped("needs CUDA")
    if _version("flashinfer-python") == "not installed":
        raise Skipped("flashinfer-python is not installed (the `gpu` extra)")
    from mtp_train.evaluate.margins import clear_prefix_length, decode_logits
    from mtp_train.runtime.attention import get_backend
    from mtp_train.runtime.generate import generate
    from mtp_train.runtime.loader import load_model
    from tests.tiny_models import save_tiny_model

    flashinfer, reference = get_backend("flashinfer", ctx.device, torch.bfloat16), get_backend("torch", ctx.device)
    errors = _attention_errors(flashinfer, ctx.device, torch.bfloat16, reference)
    print("  flashinfer vs torch (bf16): " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    problems = [f"{name}: {err:.2e}" for name, err in errors.items() if err > 2e-2]
    # A whole model (head_dim 64: FlashInfer's kernels take 64, 128, 256) decoding greedily with each backend.
    model_dir = save_tiny_model(ctx.work / "flashinfer-model", hidden_size=256, num_attention_heads=4,
                                num_key_value_heads=2, vocab_size=512)
    model = load_model(model_dir, dtype="bfloat16", device=ctx.device)
    prompts = [torch.randint(2, 512, (n,)).tolist() for n in (40, 7, 100, 23)]
    tokens, logits = {}, {}
    for backend in (reference, flashinfer):
        model.backend = backend
        results, _ = generate(model, prompts, 24)
        tokens[backend.name] = [r.token_ids for r in results]
        # each backend's logits along the torch backend's tokens, decoded as generate decodes
        logits[backend.name] = [decode_logits(model, p, t) for p, t in zip(prompts, tokens["torch"])]
    same = sum(a == b for a, b in zip(tokens["torch"], tokens["flashinfer"]))
    print(f"  greedy tokens identical for {same}/{len(prompts)} prompts")
    for index, (ours, theirs) in enumerate(zip(tokens["torch"], tokens["flashinfer"])):
        # the steps whose margin clears twice the backends' measured difference must agree (bf16 near-ties may not)
        error = float((logits["flashinfer"][index] - logits["torch"][index]).abs().max())
        clear = clear_prefix_length(logits["torch"][index], error)
        if ours[:clear] != theirs[:clear]:
            problems.append(f"prompt {index}: greedy tokens differ within the first {clear} steps, whose margins "
                            f"clear 2 × the backends' logit difference {error:.3f}")
    timings = _attention_timings([reference, flashinfer], ctx.device, cached=2048, prompt=512, repeats=20)
    print("  " + ", ".join(f"{k} {v}" for k, v in timings.items()))
    if problems:
        raise AssertionError("FlashInfer vs torch: " + "; ".join(problems))
    return {"max_abs": f"{max(errors.values()):.1e}", "greedy_identical": f"{same}/{len(prompts)}", **timings}


SECTIONS = (("env", check_env), ("parity", check_parity), ("precompute", check_precompute), ("train", check_train),
            ("eval", check_eval), ("attention", check_attention), ("flashinfer", check_flashinfer))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="run on the CPU, the CUDA-only parts skipped (smoke mode)")
    parser.add_argument("--smollm2", type=Path, default=None,
                        help="SmolLM2's directory for the parity section (default: the fetched one, if present)")
    parser.add_argument("--work", type=Path, default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument("--out", type=Path, default=None, help="write gpu_check.json here")
    parser.add_argument("--sections", nargs="+", choices=[name for name, _ in SECTIONS], default=None,
                        help="run only these (train needs precompute, eval needs train)")
    args = parser.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        parser.error("no CUDA device here; run with --cpu for the CPU smoke mode")
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    work_dir = tempfile.TemporaryDirectory(prefix="gpu_check-") if args.work is None else None
    work = Path(work_dir.name) if work_dir else args.work
    smollm2 = args.smollm2 or asset_dir(DEFAULT_MODEL)
    ctx = Context(device, work, smollm2 if is_present(smollm2, MODEL_MARKER) else None)
    started = time.perf_counter()
    results = []
    for name, check in SECTIONS:
        if args.sections and name not in args.sections:
            continue
        section = Section(name)
        print(f"== {name}", flush=True)
        start = time.perf_counter()
        try:
            section.figures = check(ctx)
        except Skipped as why:
            section.status, section.reason = "skipped", str(why)
        except Exception as err:  # noqa: BLE001 -- a failed section is reported and the others still run
            section.status, section.reason = "failed", f"{type(err).__name__}: {err}"
            traceback.print_exc()
        section.seconds = round(time.perf_counter() - start, 1)
        print(f"== {name}: {section.status}{' (' + section.reason + ')' if section.reason else ''} "
              f"in {section.seconds} s", flush=True)
        results.append(section)
    if work_dir is not None:
        work_dir.cleanup()
    total = round(time.perf_counter() - started, 1)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_check.json").write_text(json.dumps(
            {"device": str(device), "seconds": total, "sections": [vars(s) for s in results]}, indent=1))
    pairs = {"device": device.type, **{s.name: s.status for s in results}, "seconds": total}
    for section in results:
        pairs.update({f"{section.name}_{k}": v for k, v in section.figures.items()
                      if section.name != "env" and not isinstance(v, (dict, list))})
    print("RESULT " + " ".join(f"{k}={str(v).replace(' ', '_')}" for k, v in pairs.items()))
    return 1 if any(s.status == "failed" for s in results) else 0


if __name__ == "__main__":
    sys.exit(main())
