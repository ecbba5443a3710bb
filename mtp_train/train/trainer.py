"""`mtp-train train`: fit a draft head on the feature cache with DeepSpeed (also under torchrun, multi-node).

Read top to bottom, as torchtitan separates them: `setup` (distributed, compute dtype, the target's frozen parts,
feature readers, head, DeepSpeed engine and schedule), `resume_from_checkpoint`, `train_step` (micro-batches →
unrolled losses → backward → DeepSpeed step; metric sums reduced over ranks), `save_checkpoint`, `save_head_files`,
and `run_training`, the loop that ties them together (periodic held-out validation through the runtime's draft path,
checkpoints, the summary). The run dir (`train.run_dir`, default `runs/<name>/`) holds
`checkpoints/step-N/` (DeepSpeed + our client state), `metrics.jsonl`, `summary.json`, `recipe.resolved.yaml`,
`wandb/` and, at the end, `head/` (native safetensors + head_config.json); also `run_id` (which checkpoints belong to
this run), `.lock` (one trainer at a time) and `previous-runs/` (what `--resume never` moved aside); see
train/checkpoints.py.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import random
import shutil
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import yaml
from tqdm import tqdm

from mtp_train.data.prepared import tokenizer_fingerprint
from mtp_train.errors import UserError
from mtp_train.features.draft_vocab import load_or_count
from mtp_train.features.format import cache_identity
from mtp_train.features.reader import FeatureReader
from mtp_train.fileio import atomic_write_text, read_json_object, replace_directory, write_json_atomic
from mtp_train.heads import head_class, save_head
from mtp_train.heads.vocab import coverage, select_draft_vocab
from mtp_train.recipe import RESOLVED_RECIPE_FILENAME, flatten_recipe, recipe_to_dict, save_resolved, with_precision
from mtp_train.runtime.distributed import all_reduce_host, init_process_group
from mtp_train.runtime.frozen_parts import load_frozen_parts
from mtp_train.runtime.precision import resolve_section
from mtp_train.train.checkpoints import (
    CheckpointInfo,
    RunDirLock,
    UnreadableCheckpoint,
    check_readable,
    check_recorded,
    check_world_size,
    disk_full_message,
    files_to_load,
    install_safe_loading,
    is_disk_full,
    read_checkpoint,
    read_run_id,
    retire_checkpoints,
    run_checkpoints,
    start_new_run,
)
from mtp_train.train.losses import add_sums, metric_means, metric_sums, unrolled_losses
from mtp_train.train.tracking import Tracker, truncate_metrics
from mtp_train.train.validation import first_step_inputs, validate

log = logging.getLogger(__name__)

# Keys that may change between a checkpoint and its resumption (they do not change what is computed step by step).
RESUMABLE_CHANGES = {
    "name", "target.path", "target.device", "data.output_dir", "precompute.output_dir", "train.run_dir",
    "train.max_steps", "train.epochs", "train.eval_every", "train.save_every", "train.keep_last",
    "precision.head_decode",  # eval's: training never reads it
}
RESUME_CHECKED_SECTIONS = ("target", "precision", "precompute", "head", "train")
HEAD_STORAGE_DTYPE = torch.bfloat16


# ---------------------------------------------------------------------------------------------------------------
# set-up helpers
# ---------------------------------------------------------------------------------------------------------------


def changed_recipe_keys(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Dotted keys of the checked sections whose values differ (ignoring RESUMABLE_CHANGES)."""
    old = flatten_recipe({s: saved.get(s) for s in RESUME_CHECKED_SECTIONS})
    new = flatten_recipe({s: current.get(s) for s in RESUME_CHECKED_SECTIONS})
    return sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k) and k not in RESUMABLE_CHANGES)


def lr_lambda(step: int, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """LR multiplier at optimizer step `step` (0-based): linear warmup, then cosine/linear decay to min_ratio."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "cosine":
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return min_ratio + (1 - min_ratio) * (1 - progress)


def deepspeed_config(recipe, world_size: int, use_bf16: bool) -> dict[str, Any]:
    """The recipe's DeepSpeed JSON (if any) completed with the values the recipe owns; conflicts are errors."""
    train = recipe.train
    config: dict[str, Any] = {}
    if train.deepspeed_config:
        path = Path(train.deepspeed_config)
        if not path.is_file():
            raise UserError(f"train.deepspeed_config: {path} not found")
        config = read_json_object(path, "train.deepspeed_config")
    source = train.deepspeed_config
    expected_global = train.grad_accum * world_size
    # One micro-batch = one packed token-budget batch from the feature reader.
    token_batches = ("micro-batches are token-budget batches (train.micro_batch_tokens), accumulation is "
                     "train.grad_accum")
    owned = (  # (section, key, the key as shown, the recipe's value, why a different value is refused)
        (config.setdefault("zero_optimization", {}), "stage", "zero_optimization.stage", train.zero_stage,
         f"but the recipe's train.zero_stage={train.zero_stage}; make them agree"),
        (config, "train_micro_batch_size_per_gpu", None, 1, f"conflicts with the recipe (1); {token_batches}"),
        (config, "gradient_accumulation_steps", None, train.grad_accum,
         f"conflicts with the recipe ({train.grad_accum}); {token_batches}"),
        (config, "train_batch_size", None, expected_global,
         f"does not equal micro-batches (1) × train.grad_accum ({train.grad_accum}) × world size ({world_size}) = "
         f"{expected_global}"),
        (config, "gradient_clipping", None, train.clip,
         f"conflicts with the recipe's train.clip={train.clip}; set it in one place"),
    )
    for section, key, shown, ours, why in owned:
        if key in section and section[key] != ours:
            raise UserError(f"{source}: {shown or key}={section[key]} {why}")
        section[key] = ours
    if train.optimizer == "muon":  # a client optimizer DeepSpeed does not list as tested under ZeRO (it handles it)
        config.setdefault("zero_allow_untested_optimizer", True)
    config["bf16"] = {**config.get("bf16", {}), "enabled": use_bf16}
    config.setdefault("steps_per_print", 10**9)
    config.setdefault("wall_clock_breakdown", False)
    return config


def _rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def _skip_deepspeed_shm_build() -> None:
    """DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce op (`deepspeed_shm_comm`) when it initializes
    the process group. Only DeepSpeed-Inference's `inference_all_reduce` uses it; training reduces through
    torch.distributed (gloo). The build runs in every fresh environment (CI, a fresh clone's `make demo`; its cost in
    docs/benchmarks.md), so the trainer tells DeepSpeed the op is unavailable, which is DeepSpeed's own fallback when
    the op cannot be built."""
    # import_module, not `import deepspeed.comm.torch as ...`: the package's `torch` attribute is the torch library.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def _choose_draft_vocab(head, target, features_dir: Path, source: str, is_main: bool) -> float:
    """Set the head's draft vocabulary to the top-N labels of the training features (counted by all ranks together
    and cached next to the features); returns the coverage of the counted labels."""
    weight = target.lm_head.weight.detach() if source == "target" else None
    vocab_size = target.config.vocab_size
    with torch.inference_mode():  # the ranks split the counting (or all read the cached counts)
        counts = load_or_count(features_dir, source, vocab_size, weight, progress=is_main, distributed=True)
    draft_ids = select_draft_vocab(counts, head.head_config.draft_vocab_size)
    head.set_draft_vocab(draft_ids)
    share = coverage(counts, draft_ids)
    if is_main:
        print(f"train: draft vocabulary of {draft_ids.numel()} tokens ({source} labels) covers {share:.2%} of them")
    return share


# ---------------------------------------------------------------------------------------------------------------
# the run: set-up, resume, one optimizer step, checkpoint, head files; `run_training` ties them together
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class TrainingRun:
    """What set-up produces and every later part reads: the recipe (dtypes resolved), the process group, the target's
    frozen parts, the feature readers and the DeepSpeed engine around the head."""

    recipe: Any
    rank: int
    world_size: int
    device: torch.device
    precision: Any  # runtime.precision.Precision
    target: Any  # runtime.frozen_parts.FrozenParts: embed_tokens and lm_head, used by reference
    fingerprint: str
    train_reader: Any  # features.reader.FeatureReader
    eval_reader: Any
    head_config: Any  # heads.config.HeadConfig
    engine: Any  # deepspeed engine; engine.module is the head (a DraftHead, or an Eagle3Head)
    total_steps: int
    draft_vocab_coverage: float | None
    run_id: str | None = None  # set by resume_from_checkpoint
    tokens_before: int = 0  # tokens (all ranks) trained on before this session, from the resumed checkpoint

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def run_dir(self) -> Path:
        return self.recipe.run_dir

    @property
    def checkpoint_dir(self) -> Path:
        return self.recipe.run_dir / "checkpoints"

    @property
    def loss_kwargs(self) -> dict[str, Any]:
        train = self.recipe.train
        return dict(unroll_steps=train.unroll_steps, step_weight_decay=train.step_weight_decay,
                    feature_weight=train.feature_loss_weight, kl_weight=train.kl_loss_weight,
                    chunk_size=train.logits_chunk_size)

    @property
    def train_loss_kwargs(self) -> dict[str, Any]:
        """`loss_kwargs` plus what only training steps take (validation reads the cache as it is)."""
        return dict(self.loss_kwargs, input_noise=self.recipe.train.input_noise)


def counted_rows(loss_mask: torch.Tensor, loss_rows: str) -> torch.Tensor:
    """The mask the losses count rows by (`train.loss_rows`): the assistant tokens (`loss_mask` [T], 1 = assistant),
    or every token ("all": the user and system turns' rows too, from the same cached features)."""
    return loss_mask if loss_rows == "assistant" else torch.ones_like(loss_mask)


def setup(recipe) -> TrainingRun:
    """Process group (gloo on CPU, NCCL on CUDA, `runtime.distributed`; alone too), compute dtype, the target's
    frozen parts (never the whole target: `runtime.frozen_parts`), feature readers, head (draft vocabulary chosen
    from the training labels), AdamW + LR schedule inside a DeepSpeed engine."""
    import deepspeed  # local: DeepSpeed takes seconds to import; only setup and the head save need it

    train = recipe.train
    use_cuda = torch.cuda.is_available() and recipe.target.device in ("auto", "cuda")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    _skip_deepspeed_shm_build()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}") if use_cuda else torch.device("cpu")
    init_process_group(device, recipe.distributed.timeout_minutes,
                       init=lambda backend, timeout: deepspeed.init_distributed(
                           dist_backend=backend, timeout=timeout, verbose=False))
    rank, world_size = dist.get_rank(), dist.get_world_size()

    # Compute dtype: `auto` resolves to the fastest many-row dtype this device has (runtime/precision.py), once: rank 0
    # resolves it and every rank takes its answer (a timed choice cannot differ between ranks).
    box = [resolve_section(recipe.precision, device, phases=("prefill",)) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    precision = box[0]
    recipe = with_precision(recipe, precision.recipe_values())
    if rank == 0:
        print(f"train: {precision.describe()}", flush=True)

    # The target's frozen parts only (embed_tokens, lm_head; the last layer and final norm for init last_layer), read
    # from its safetensors without building the target: a rank holds 2·V·d target values, not the whole model.
    target = load_frozen_parts(recipe.target.path, dtype=precision.torch_dtype, device=device,
                               last_layer=recipe.head.init == "last_layer")
    fingerprint = target.fingerprint
    # The target's tokenizer must be the one that tokenized the data; hashed once for both readers.
    tokenizer = tokenizer_fingerprint(recipe.target.path, recipe.data.chat_template)
    head_config = recipe.head.head_config(target.config, fingerprint, recipe.precompute.aux_layers)
    # An eagle3 head reads the cache's aux layers (precompute.aux_layers); the other kinds never load them. Each
    # reader's shards are hashed once among all ranks (`hash_share`), the eval reader's too, though rank 0 of 1 in data.
    readers_kwargs = dict(micro_batch_tokens=train.micro_batch_tokens, rank=rank, world_size=world_size,
                          seed=train.seed, expected_fingerprints={"target": fingerprint, "tokenizer": tokenizer},
                          target_dir=recipe.target.path, aux_layers=head_config.aux_layers,
                          hash_share=(rank, world_size))
    train_reader = FeatureReader(recipe.features_dir, "train", dtype=target.dtype, **readers_kwargs)
    eval_reader = FeatureReader(recipe.features_dir, "eval", dtype=target.dtype,
                                **{**readers_kwargs, "rank": 0, "world_size": 1})
    torch.manual_seed(train.seed)
    head = head_class(head_config.kind).from_target(target, head_config, dtype=torch.float32)
    target.last_layer = target.final_norm = None  # only the head's init reads them (70B: 1.7 GB in bf16)
    draft_vocab_coverage = None
    if head_config.draft_vocab_size is not None:
        draft_vocab_coverage = _choose_draft_vocab(head, target, recipe.features_dir, recipe.head.draft_vocab_source,
                                                   rank == 0)

    steps_per_epoch = max(1, train_reader.batches_per_epoch() // train.grad_accum)
    total_steps = train.max_steps or steps_per_epoch * train.epochs
    optimizer = make_optimizer(head, train)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_lambda(s, train.warmup_steps, total_steps, train.schedule, train.min_lr_ratio)
    )
    use_bf16 = precision.dtype == "bfloat16"  # DeepSpeed's bf16 section only when training computes in bf16
    engine, _, _, _ = deepspeed.initialize(model=head, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=deepspeed_config(recipe, world_size, use_bf16))
    install_safe_loading(engine)  # DeepSpeed's own loader would unpickle arbitrary objects
    return TrainingRun(recipe, rank, world_size, device, precision, target, fingerprint, train_reader, eval_reader,
                       head_config, engine, total_steps, draft_vocab_coverage)


def make_optimizer(head: torch.nn.Module, train) -> torch.optim.Optimizer:
    """`train.optimizer`: AdamW over every trainable parameter, or Muon over the head's matrices (momentum
    orthogonalized by Newton–Schulz, at `train.muon_lr`) with AdamW's update at `train.lr` for the rest (norms,
    biases). Muon is DeepSpeed's `MuonWithAuxAdam`: its ZeRO-1/2 optimizer orthogonalizes each matrix whole although
    it partitions gradients flat, so Muon stays Muon on any number of ranks (a plain torch Muon would see 1-D
    partitions)."""
    trainable = [p for p in head.parameters() if p.requires_grad]
    if train.optimizer == "adamw":
        return torch.optim.AdamW(trainable, lr=train.lr, weight_decay=train.weight_decay, betas=(0.9, 0.95))
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    matrices = [p for p in trainable if p.dim() >= 2]
    others = [p for p in trainable if p.dim() < 2]
    for param in trainable:
        param.use_muon = param.dim() >= 2  # ZeRO reads the flag off each parameter
    groups = [dict(params=matrices, use_muon=True, lr=train.muon_lr, momentum=0.95,
                   weight_decay=train.weight_decay)]
    if others:
        groups.append(dict(params=others, use_muon=False, lr=train.lr, betas=(0.9, 0.95), eps=1e-8,
                           weight_decay=train.weight_decay))
    return MuonWithAuxAdam(groups)


def optimizer_stance(device: torch.device):
    """On a CPU, optimizer steps run eagerly: DeepSpeed's Muon update is a `torch.compile`d function whose C++ build
    costs ~40 s per rank at the first step of every run; eagerly, a Muon step costs 2.1–2.3× an AdamW step on the
    demo's head (2 ranks, Zen 4), the Newton–Schulz iterations included. On CUDA the compiled update is kept."""
    return torch.compiler.set_stance("force_eager") if device.type == "cpu" else nullcontext()


def _choose_checkpoint(run: TrainingRun, resume: str) -> CheckpointInfo | None:
    """The checkpoint to resume from: "auto" → this run's newest checkpoint whose files every rank can read (an
    unreadable one — truncated by a kill or a full disk — is skipped with a note), "never" → None, else the named
    checkpoint directory (refused by name when unreadable). A checkpoint saved by another world size is refused."""
    if resume == "never":
        return None
    if resume == "auto":
        candidates = run_checkpoints(run.checkpoint_dir, read_run_id(run.run_dir))[::-1]  # newest first
    else:
        named = read_checkpoint(Path(resume))
        if named is None:
            raise UserError(f"{resume}: not a checkpoint of this trainer (no readable client_state.json)")
        candidates = [named]
    zero_stage = run.recipe.train.zero_stage
    for candidate in candidates:
        check_recorded(candidate)
        check_world_size(candidate, run.world_size, zero_stage)
        try:
            check_readable(files_to_load(candidate.path, run.rank, zero_stage))
            problem = None
        except UnreadableCheckpoint as err:
            problem = str(err)
        problems: list[str | None] = [None] * run.world_size
        dist.all_gather_object(problems, problem)  # every rank takes the same decision
        problem = next((p for p in problems if p), None)
        if problem is None:
            return candidate
        if resume != "auto":
            raise UserError(f"{candidate.path}: cannot resume from this checkpoint: {problem}")
        if run.is_main:
            print(f"train: skipping checkpoint {candidate.path.name}: {problem}", flush=True)
    if candidates:
        raise UserError(f"{run.checkpoint_dir}: none of this run's checkpoints is complete "
                        f"({', '.join(c.path.name for c in candidates)}); rerun with --resume never to start over")
    return None


def _tokens_before(checkpoint: CheckpointInfo) -> int:
    """Tokens trained on up to the checkpoint: its client state's count (`check_recorded` saw it there)."""
    return int(checkpoint.state["tokens"])


def trained_on(run: TrainingRun) -> dict[str, str]:
    """What a checkpoint of this run is tied to: the feature cache (`features.format.cache_identity`: its
    fingerprints and shard hashes), the prepared data and the target, each with where it was read."""
    manifest = run.train_reader.manifest
    return {"features": cache_identity(manifest), "features_dir": str(run.recipe.features_dir),
            "dataset": str(manifest["fingerprints"].get("dataset")), "target": run.fingerprint,
            "target_path": str(run.recipe.target.path)}


def _trained_elsewhere(checkpoint: CheckpointInfo, now: dict[str, str]) -> str | None:
    """Why `checkpoint` was not trained on this run's cache, data and target (None: it was), naming both sides."""
    then = checkpoint.state.get("trained_on")
    if then is None:
        target = checkpoint.state.get("target_fingerprint")
        if target is not None and target != now["target"]:
            return f"trained on another target {target}; this run's is {now['target']} at {now['target_path']}"
        return "saved before checkpoints named their feature cache, so it cannot be matched to this run's"
    for key, label in (("target", "target"), ("dataset", "prepared data"), ("features", "feature cache")):
        if then.get(key) != now[key]:
            where = {"target": "target_path", "features": "features_dir"}.get(key)
            was = f" at {then.get(where)}" if where and then.get(where) else ""
            here = f" at {now[where]}" if where else ""
            return f"trained on another {label} {then.get(key)}{was}; this run's is {now[key]}{here}"
    return None


def resume_from_checkpoint(run: TrainingRun, resume: str = "auto", force: bool = False) -> tuple[int, bool]:
    """Load the checkpoint `resume` names ("auto": this run's latest complete one, if any; "never"; or a checkpoint
    directory) into the engine, the reader and the RNGs; prepare the run dir (resolved recipe; metrics cut back to
    the checkpoint, or — for a new run — the previous run's files moved aside and a new run id). Returns the
    optimizer step to start from and whether a checkpoint was loaded."""
    chosen = _choose_checkpoint(run, resume)
    start_step = 0
    if chosen is not None:
        checkpoint = chosen.path
        saved_recipe_path = run.run_dir / RESOLVED_RECIPE_FILENAME
        if saved_recipe_path.is_file():
            saved = yaml.safe_load(saved_recipe_path.read_text())
            changed = changed_recipe_keys(saved, recipe_to_dict(run.recipe))
            if changed and not force:
                raise UserError(
                    f"{run.run_dir}: resuming with a changed recipe ({', '.join(changed)}); use the saved recipe, "
                    "another train.run_dir, or --force to resume anyway"
                )
        # A checkpoint of this run must have trained on this run's data; one of another run dir, named explicitly,
        # seeds a new run here (fine-tuning on new data is what that is for).
        same_run = chosen.path.parent.resolve() == run.checkpoint_dir.resolve()
        elsewhere = _trained_elsewhere(chosen, trained_on(run)) if same_run else None
        if elsewhere and not force:
            raise UserError(
                f"{checkpoint}: {elsewhere}; continuing would train on the new data from the old "
                "position. Start a new run here (`--resume never`: the old run is moved aside), use another "
                "train.run_dir, or --force to resume anyway"
            )
        load_path, client = run.engine.load_checkpoint(str(checkpoint.parent), tag=checkpoint.name)
        if load_path is None:
            raise UserError(f"{checkpoint}: DeepSpeed could not load this checkpoint")
        run.train_reader.load_state_dict(chosen.state["reader"])
        _set_rng_state(client["rng"][run.rank] if isinstance(client.get("rng"), list) else client["rng"])
        start_step = chosen.step
        if run.is_main:
            print(f"train: resumed from {checkpoint} at step {start_step}")
    # A checkpoint of another run dir seeds a new run here; otherwise the run continues under its checkpoint's id.
    continues = chosen is not None and chosen.path.parent.resolve() == run.checkpoint_dir.resolve()
    run_id = [chosen.run_id if continues else None]
    if run.is_main:
        if not continues:
            run_id[0], backup = start_new_run(run.run_dir)
            if backup is not None:
                print(f"train: a new run in {run.run_dir}: the previous run's checkpoints, metrics, summary and "
                      f"head were moved to {backup} (delete it when no longer needed)", flush=True)
        elif read_run_id(run.run_dir) != run_id[0]:
            atomic_write_text(run.run_dir / "run_id", run_id[0] + "\n")  # resumed one of its older checkpoints
        if continues:  # this run's checkpoints after the one resumed belong to the abandoned continuation
            newer = [c for c in run_checkpoints(run.checkpoint_dir, run_id[0]) if c.step > chosen.step]
            if newer:
                backup = retire_checkpoints(run.run_dir, newer, chosen.step)
                print(f"train: resumed step {chosen.step} of this run, so its later checkpoints "
                      f"({', '.join(c.path.name for c in newer)}) were moved to {backup}: a later automatic resume "
                      "continues from here, not from them (delete that folder when no longer needed)", flush=True)
        save_resolved(run.recipe, run.run_dir)
        if chosen is not None:
            truncate_metrics(run.run_dir / "metrics.jsonl", start_step)
            run.tokens_before = _tokens_before(chosen) if continues else 0
    dist.broadcast_object_list(run_id, src=0)
    run.run_id = run_id[0]
    dist.barrier()
    return start_step, chosen is not None


def save_checkpoint(run: TrainingRun, step: int, tag: str | None = None, tokens: int = 0) -> Path:
    """DeepSpeed's checkpoint plus our client state (step, run id, world size, tokens so far, reader position, every
    rank's RNGs; written last, so a checkpoint without it is incomplete); keeps this run's last `train.keep_last`.
    A full disk removes the partial checkpoint and says what to free. Collective."""
    tag = tag or f"step-{step}"
    rngs = [None] * run.world_size
    dist.all_gather_object(rngs, _rng_state())
    path = run.checkpoint_dir / tag
    # Every rank writes into a hidden staging directory that replaces `path` only once complete (client state last):
    # a kill mid-save leaves the previous `path` whole (a save over an existing step-N used to write in place, so a
    # kill could pair new model states with old optimizer states), and auto-resume never sees the staging directory.
    staged_tag = f".{tag}.saving"
    staged = run.checkpoint_dir / staged_tag
    if run.is_main and staged.exists():
        shutil.rmtree(staged)  # left by a killed save
    dist.barrier()
    try:
        run.engine.save_checkpoint(str(run.checkpoint_dir), tag=staged_tag, client_state={"rng": rngs},
                                   save_latest=False)
        if run.is_main:
            write_json_atomic(staged / "client_state.json", {
                "step": step, "run_id": run.run_id, "world_size": run.world_size, "tokens": tokens,
                "reader": run.train_reader.state_dict(), "target_fingerprint": run.fingerprint,
                "trained_on": trained_on(run)})
        dist.barrier()  # every rank's files are in
        if run.is_main:
            replace_directory(staged, path)
    except (OSError, RuntimeError, UserError) as err:
        if run.is_main:
            shutil.rmtree(staged, ignore_errors=True)
        if not is_disk_full(err):
            raise
        older = [c.path for c in run_checkpoints(run.checkpoint_dir, run.run_id)]
        raise UserError(disk_full_message(path, older)) from None
    if run.is_main:
        for old in run_checkpoints(run.checkpoint_dir, run.run_id)[: -run.recipe.train.keep_last]:
            shutil.rmtree(old.path, ignore_errors=True)
    dist.barrier()
    return path


@dataclass
class StepResult:
    """One optimizer step: the loss and metric sums reduced over ranks, and this rank's work and time split."""

    totals: dict[str, float]  # "loss" (mean over ranks × world size), "tokens", and metric_sums keys, summed over ranks
    tokens: int  # this rank's tokens
    flops: float  # this rank's matmul FLOPs
    seconds: dict[str, float]  # this rank's data / forward / backward / step time


def train_step(run: TrainingRun, data) -> StepResult:
    """`train.grad_accum` micro-batches (unrolled losses → backward → DeepSpeed step, which reduces gradients across
    ranks at the accumulation boundary, clips and runs AdamW), then the metric sums reduced over ranks."""
    accum = run.recipe.train.grad_accum
    sums: dict[str, float] = {"loss": 0.0, "tokens": 0.0}
    seconds = dict.fromkeys(("data", "forward", "backward", "step"), 0.0)
    tokens, flops = 0, 0.0
    for _ in range(accum):
        t0 = time.perf_counter()
        batch = next(data)
        t1 = time.perf_counter()
        loss_mask = counted_rows(batch.loss_mask, run.recipe.train.loss_rows)
        loss, metrics = unrolled_losses(
            run.engine, batch.input_ids.to(run.device), batch.hidden.to(run.device), loss_mask.to(run.device),
            batch.lengths, **run.train_loss_kwargs,
            target_argmax=None if batch.target_argmax is None else batch.target_argmax.to(run.device),
            first_inputs=first_step_inputs(batch, run.device),
        )
        t2 = time.perf_counter()
        with optimizer_stance(run.device):  # ZeRO-1/2 run Muon's update while reducing gradients in backward
            run.engine.backward(loss)
            t3 = time.perf_counter()
            run.engine.step()
        t4 = time.perf_counter()
        for part, spent in (("data", t1 - t0), ("forward", t2 - t1), ("backward", t3 - t2), ("step", t4 - t3)):
            seconds[part] += spent
        tokens += batch.num_tokens
        flops += metrics["flops"]
        add_sums(sums, metric_sums(metrics))
        sums["loss"] += float(metrics["loss"]) / accum
        sums["tokens"] += batch.num_tokens
    keys = sorted(sums)
    reduced = all_reduce_host(torch.tensor([sums[k] for k in keys], dtype=torch.float64))
    return StepResult(dict(zip(keys, reduced.tolist())), tokens, flops, seconds)


def save_head_files(run: TrainingRun) -> Path:
    """The head as native safetensors + head_config.json in `<run dir>/head`, stored in bf16 whatever the compute
    dtype was (engines serve heads in bf16; `export --dtype` changes it), so a head trained in fp32 on a CPU is the
    same size as one trained in bf16 on a GPU. Collective under ZeRO-3."""
    import deepspeed  # local: DeepSpeed takes seconds to import; only setup and the head save need it

    head_dir = run.run_dir / "head"
    gathered = (deepspeed.zero.GatheredParameters(list(run.engine.module.parameters()), modifier_rank=None)
                if run.recipe.train.zero_stage == 3 else nullcontext())  # ZeRO-3: every rank gathers, rank 0 writes
    with gathered:
        if run.is_main:
            save_head(run.engine.module, head_dir, dtype=HEAD_STORAGE_DTYPE)
    return head_dir


def run_training(recipe, resume: str = "auto", force: bool = False, show_progress: bool = True) -> Path:
    """Train the head of `recipe`. resume: "auto" (continue from the run dir's latest checkpoint if any), "never",
    or a checkpoint directory. Returns the run dir. Collective under torchrun; rank 0 holds the run dir's lock
    (a second trainer there fails at once, naming the holder)."""
    lock = RunDirLock(Path(recipe.run_dir)) if int(os.environ.get("RANK", "0")) == 0 else None
    if lock is not None:
        lock.acquire()
    try:
        return _train(recipe, resume, force, show_progress)
    finally:
        if lock is not None:
            lock.release()


def _train(recipe, resume: str, force: bool, show_progress: bool) -> Path:
    """run_training's body, under the run dir's lock."""
    run = setup(recipe)
    start_step, resumed = resume_from_checkpoint(run, resume, force)
    train = run.recipe.train
    tracker = Tracker(run.run_dir, run.recipe, enabled=run.is_main, resume=resumed)
    progress = tqdm(total=run.total_steps, initial=start_step, desc="train", unit="step",
                    disable=not (run.is_main and show_progress), dynamic_ncols=True)
    started = time.perf_counter()
    tokens_seen, flops_seen = 0, 0.0  # this rank's, this session
    run_tokens = run.tokens_before  # all ranks', the whole run (rank 0 knows the count before this session)
    # Where a rank's training time goes (seconds): reading features, the unrolled losses (head forward, logits
    # chunks with their gradient), backward through the head, DeepSpeed's step, held-out validation, checkpoints.
    time_split = dict.fromkeys(("data", "forward", "backward", "step", "validation", "checkpoint"), 0.0)
    last_validation: dict[str, float | int] = {}
    data = iter(run.train_reader)
    step = start_step
    run.engine.train()
    while step < run.total_steps:
        result = train_step(run, data)
        step += 1
        for part, spent in result.seconds.items():
            time_split[part] += spent
        tokens_seen += result.tokens
        run_tokens += int(result.totals["tokens"])
        flops_seen += result.flops
        totals = result.totals
        if not math.isfinite(totals["loss"]):
            path = save_checkpoint(run, step - 1, tag=f"nan-step-{step}",
                                   tokens=run_tokens - int(result.totals["tokens"]))
            raise UserError(f"loss is {totals['loss']} at step {step}; stopped, state before it saved at {path} "
                            "(lower train.lr, raise train.warmup_steps, or check the features)")
        row = {"loss": totals["loss"] / run.world_size, "lr": run.engine.get_lr()[0],
               "tokens": int(totals["tokens"]), "epoch": run.train_reader.epoch}
        row.update({f"train/{key}": value for key, value in metric_means(totals).items()
                    if not key.endswith("/rows") and math.isfinite(value)})
        row["tokens_per_s"] = tokens_seen * run.world_size / max(time.perf_counter() - started, 1e-9)
        if step % train.eval_every == 0 or step == run.total_steps:
            t0 = time.perf_counter()
            last_validation = validate(run.engine.module, run.eval_reader, run.loss_kwargs, run.device)
            time_split["validation"] += time.perf_counter() - t0
            row.update({f"val/{k}": v for k, v in last_validation.items()})
        tracker.log(step, row)
        progress.set_postfix(loss=f"{row['loss']:.3f}", top1=f"{row.get('train/step1/top1', 0):.3f}",
                             tok_s=f"{row['tokens_per_s']:.0f}")
        progress.update(1)
        if step % train.save_every == 0 or step == run.total_steps:
            t0 = time.perf_counter()
            save_checkpoint(run, step, tokens=run_tokens)
            time_split["checkpoint"] += time.perf_counter() - t0
    progress.close()

    head_dir = save_head_files(run)
    train_seconds = time.perf_counter() - started
    total_flops = all_reduce_host(torch.tensor([flops_seen], dtype=torch.float64))
    gflops = float(total_flops.item()) / max(train_seconds, 1e-9) / 1e9
    if run.is_main:
        vocab_size = run.target.config.vocab_size
        # steps and tokens count the whole run (resumed sessions included); the times and speeds this session's.
        summary = {"steps": step, "tokens": run_tokens, "resumed_at_step": start_step,
                   "session_tokens": run_tokens - run.tokens_before, "train_seconds": train_seconds,
                   "tokens_per_s": round((run_tokens - run.tokens_before) / max(train_seconds, 1e-9), 1),
                   "gflops": round(gflops, 2),
                   "time_split_rank0": {k: round(v, 1) for k, v in time_split.items()},
                   "world_size": run.world_size, "head_dir": str(head_dir), "target_fingerprint": run.fingerprint,
                   "compute_dtype": run.precision.dtype, "precision_reason": run.precision.reason,
                   "draft_vocab_size": run.head_config.draft_vocab_size or vocab_size,
                   "draft_vocab_coverage": 1.0 if run.draft_vocab_coverage is None else run.draft_vocab_coverage,
                   **{f"val/{k}": v for k, v in last_validation.items()}}
        tracker.finish(summary)
        print(f"train: {step} steps; head saved to {head_dir}; held-out step-1 top-1 "
              f"{last_validation.get('step1/top1', float('nan')):.4f}")
        if step > start_step:
            print(f"train: {(step - start_step)} steps in {train_seconds:.0f} s, "
                  f"{(run_tokens - run.tokens_before) / max(train_seconds, 1e-9):.0f} tokens/s, {gflops:.1f} GFLOP/s "
                  f"in the head's matmuls ({run.precision.dtype})")
            print("train: rank 0's time: " + ", ".join(f"{k} {v:.0f} s" for k, v in time_split.items()))
    dist.barrier()
    return run.run_dir
