"""Our draft head beside the peer trainer's at equal data, judged in vLLM's CPU build (issue 60, item 3).

One command: train (or reuse) our head with the recipe (`mtp-train prepare / precompute / draft-vocab / train`,
`export`), train the peer's head of the same kind on the same conversations (vLLM's `speculators`, in its own
virtualenv `.venv-peer`: `make .venv-peer/.installed`), then serve both in vLLM's CPU build (`.venv-vllm`) on the
same prompts, k list and greedy settings, batch 1, with one plain run, and print a markdown table and a line
`RESULT ours_tau_k1=... peer_tau_k1=... ... ours_train_min=... peer_train_min=...`.

    .venv/bin/python scripts/peer_compare.py                   # EAGLE-3, recipes/smollm2-135m-eagle3.yaml
    .venv/bin/python scripts/peer_compare.py --quick           # 40 conversations, 1 epoch, 3 prompts: the plumbing
    .venv/bin/python scripts/peer_compare.py --set train.epochs=1  # both 1 epoch (the peer: ~20 min an epoch here)
    .venv/bin/python scripts/peer_compare.py --set train.epochs=1 --heads peer --peer-optimizer adamw

Equal data, for EAGLE-3. The peer trains on our prepared train split (the token ids and assistant loss mask `mtp-train
prepare` wrote, the same max_seq_len), passed through `speculators prepare-data` as speculator-format rows; its
validation rows are our held-out split (speculators always holds out a share of its dataset: `--train-data-ratio`
is set so that exactly our train rows are trained on). Same epochs, same draft vocabulary size (its mapping is built
the peer's way, the most frequent assistant tokens, counted here over the train rows and handed over as d2t/t2d .npy
files), a packed sequence of our global batch's tokens (micro_batch_tokens x our ranks x grad_accum). Everything else
is the peer's own default (optimizer Muon unless `--peer-optimizer`, lr, schedule, 3 TTT steps, ...), except what
its CPU run needs (sdpa attention, the eager loss, fp32 compute, no dataloader workers).

Hidden states. speculators reads `<data>/hidden_states/hs_{i}.safetensors` for row i of its prepared dataset:
`token_ids` int64 [seq] and `hidden_states` [seq, n_aux + 1, hidden], where `[:, :-1]` are the layers named by its
`target_layer_ids` and `[:, -1]` the verifier's last hidden state. Its layer ids follow vLLM's convention (speculators
`models/utils.py: resolve_target_layer_ids`, default [2, L // 2, L - 3], "the final hidden state" being id L; vLLM's
Llama `forward` records id `idx + 1` after decoder layer idx runs, i.e. the residual stream *entering* layer id):
id j is transformers' `hidden_states[j]`. Our `precompute.aux_layers` are 0-based decoder-layer *outputs*, so our
aux layer a is the peer's id a + 1 (our [1, 14, 26] = its [2, 15, 27] = its default for SmolLM2's 30 layers). The
last entry is the final decoder layer's output *before* the final norm (vLLM's residual stream; speculators applies
the verifier's norm itself: `models/eagle3/core.py` reads it only as `verifier_lm_head(verifier_norm(x))`, the
training targets). Two sources (`--peer-features`):
- `cache` (default): our feature cache, the very features our head trains on (our runtime's bf16 forward, K/V
  rounded as served): `[:, :-1]` our `aux_hidden`, `[:, -1]` our stored `hidden` H (after the final norm) divided by
  the norm's weight, i.e. the last layer's output rescaled to unit RMS, whose verifier_norm is H again, so the
  peer's targets are ours exactly. (A transformers forward costs ~3 s per 256-token sample on this 2-core CPU: half
  an hour for the recipe's 600 conversations, more than the peer's epoch.)
- `forward`: a transformers forward of the target in bf16, `hidden_states[id]` for the aux ids and a forward hook on
  the last decoder layer for the last entry (transformers' `hidden_states[-1]` is after the norm).
Either way stored bf16.

Adding a head kind (DFlash, later) is one more `HeadKind` in `KINDS`: its two contenders' build functions (ours,
the peer's) each return a `BuiltHead` (the export vLLM loads, its speculative method, training minutes); the judge,
the table and the RESULT line do not change.

The speculators release is patched for the CPU in .venv-peer only (`apply_cpu_patches`: device handling, each edit
checked against the expected original text, idempotent). Nothing here loads a pickle: hidden states, d2t/t2d and
checkpoints are safetensors / .npy (no object arrays) / JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
PEER_VENV = REPO / os.environ.get("PEER_VENV", ".venv-peer")  # the Makefile's PEER_VENV
PEER_VERSION = "0.9.0"  # the release the CPU patches were written against (Makefile PEER_SPEC)

# --------------------------------------------------------------------------------------------------------------
# The CPU patches of the installed speculators (device handling only)


@dataclass(frozen=True)
class Patch:
    """Replace every occurrence of `old` by `new` in `path` (relative to the installed package's directory)."""
    path: str
    old: str
    new: str
    why: str


CPU_PATCHES = (
    Patch("train/trainer.py", "self.model.to(self.local_rank)", 'self.model.to("cpu")',
          "the model goes to device index local_rank (cuda:0) when not distributed"),
    Patch("train/trainer.py", "v.to(self.local_rank, non_blocking=True)", 'v.to("cpu", non_blocking=True)',
          "each batch goes to device index local_rank (cuda:0)"),
    Patch("train/trainer.py", "torch.accelerator.synchronize()",
          "(torch.accelerator.is_available() and torch.accelerator.synchronize())",
          "the step timer synchronizes an accelerator there is none of"),
    Patch("utils/util.py", 'if acc is None:\n        return "cuda:0"', 'if acc is None:\n        return "cpu"',
          "the current device without an accelerator is cuda:0 (checkpoint loading)"),
)


class PatchError(RuntimeError):
    pass


def apply_cpu_patches(package_dir: Path, version: str, patches=CPU_PATCHES) -> list[str]:
    """Apply `patches` to the installed package at `package_dir` (speculators `version`); the edits made, as
    'file: why'. Idempotent: a file already holding `new` and no `old` is left alone. All files are checked before
    any is written, so a release whose text moved is refused whole, naming the file and the version."""
    texts: dict[Path, str] = {}
    for patch in patches:
        path = package_dir / patch.path
        if path not in texts:
            if not path.is_file():
                raise PatchError(f"speculators {version}: {path} is missing; the CPU patches were written for "
                                 f"speculators {PEER_VERSION}")
            texts[path] = path.read_text(encoding="utf-8")
    done, changed = [], {}
    for patch in patches:
        path = package_dir / patch.path
        text = changed.get(path, texts[path])
        unpatched = text.replace(patch.new, "\0") if patch.new else text  # `new` may hold `old` (a wrapped call)
        if patch.old in unpatched:
            changed[path] = unpatched.replace(patch.old, patch.new).replace("\0", patch.new)
            done.append(f"{patch.path}: {patch.why}")
        elif patch.new not in text:
            raise PatchError(f"speculators {version}: {path} holds neither the expected text {patch.old!r} nor its "
                             f"patched form; the CPU patches were written for speculators {PEER_VERSION} "
                             f"({patch.why})")
    for path, text in changed.items():
        path.write_text(text, encoding="utf-8")
    return done


def peer_package_dir(venv: Path) -> tuple[Path, str]:
    """(the installed speculators package directory, its version) in `venv`."""
    out = subprocess.run([str(venv / "bin" / "python"), "-c",
                          "import importlib.metadata as m, importlib.util as u; "
                          "print(u.find_spec('speculators').submodule_search_locations[0]); "
                          "print(m.version('speculators'))"], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"peer_compare: no speculators in {venv} (make .venv-peer/.installed):\n{out.stderr[-800:]}")
    location, version = out.stdout.split()
    return Path(location), version


# --------------------------------------------------------------------------------------------------------------
# Our prepared data -> speculators' rows, hidden-state files, vocabulary mapping


def speculator_rows(prepared_split) -> list[dict[str, list[int]]]:
    """Our prepared rows (`input_ids` int32, `loss_mask` uint8: 1 = assistant reply and its end-of-turn token) as
    speculators' speculator-format rows (`input_ids`, `loss_mask` of ints, same length, same order)."""
    rows = []
    for row in prepared_split:
        ids, mask = [int(t) for t in row["input_ids"]], [int(m) for m in row["loss_mask"]]
        if len(ids) != len(mask):
            raise ValueError(f"row {row.get('source_id')}: {len(ids)} ids but {len(mask)} mask entries")
        rows.append({"input_ids": ids, "loss_mask": mask})
    return rows


def peer_layer_ids(aux_layers: list[int]) -> list[int]:
    """speculators'/vLLM's layer ids (the residual stream entering layer id = transformers' hidden_states[id]) of
    our aux layers (0-based decoder-layer outputs)."""
    return [int(a) + 1 for a in aux_layers]


def order_like(prepared_ids: list[list[int]], wanted: list[list[int]]) -> list[int]:
    """Indices into `prepared_ids` (speculators prepare-data's shuffled output) that put its rows in `wanted`'s order;
    equal rows are matched in turn. Raises when a wanted row is missing."""
    where: dict[tuple, list[int]] = defaultdict(list)
    for i, ids in enumerate(prepared_ids):
        where[tuple(ids)].append(i)
    order = []
    for n, ids in enumerate(wanted):
        slots = where.get(tuple(ids))
        if not slots:
            raise ValueError(f"row {n} of ours is not in speculators' prepared dataset (dropped or changed)")
        order.append(slots.pop(0))
    return order


def hidden_state_record(model, input_ids: list[int], layer_ids: list[int]) -> dict:
    """One sample's hs file for speculators: {"token_ids": int64 [seq], "hidden_states": bf16 [seq, n + 1, hidden]}
    with hidden_states[:, i] = transformers' hidden_states[layer_ids[i]] and hidden_states[:, -1] the last decoder
    layer's output before the final norm."""
    import torch

    captured = {}

    def hook(_module, _inputs, output):
        captured["last"] = output[0] if isinstance(output, (tuple, list)) else output

    base = model.model  # the decoder stack without the lm_head (whose logits nobody reads here)
    handle = base.layers[len(base.layers) - 1].register_forward_hook(hook)
    try:
        ids = torch.tensor([input_ids], dtype=torch.long)
        with torch.inference_mode():
            out = base(input_ids=ids, output_hidden_states=True, use_cache=False)
    finally:
        handle.remove()
    states = [out.hidden_states[j][0] for j in layer_ids] + [captured["last"].reshape(len(input_ids), -1)]
    return {"token_ids": ids[0].clone(), "hidden_states": torch.stack(states, dim=1).to(torch.bfloat16).contiguous()}


def write_hidden_states(model, rows: list[list[int]], out_dir: Path, layer_ids: list[int], show=print) -> None:
    """hs_{i}.safetensors for row i of `rows` (token ids), skipping files already written (a rerun resumes)."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    for i, ids in enumerate(rows):
        path = out_dir / f"hs_{i}.safetensors"
        if path.is_file():
            continue
        record = hidden_state_record(model, ids, layer_ids)
        save_file(record, str(path.with_suffix(".tmp")))
        os.replace(path.with_suffix(".tmp"), path)
        if (i + 1) % 100 == 0:
            show(f"peer data: hidden states {i + 1}/{len(rows)} ({time.perf_counter() - started:.0f} s)")


def records_from_cache(shard: dict, norm_weight, aux_count: int):
    """speculators' hs records from one shard of our feature cache (`mtp_train/features/format.py`): yields
    (sample_index, record). `[:, :-1]` is our `aux_hidden` (the outputs of our aux layers = its layer ids a + 1);
    `[:, -1]` is our stored `hidden` H (after the final norm) divided by the norm's weight: the last layer's output
    rescaled to unit RMS, whose verifier_norm is H again. speculators reads that entry only through its
    verifier_norm -> verifier_lm_head (the training targets), so this equals the pre-norm output there."""
    import torch

    if "aux_hidden" not in shard or shard["aux_hidden"].shape[1] != aux_count:
        raise ValueError(f"the feature cache has no aux_hidden with {aux_count} layers")
    if "hidden_scale" in shard or "aux_hidden_scale" in shard:
        raise ValueError("a float8 feature cache (scaled) is not supported here; precompute with features bfloat16")
    offsets = shard["offsets"].tolist()
    weight = norm_weight.float()
    for s, index in enumerate(shard["sample_index"].tolist()):
        a, b = offsets[s], offsets[s + 1]
        last = (shard["hidden"][a:b].float() / weight)[:, None]
        states = torch.cat([shard["aux_hidden"][a:b].float(), last], dim=1).to(torch.bfloat16).contiguous()
        yield index, {"token_ids": shard["input_ids"][a:b].to(torch.int64).contiguous(), "hidden_states": states}


def write_hidden_states_from_cache(features_dir: Path, target_dir: Path, splits: dict[str, list[list[int]]],
                                   out_dir: Path, aux_count: int) -> None:
    """hs_{i}.safetensors for the rows of `splits` (name -> token ids, in order; i counts across the splits in
    order) from our feature cache at `features_dir`, each checked to hold that row's token ids."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    manifest = json.loads((features_dir / "manifest.json").read_text())
    with safe_open(str(target_dir / "model.safetensors"), framework="pt") as f:
        norm_weight = f.get_tensor("model.norm.weight")
    out_dir.mkdir(parents=True, exist_ok=True)
    start, written = 0, 0
    for split, rows in splits.items():
        seen = set()
        for entry in manifest["splits"][split]["shards"]:
            for index, record in records_from_cache(load_file(str(features_dir / entry["name"])), norm_weight,
                                                    aux_count):
                if record["token_ids"].tolist() != rows[index]:
                    raise ValueError(f"{features_dir}: {split} sample {index}'s token ids differ from the prepared row")
                save_file(record, str(out_dir / f"hs_{start + index}.safetensors"))
                seen.add(index)
        if len(seen) != len(rows):
            raise ValueError(f"{features_dir}: {split} holds {len(seen)} of the {len(rows)} prepared samples")
        start += len(rows)
        written += len(seen)


def draft_vocab_mapping(rows: list[dict[str, list[int]]], draft_vocab_size: int, target_vocab_size: int):
    """speculators' draft vocabulary for `rows` (its rule: the `draft_vocab_size` most frequent assistant tokens,
    ties to the lower id, padded with the lowest unused ids; sorted): (d2t int64 [draft]: target id - draft index,
    t2d bool [target])."""
    import numpy as np

    counts: Counter[int] = Counter()
    for row in rows:
        counts.update(t for t, m in zip(row["input_ids"], row["loss_mask"]) if m)
    chosen = sorted(counts, key=lambda t: (-counts[t], t))[:draft_vocab_size]
    taken = set(chosen)
    for t in range(target_vocab_size):
        if len(chosen) >= draft_vocab_size:
            break
        if t not in taken:
            chosen.append(t)
    chosen.sort()
    d2t = np.asarray(chosen, dtype=np.int64) - np.arange(draft_vocab_size, dtype=np.int64)
    t2d = np.zeros(target_vocab_size, dtype=bool)
    t2d[chosen] = True
    return d2t, t2d


# --------------------------------------------------------------------------------------------------------------
# Contenders


@dataclass
class BuiltHead:
    label: str                     # "ours" / "peer"
    trainer: str                   # who trained it, in words
    export_dir: Path               # what vLLM loads as the speculative model
    method: str                    # vLLM's speculative method
    train_minutes: float | None
    train_minutes_source: str      # how the minutes were measured
    optimizer: str
    notes: dict[str, Any] = field(default_factory=dict)
    hf_overrides: dict | None = None

    def speculative(self, k: int) -> dict:
        return {"method": self.method, "model": str(self.export_dir.resolve()), "num_speculative_tokens": k}


@dataclass
class Context:
    args: argparse.Namespace
    recipe: Any                    # our recipe, with --set and the quick overrides applied
    overrides: list[str]           # the --set list handed to every mtp-train stage
    work: Path                     # runs/peer-compare/<kind>[-quick]
    ours_dir: Path
    show: Callable = print


@dataclass
class HeadKind:
    name: str
    ours: Callable[[Context], BuiltHead]
    peer: Callable[[Context], BuiltHead]


def _run(command: list[str], log: Path | None = None, env: dict | None = None, show=print) -> float:
    """Run `command` in the repository (its output to `log` when given); its wall seconds. Exits on failure."""
    show("$ " + " ".join(command) + (f"  > {log}" if log else ""))
    started = time.perf_counter()
    if log:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a", encoding="utf-8") as out:
            result = subprocess.run(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    else:
        result = subprocess.run(command, cwd=REPO, env=env)
    if result.returncode != 0:
        tail = "\n".join(log.read_text(encoding="utf-8", errors="replace").splitlines()[-25:]) if log else ""
        raise SystemExit(f"peer_compare: failed (exit {result.returncode}): {' '.join(command)}\n{tail}")
    return time.perf_counter() - started


def _threads_env(n: int) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": str(n), "MKL_NUM_THREADS": str(n), "TOKENIZERS_PARALLELISM": "false"}


def build_ours_eagle3(ctx: Context) -> BuiltHead:
    """prepare / precompute (2 ranks) / draft-vocab / train (2 ranks) / export --format eagle3, each skipped where
    its output is there; `--ours-head DIR` takes a trained head (or an eagle3 export) instead."""
    args, recipe, show = ctx.args, ctx.recipe, ctx.show
    py = sys.executable
    base = ["--recipe", str(args.recipe)] + [a for o in ctx.overrides for a in ("--set", o)]
    ranks = args.nproc
    launcher = [py, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", f"--master-port={args.port}",
                "-m", "mtp_train"] if ranks > 1 else [py, "-m", "mtp_train"]
    threads = _threads_env(max(1, (os.cpu_count() or 2) // ranks))
    log = ctx.ours_dir / "pipeline.log"
    timings_path = ctx.ours_dir / "timings.json"
    timings = json.loads(timings_path.read_text()) if timings_path.is_file() else {}
    head_dir = Path(args.ours_head) if args.ours_head else Path(recipe.run_dir) / "head"
    if not args.ours_head:
        if not (Path(recipe.prepared_dir) / "fingerprint.json").is_file():
            timings["prepare_s"] = _run([py, "-m", "mtp_train", "prepare", *base], log, show=show)
        if not (Path(recipe.features_dir) / "manifest.json").is_file():
            timings["precompute_s"] = _run([*launcher, "precompute", *base], log, threads, show=show)
            if recipe.head.draft_vocab_size != "full":
                _run([py, "-m", "mtp_train", "draft-vocab", *base], log, show=show)
        if not (head_dir / "model.safetensors").is_file():
            timings["train_s"] = _run([*launcher, "train", *base], log, threads, show=show)
        timings_path.parent.mkdir(parents=True, exist_ok=True)
        timings_path.write_text(json.dumps(timings, indent=1) + "\n")
    if (head_dir / "config.json").is_file() and not (head_dir / "head_config.json").is_file():
        export_dir = head_dir  # already an eagle3 export
    else:
        export_dir = ctx.ours_dir / "export-eagle3"
        if not (export_dir / "config.json").is_file():
            _run([py, "-m", "mtp_train", "export", "--format", "eagle3", "--head", str(head_dir), "--target",
                  str(recipe.target.path), "--out", str(export_dir), "--overwrite"], log, show=show)
    minutes, source = None, "unknown"
    if "train_s" in timings and not args.ours_head:
        minutes, source = timings["train_s"] / 60, f"wall time of `mtp-train train` ({ranks} ranks)"
    summary = head_dir.parent / "summary.json"
    if minutes is None and summary.is_file():
        minutes = json.loads(summary.read_text())["train_seconds"] / 60
        source = "summary.json train_seconds (the training loop)"
    return BuiltHead("ours", f"mtp_train ({ranks} ranks, DeepSpeed ZeRO-{recipe.train.zero_stage})", export_dir,
                     "eagle3", minutes, source, f"AdamW lr {recipe.train.lr:g}",
                     notes={"head": str(head_dir), "epochs": recipe.train.epochs,
                            "draft_vocab": recipe.head.draft_vocab_size, "unroll_steps": recipe.train.unroll_steps})


def _peer_data(ctx: Context, peer_dir: Path, layer_ids: list[int]) -> dict:
    """The peer's dataset (speculators prepare-data over our train + held-out rows, reordered: train rows first),
    its hidden-state files and the draft-vocabulary mapping; reused when `done.json` says so."""
    from mtp_train.data.prepared import load_prepared

    recipe, show = ctx.recipe, ctx.show
    data_dir = peer_dir / "data"
    done = data_dir / "done.json"
    prepared = load_prepared(recipe.prepared_dir)
    train_rows, eval_rows = speculator_rows(prepared.train), speculator_rows(prepared.eval)
    source = ctx.args.peer_features
    fingerprint = hashlib.sha256(json.dumps([train_rows, eval_rows, layer_ids, source]).encode()).hexdigest()[:16]
    if done.is_file() and json.loads(done.read_text()).get("fingerprint") == fingerprint:
        return json.loads(done.read_text())
    import numpy as np
    import torch
    from datasets import load_from_disk
    from transformers import AutoModelForCausalLM

    rows_path = peer_dir / "rows.jsonl"
    rows_path.parent.mkdir(parents=True, exist_ok=True)
    with open(rows_path, "w", encoding="utf-8") as out:
        for row in train_rows + eval_rows:
            out.write(json.dumps(row) + "\n")
    shuffled = peer_dir / "prepare-data"
    if shuffled.exists():
        import shutil

        shutil.rmtree(shuffled)  # ours (written by this script)
    _run([str(PEER_VENV / "bin" / "speculators"), "prepare-data", "--model", str(Path(recipe.target.path).resolve()),
          "--data", str(rows_path), "--output", str(shuffled), "--seq-length", str(recipe.data.max_seq_len),
          "--num-preprocessing-workers", "1"], peer_dir / "peer.log", _threads_env(2), show=show)
    dataset = load_from_disk(str(shuffled))
    order = order_like([list(map(int, r)) for r in dataset["input_ids"]],
                       [r["input_ids"] for r in train_rows + eval_rows])
    dataset = dataset.select(order)
    if data_dir.exists():
        import shutil

        shutil.rmtree(data_dir)
    dataset.save_to_disk(str(data_dir))
    started = time.perf_counter()
    if source == "cache":
        write_hidden_states_from_cache(Path(recipe.features_dir), Path(recipe.target.path),
                                       {"train": [r["input_ids"] for r in train_rows],
                                        "eval": [r["input_ids"] for r in eval_rows]},
                                       data_dir / "hidden_states", len(layer_ids))
    else:
        model = AutoModelForCausalLM.from_pretrained(recipe.target.path, dtype=torch.bfloat16)
        model.eval()
        torch.set_num_threads(ctx.args.peer_threads)
        write_hidden_states(model, [r["input_ids"] for r in train_rows + eval_rows], data_dir / "hidden_states",
                            layer_ids, show)
    hs_seconds = time.perf_counter() - started
    show(f"peer data: {len(train_rows) + len(eval_rows)} hidden-state files from the {source} in {hs_seconds:.0f} s")
    info = {"fingerprint": fingerprint, "train_rows": len(train_rows), "eval_rows": len(eval_rows),
            "train_tokens": sum(len(r["input_ids"]) for r in train_rows), "layer_ids": layer_ids,
            "hidden_states_source": source, "hidden_states_s": round(hs_seconds, 1)}
    size = recipe.head.draft_vocab_size
    if size != "full":
        vocab = json.loads((Path(recipe.target.path) / "config.json").read_text())["vocab_size"]
        d2t, t2d = draft_vocab_mapping(train_rows, int(size), vocab)
        np.save(data_dir / f"d2t-{size}.npy", d2t)
        np.save(data_dir / f"t2d-{size}.npy", t2d)
        info["draft_vocab"] = int(size)
    done.write_text(json.dumps(info, indent=1) + "\n")
    return info


def build_peer_eagle3(ctx: Context) -> BuiltHead:
    """speculators' EAGLE-3 on our conversations (see the module docstring), in .venv-peer, patched for the CPU."""
    args, recipe, show = ctx.args, ctx.recipe, ctx.show
    package, version = peer_package_dir(PEER_VENV)
    for edit in apply_cpu_patches(package, version):
        show(f"peer: patched {edit}")
    layer_ids = peer_layer_ids(recipe.precompute.aux_layers)
    optimizer = args.peer_optimizer or "muon"
    extra = list(args.peer_arg or [])
    key = hashlib.sha256(json.dumps([optimizer, args.peer_lr, extra, recipe.train.epochs]).encode()).hexdigest()[:8]
    peer_dir = ctx.work / "peer"
    info = _peer_data(ctx, peer_dir, layer_ids)
    data_dir = peer_dir / "data"
    run_dir = peer_dir / f"run-{optimizer}-{key}"
    epochs = recipe.train.epochs
    checkpoint = run_dir / "checkpoints" / str(epochs - 1)
    record_path = run_dir / "peer_run.json"
    seq_len = recipe.train.micro_batch_tokens * args.nproc * recipe.train.grad_accum
    if not (checkpoint / "config.json").is_file() or not record_path.is_file():
        n_train, n_all = info["train_rows"], info["train_rows"] + info["eval_rows"]
        if not info["eval_rows"]:  # speculators needs a validation share: our last train row, then
            n_train -= 1
            show("peer: our held-out split is empty; speculators validates on our last train row (not trained on)")
        command = [str(PEER_VENV / "bin" / "speculators"), "train", "--speculator-type", "eagle3",
                   "--verifier-name-or-path", str(Path(recipe.target.path).resolve()),
                   "--data-path", str(data_dir), "--total-seq-len", str(seq_len),
                   "--train-data-ratio", f"{(n_train + 0.5) / n_all:.8f}",
                   "--target-layer-ids", *map(str, layer_ids),
                   "--draft-attn-impl", "sdpa", "--loss-implementation", "eager", "--hidden-states-dtype", "float32",
                   "--num-workers", "0", "--epochs", str(epochs), "--on-missing", "raise",
                   "--optimizer", optimizer, "--save-path", str(run_dir / "checkpoints"),
                   "--log-dir", str(run_dir / "logs"), "--no-resume-from-checkpoint"]
        if recipe.head.draft_vocab_size != "full":
            size = recipe.head.draft_vocab_size
            command += ["--draft-vocab-size", str(size), "--d2t-path", str(data_dir / f"d2t-{size}.npy"),
                        "--t2d-path", str(data_dir / f"t2d-{size}.npy")]
        if args.peer_lr is not None:
            command += ["--lr", str(args.peer_lr)]
        command += extra
        seconds = _run(command, run_dir / "train.log", _threads_env(args.peer_threads), show=show)
        if not (checkpoint / "config.json").is_file():
            raise SystemExit(f"peer_compare: speculators train left no {checkpoint}/config.json; see "
                             f"{run_dir / 'train.log'}")
        record_path.write_text(json.dumps({"train_s": seconds, "command": command, "speculators": version}, indent=1)
                               + "\n")
    record = json.loads(record_path.read_text())
    return BuiltHead("peer", f"speculators {record['speculators']} (1 process, {args.peer_threads} threads)",
                     checkpoint, "eagle3", record["train_s"] / 60, "wall time of `speculators train`",
                     optimizer + (f" lr {args.peer_lr:g}" if args.peer_lr is not None else " (its default lr)"),
                     notes={"epochs": epochs, "total_seq_len": seq_len, "layer_ids": layer_ids,
                            "draft_vocab": recipe.head.draft_vocab_size, "extra": extra})


KINDS = {"eagle3": HeadKind("eagle3", build_ours_eagle3, build_peer_eagle3)}

# --------------------------------------------------------------------------------------------------------------
# The judge: vLLM's CPU build, plain once, each head at each k


def judge(heads: list[BuiltHead], target_dir: str, prompts: list[list[int]], stops: list[int], ks: list[int],
          max_new_tokens: int, work_dir: Path, engine_args: dict, dtype: str = "auto", show=print) -> dict:
    from mtp_train.export.vllm_eval import acceptance_from_counters
    from mtp_train.vllm_engine.engine import VllmWorker

    engine_args = {"max_model_len": max(len(p) for p in prompts) + max_new_tokens + max(ks) + 8, **engine_args}

    def one(name: str, speculative: dict | None, overrides: dict | None) -> dict:
        settings = {"mode": "generate", "model": str(Path(target_dir).resolve()), "dtype": dtype,
                    "speculative_config": speculative, "hf_overrides": overrides, "engine_args": engine_args}
        with VllmWorker(settings, work_dir / name) as worker:
            reply = worker.request({"op": "generate", "prompts": prompts, "max_new_tokens": max_new_tokens,
                                    "stop_token_ids": stops})
            metrics = worker.request({"op": "metrics"}, "metrics") if speculative else {}
            return {"outputs": reply["outputs"], "seconds": reply["seconds"], "metrics": metrics,
                    "info": worker.info}

    show(f"judge: {len(prompts)} prompts, ≤ {max_new_tokens} new tokens, greedy, batch 1; plain, then "
         f"{', '.join(h.label for h in heads)} at k = {', '.join(map(str, ks))}, one vLLM engine each")
    plain = one("plain", None, None)
    plain_tokens = sum(len(o) for o in plain["outputs"])
    plain_rate = plain_tokens / max(sum(plain["seconds"]), 1e-9)
    show(f"judge: plain {plain_rate:.1f} tok/s")
    rows: dict[str, dict[int, dict]] = {}
    for head in heads:
        rows[head.label] = {}
        for k in ks:
            run = one(f"{head.label}-k{k}", head.speculative(k), head.hf_overrides)
            tau, per_position, drafts = acceptance_from_counters(run["metrics"], k)
            tokens = sum(len(o) for o in run["outputs"])
            rate = tokens / max(sum(run["seconds"]), 1e-9)
            differing = [i for i, (a, b) in enumerate(zip(run["outputs"], plain["outputs"])) if a != b]
            rows[head.label][k] = {"tau": round(tau, 4), "acceptance_per_position": [round(a, 4) for a in per_position],
                                   "drafts": drafts, "new_tokens": tokens, "tokens_per_s": round(rate, 2),
                                   "speedup": round(rate / plain_rate, 4), "same_as_plain": not differing,
                                   "prompts_differing": differing}
            show(f"judge: {head.label} k={k}: τ {tau:.3f}, acceptance {', '.join(f'{a:.2f}' for a in per_position)}, "
                 f"{rate:.1f} tok/s ({rate / plain_rate:.2f}×), output "
                 f"{'= plain' if not differing else f'differs on {len(differing)} prompt(s)'}")
    return {"vllm": plain["info"].get("vllm"), "device": plain["info"].get("device"),
            "dtype": plain["info"].get("dtype"), "plain_tokens_per_s": round(plain_rate, 2),
            "plain_new_tokens": plain_tokens, "prompts": len(prompts), "max_new_tokens": max_new_tokens, "rows": rows}


def markdown(result: dict, heads: list[BuiltHead]) -> str:
    ks = sorted({k for rows in result["rows"].values() for k in rows})
    lines = [f"vLLM {result['vllm']} ({result['device']}, {result['dtype']}); {result['prompts']} prompts, "
             f"≤ {result['max_new_tokens']} new tokens, greedy, batch 1; plain {result['plain_tokens_per_s']:.1f} tok/s",
             "", "| head | trainer | optimizer | train min | k | τ | acceptance by position | tok/s | speedup | "
             "output = plain |", "|---|---|---|---|---|---|---|---|---|---|"]
    for head in heads:
        for k in ks:
            row = result["rows"][head.label][k]
            same = "yes" if row["same_as_plain"] else f"no ({len(row['prompts_differing'])})"
            minutes = f"{head.train_minutes:.1f}" if head.train_minutes is not None else "?"
            lines.append(f"| {head.label} | {head.trainer} | {head.optimizer} | {minutes} | {k} | {row['tau']:.3f} | "
                         f"{', '.join(f'{a:.2f}' for a in row['acceptance_per_position'])} | "
                         f"{row['tokens_per_s']:.1f} | {row['speedup']:.2f}× | {same} |")
    return "\n".join(lines)


def result_line(result: dict, heads: list[BuiltHead]) -> str:
    parts = []
    for head in heads:
        for k, row in sorted(result["rows"][head.label].items()):
            parts.append(f"{head.label}_tau_k{k}={row['tau']:.3f}")
    for head in heads:
        minutes = f"{head.train_minutes:.1f}" if head.train_minutes is not None else "nan"
        parts.append(f"{head.label}_train_min={minutes}")
    return "RESULT " + " ".join(parts)


# --------------------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", default="eagle3", choices=sorted(KINDS), help="head kind compared")
    parser.add_argument("--recipe", default="recipes/smollm2-135m-eagle3.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="recipe override for our stages (repeatable); train.epochs and the data keys also "
                             "set the peer's")
    parser.add_argument("--ours-head", help="our trained head directory (or its eagle3 export): skip our training")
    parser.add_argument("--peer-optimizer", choices=["adamw", "muon"], default=None,
                        help="the peer's optimizer (default: its own default, muon)")
    parser.add_argument("--peer-lr", type=float, default=None, help="the peer's lr (default: its own default)")
    parser.add_argument("--peer-arg", action="append", default=[], metavar="ARG",
                        help="one more argument for `speculators train` (repeatable, e.g. --peer-arg=--ttt-steps "
                             "--peer-arg=2)")
    parser.add_argument("--peer-features", choices=["cache", "forward"], default="cache",
                        help="where the peer's hidden states come from: our feature cache (the very features our "
                             "head trains on; default) or a transformers forward of the target (bf16)")
    parser.add_argument("--peer-threads", type=int, default=2, help="threads of the peer's one training process")
    parser.add_argument("--prompts", default=None, help="MT-bench-style JSONL or a built-in set (default: our "
                        "held-out split)")
    parser.add_argument("--limit", type=int, default=None, help="prompts judged (default: the recipe's eval.limit)")
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 3], help="k list (default 1 2 3)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default: the recipe's eval.max_new_tokens")
    parser.add_argument("--nproc", type=int, default=2, help="our ranks for precompute and train")
    parser.add_argument("--port", type=int, default=29583, help="torchrun's master port for our stages")
    parser.add_argument("--work-dir", default=None, help="default runs/peer-compare/<kind>[-quick]")
    parser.add_argument("--quick", action="store_true", help="40 conversations, 1 epoch, 3 prompts")
    parser.add_argument("--heads", default="ours,peer", help="contenders built and judged: ours,peer (default), "
                        "ours or peer")
    parser.add_argument("--skip-judge", action="store_true", help="train both, judge nothing")
    return parser.parse_args(argv)


def _interrupted(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")  # subprocess.run then kills the stage it waits on


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupted)
    os.chdir(REPO)
    sys.path.insert(0, str(REPO))
    from mtp_train.recipe import load_recipe

    kind = KINDS[args.kind]
    work = Path(args.work_dir or f"runs/peer-compare/{args.kind}{'-quick' if args.quick else ''}")
    quick = ["data.max_samples=40", "train.epochs=1"] if args.quick else []
    user = list(args.overrides)
    tag = ("ours-" + hashlib.sha256("\n".join(user).encode()).hexdigest()[:8]) if user else "ours"
    data_keys = any(o.split("=", 1)[0].split(".")[0] in ("data", "precompute", "target", "precision") for o in user)
    shared = work / (tag if data_keys else "ours")
    ours_dir = work / tag
    overrides = [f"data.output_dir={shared}/prepared", f"precompute.output_dir={shared}/features",
                 f"train.run_dir={ours_dir}/run", *quick, *user]
    recipe = load_recipe(args.recipe, overrides)
    ctx = Context(args, recipe, overrides, work, ours_dir, show=lambda m: print(m, flush=True))
    started = time.perf_counter()
    wanted = [h.strip() for h in args.heads.split(",") if h.strip()]
    unknown = sorted(set(wanted) - {"ours", "peer"})
    if unknown or not wanted:
        raise SystemExit(f"peer_compare: --heads takes ours and/or peer, not {args.heads!r}")
    heads = [build(ctx) for name, build in (("ours", kind.ours), ("peer", kind.peer)) if name in wanted]
    judged = "-".join(h.export_dir.parent.parent.name if h.label == "peer" else ours_dir.name for h in heads)
    report: dict[str, Any] = {"kind": args.kind, "recipe": str(args.recipe), "overrides": overrides,
                              "heads": [{**h.__dict__, "export_dir": str(h.export_dir)} for h in heads]}
    if not args.skip_judge:
        from mtp_train.evaluate.prompts import load_heldout, load_mt_bench
        from mtp_train.evaluate.runner import first_turn_ids
        from mtp_train.features.vllm_target import engine_args
        from mtp_train.runtime.chat import stop_token_ids
        from mtp_train.runtime.config import load_config
        from mtp_train.runtime.loader import load_tokenizer

        limit = 3 if args.quick and args.limit is None else (args.limit or recipe.eval.limit)
        tokenizer = load_tokenizer(recipe.target.path)
        prompt_set = load_mt_bench(args.prompts, limit) if args.prompts else load_heldout(recipe.prepared_dir, limit)
        prompts = [first_turn_ids(tokenizer, p) for p in prompt_set.prompts]
        stops = sorted(stop_token_ids(tokenizer, load_config(recipe.target.path)))
        spread = engine_args(recipe.precompute.vllm, max_sample_len=1)
        if recipe.precompute.vllm.max_model_len is None:
            del spread["max_model_len"]
        result = judge(heads, str(recipe.target.path), prompts, stops, list(args.k),
                       args.max_new_tokens or recipe.eval.max_new_tokens, work / "judge" / judged, spread,
                       dtype=recipe.precision.compute, show=ctx.show)
        result["prompt_source"] = prompt_set.source
        report["judge"] = result
        table = markdown(result, heads)
        print("\n" + table + "\n")
        report["markdown"] = table
        report["result"] = result_line(result, heads)
    report["wall_s"] = round(time.perf_counter() - started, 1)
    out = work / f"report-{judged}.json"
    out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"(report: {out})")
    if "result" in report:
        print(report["result"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
