"""The training run dir's safety: which checkpoints belong to the run, loading them without executing code, checking
them before DeepSpeed reads them, and one trainer per run dir.

- Run id: a fresh run (`--resume never`, or nothing to resume) gets a new id, written to `<run dir>/run_id` and into
  every checkpoint's `client_state.json`. Auto-resume and `train.keep_last` pruning only ever consider checkpoints
  carrying the run dir's id. The previous run's checkpoints, metrics, summary and head are moved aside into
  `<run dir>/previous-runs/<time>/` (nothing is deleted), so neither can mistake them for the new run's.
- Safe loading: DeepSpeed's TorchCheckpointEngine unpickles without the weights-only guard, which runs whatever a
  pickled object's `__reduce__` says. `SafeTorchCheckpointEngine` loads with `weights_only=True`, allow-listing
  exactly the classes DeepSpeed (and our client state) store; anything else is refused naming the file.
- Checks before loading: every file this rank will read (under ZeRO-3 its own model states too) exists and is a
  complete zip archive (CRC-checked), and the checkpoint's world size is this run's (ZeRO partitions the optimizer
  state per rank).
- `RunDirLock`: an exclusive `flock` on `<run dir>/.lock`, holding the holder's pid, host and command.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mtp_train.errors import UserError
from mtp_train.fileio import OutputLock, atomic_write_text

RUN_ID_FILENAME = "run_id"
PREVIOUS_RUNS_DIRNAME = "previous-runs"
LOCK_FILENAME = ".lock"
# What a finished or interrupted run leaves in its run dir that a new run would otherwise mix with its own.
RUN_ARTIFACTS = ("checkpoints", "metrics.jsonl", "summary.json", "head", RUN_ID_FILENAME)


class UnreadableCheckpoint(UserError):
    """A checkpoint file is missing, truncated or corrupted (auto-resume falls back to an older checkpoint)."""


# ---------------------------------------------------------------------------------------------------------------
# loading without executing code
# ---------------------------------------------------------------------------------------------------------------


def _allowed_globals() -> list:
    """The classes a ZeRO-0/1/2/3 checkpoint of this trainer stores besides tensors and builtins (found by saving fp32
    and bf16 checkpoints and listing `torch.serialization.get_unsafe_globals_in_checkpoint`): DeepSpeed's loss scaler,
    ZeRO stage enum and tensor-fragment addresses, and numpy's array reconstruction for the numpy RNG state in our
    client state. Each is a plain data holder (no code runs when it is rebuilt)."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler  # local: DeepSpeed takes seconds
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    numpy_core = getattr(np, "_core", None) or np.core
    return [LossScaler, ZeroStageEnum, fragment_address, np.ndarray, np.dtype, numpy_core.multiarray._reconstruct,
            type(np.dtype("uint32"))]


def _refusal_reason(path: str | os.PathLike[str], err: Exception) -> str:
    """What a weights-only load refused: the globals the file names beyond the allow-list (found by scanning its
    pickle opcodes, which runs nothing), else torch's own line about it."""
    allowed = {f"{g.__module__}.{g.__qualname__}" for g in _allowed_globals()}
    try:
        unsafe = sorted(set(torch.serialization.get_unsafe_globals_in_checkpoint(path)) - allowed)
    except Exception:  # noqa: BLE001 - only a better message is lost
        unsafe = []
    if unsafe:
        return f"it needs {', '.join(unsafe)}"
    lines = [line for line in str(err).splitlines()
             if line.strip() and not line.startswith(("Weights only load failed", "Check the documentation"))]
    return lines[0] if lines else "a weights-only load failed"


def safe_torch_load(path: str | os.PathLike[str], map_location=None):
    """`torch.load(weights_only=True)` with the allow-list above. A file that needs anything else is refused by name
    (nothing in it runs); an unreadable one raises UnreadableCheckpoint."""
    try:
        with torch.serialization.safe_globals(_allowed_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        raise UserError(f"{path}: refused to load: this checkpoint file stores something other than tensors and "
                        f"DeepSpeed's known classes ({_refusal_reason(path, err)}); nothing in it was run. It was not "
                        "written by this trainer — delete that checkpoint directory (or train into another "
                        "train.run_dir)") from None
    except FileNotFoundError:
        raise UnreadableCheckpoint(f"{path}: missing") from None
    except (RuntimeError, EOFError, OSError, ValueError) as err:
        raise UnreadableCheckpoint(f"{path}: unreadable, truncated or corrupted ({str(err).splitlines()[0]})") \
            from None


def install_safe_loading(engine) -> None:
    """Make the DeepSpeed engine read its checkpoints through `safe_torch_load` (saving is unchanged)."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine  # local: slow

    class SafeTorchCheckpointEngine(TorchCheckpointEngine):
        """DeepSpeed's torch checkpoint engine, loading with weights_only=True."""

        def load(self, path: str, map_location=None):
            return safe_torch_load(path, map_location=map_location)

    current = engine.checkpoint_engine
    if type(current) is not TorchCheckpointEngine:
        raise UserError(f"DeepSpeed checkpoint engine {type(current).__name__} is not supported (its loads cannot be "
                        "made weights-only here); remove the checkpoint engine setting from train.deepspeed_config")
    safe = SafeTorchCheckpointEngine.__new__(SafeTorchCheckpointEngine)
    safe.__dict__.update(current.__dict__)
    engine.checkpoint_engine = safe


# ---------------------------------------------------------------------------------------------------------------
# checking a checkpoint before DeepSpeed reads it
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointInfo:
    """One `checkpoints/step-N/` directory and what its client_state.json says."""

    path: Path
    step: int
    run_id: str | None  # None: not recorded (an older mtp-train's; `check_recorded` refuses it)
    world_size: int | None
    state: dict


def read_checkpoint(path: Path) -> CheckpointInfo | None:
    """The checkpoint at `path`, or None when its client_state.json is missing or unreadable (a save that did not
    finish: the client state is written last)."""
    try:
        state = json.loads((path / "client_state.json").read_text())
        step = int(state["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    world_size = state.get("world_size")
    return CheckpointInfo(path, step, state.get("run_id"), None if world_size is None else int(world_size), state)


def run_checkpoints(checkpoint_dir: Path, run_id: str | None) -> list[CheckpointInfo]:
    """The complete checkpoints of run `run_id` (of any run when None), oldest first."""
    found = [read_checkpoint(p) for p in checkpoint_dir.glob("step-*") if p.is_dir()]
    return sorted((c for c in found if c is not None and (run_id is None or c.run_id == run_id)),
                  key=lambda c: c.step)


def files_to_load(checkpoint: Path, rank: int, zero_stage: int) -> list[Path]:
    """The files DeepSpeed reads on `rank` when resuming (the names its engine's `_get_ckpt_name` and
    `_get_rank_zero_ckpt_name` give): the model states, shared by all ranks under ZeRO-0/1/2
    (`mp_rank_00_model_states.pt`, written by rank 0), this rank's own under ZeRO-3, which partitions the weights
    (`zero_pp_rank_{rank}_mp_rank_00_model_states.pt`, written by every rank); and under ZeRO-1/2/3 this rank's
    optimizer partition (`zero_pp_rank_{rank}_mp_rank_00_optim_states.pt`, prefixed `bf16_` when saved in bf16)."""
    files = [checkpoint / (f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" if zero_stage == 3
                           else "mp_rank_00_model_states.pt")]
    if zero_stage > 0:
        stem = f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        bf16 = checkpoint / f"bf16_{stem}"
        files.append(bf16 if bf16.is_file() else checkpoint / stem)
    return files


def check_readable(files: list[Path]) -> None:
    """Raise UnreadableCheckpoint naming the first file that is missing or not a complete, CRC-clean zip archive
    (torch's format): a kill or a full disk during a save leaves such files."""
    for path in files:
        if not path.is_file():
            raise UnreadableCheckpoint(f"{path}: missing")
        try:
            with zipfile.ZipFile(path) as archive:
                bad = archive.testzip()
        except (zipfile.BadZipFile, OSError, EOFError) as err:
            raise UnreadableCheckpoint(f"{path}: truncated or corrupted ({err})") from None
        if bad is not None:
            raise UnreadableCheckpoint(f"{path}: corrupted (record {bad} fails its CRC)")


def check_recorded(checkpoint: CheckpointInfo) -> None:
    """Refuse a checkpoint whose client state lacks what this trainer records (run_id, world_size, tokens): one
    written by an older mtp-train."""
    missing = [key for key in ("run_id", "world_size", "tokens") if checkpoint.state.get(key) is None]
    if missing:
        raise UserError(f"{checkpoint.path / 'client_state.json'}: no {' or '.join(missing)}: a checkpoint written by "
                        "an older mtp-train; start over with --resume never or another train.run_dir")


def check_world_size(checkpoint: CheckpointInfo, world_size: int, zero_stage: int) -> None:
    """Refuse a checkpoint saved by another number of ranks, naming the number it needs."""
    saved = checkpoint.world_size
    if saved != world_size:
        how = (f"ZeRO-{zero_stage} split its optimizer state into {saved} partitions, and " if zero_stage else "")
        raise UserError(f"{checkpoint.path}: saved by {saved} ranks, this run has {world_size}; {how}the data "
                        f"position is per rank. Resume with {saved} ranks in all (torchrun --nproc_per_node × "
                        "--nnodes), or start over with --resume never or another train.run_dir")


# ---------------------------------------------------------------------------------------------------------------
# run ids: a new run moves the previous one aside
# ---------------------------------------------------------------------------------------------------------------


def read_run_id(run_dir: Path) -> str | None:
    path = run_dir / RUN_ID_FILENAME
    return path.read_text().strip() or None if path.is_file() else None


def new_run_id() -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{os.getpid()}-{os.urandom(3).hex()}"


def start_new_run(run_dir: Path) -> tuple[str, Path | None]:
    """Move what a previous run left in `run_dir` (RUN_ARTIFACTS) into `previous-runs/<time>/` and write a new run
    id. Returns the id and the backup directory (None when there was nothing to move). Each move is a rename, so a
    kill in between leaves either the old file or its backup, never a mix that resumes."""
    run_dir.mkdir(parents=True, exist_ok=True)
    present = [name for name in RUN_ARTIFACTS if (run_dir / name).exists()]
    backup = None
    if [name for name in present if name != RUN_ID_FILENAME]:
        backup = run_dir / PREVIOUS_RUNS_DIRNAME / time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        while backup.exists():
            backup = backup.with_name(backup.name + "x")
        backup.mkdir(parents=True)
        for name in present:
            os.replace(run_dir / name, backup / name)
    else:
        for name in present:
            (run_dir / name).unlink()
    run_id = new_run_id()
    atomic_write_text(run_dir / RUN_ID_FILENAME, run_id + "\n")
    return run_id, backup


def retire_checkpoints(run_dir: Path, checkpoints: list[CheckpointInfo], resumed_step: int) -> Path:
    """Move `checkpoints` (a run's checkpoints after the older one it resumed) into
    `previous-runs/<time>-after-step-<N>/checkpoints/`, each by one rename: kept, and out of auto-resume's way."""
    backup = run_dir / PREVIOUS_RUNS_DIRNAME / (time.strftime("%Y%m%d-%H%M%S", time.gmtime())
                                                + f"-after-step-{resumed_step}") / "checkpoints"
    backup.mkdir(parents=True, exist_ok=True)
    for checkpoint in checkpoints:
        os.replace(checkpoint.path, backup / checkpoint.path.name)
    return backup.parent


# ---------------------------------------------------------------------------------------------------------------
# saving: a full disk removes the partial checkpoint and says what to free
# ---------------------------------------------------------------------------------------------------------------


def is_disk_full(err: BaseException) -> bool:
    """An OSError with ENOSPC/EDQUOT, or torch's zip writer's RuntimeError for a failed write (it drops the errno)."""
    if isinstance(err, OSError):
        return err.errno in (errno.ENOSPC, errno.EDQUOT)
    if isinstance(err, UserError):
        return "disk full" in str(err)
    return isinstance(err, RuntimeError) and "write failed" in str(err)


def disk_full_message(partial: Path, older: list[Path]) -> str:
    free = shutil.disk_usage(partial.parent if partial.parent.exists() else Path.cwd()).free
    keep = f"; this run's older checkpoints: {', '.join(p.name for p in older)}" if older else ""
    return (f"{partial}: disk full while saving this checkpoint ({free / 2**20:.0f} MiB free); the partial checkpoint "
            f"was removed. Free space on that filesystem (older runs under {partial.parent.parent / 'previous-runs'}, "
            f"other files; or lower train.keep_last{keep}) and rerun the same command: it resumes from the latest "
            "complete checkpoint")


# ---------------------------------------------------------------------------------------------------------------
# one trainer per run dir
# ---------------------------------------------------------------------------------------------------------------


class RunDirLock(OutputLock):
    """An exclusive lock on `<run dir>/.lock` (`fileio.OutputLock`: flock, the holder's pid, host and command): one
    trainer per run dir, and no eval logging into a run that is training."""

    def __init__(self, run_dir: Path):
        super().__init__(run_dir / LOCK_FILENAME, label="train", busy=lambda who: (
            f"{run_dir}: another process is using this run dir ({who}: a trainer, or an eval logging into it); wait "
            "for it, stop it, or use another train.run_dir"))
