"""File helpers shared by every stage: atomic writes (temporary sibling, fsync, rename into place), whole directories
swapped into place, JSON reading with clear errors, file checksums, and the marker that makes an output directory ours.

A reader never sees a half-written file or directory, and a killed writer leaves only a `.<name>.tmp-<pid>` file or
directory behind (stages that resume remove those of their own)."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import socket
import struct
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mtp_train.errors import UserError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("wb") as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, target)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        if err.errno == errno.ENOSPC:
            raise UserError(f"{target}: disk full while writing; free space and rerun the same command") from None
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def json_bytes(value: Any) -> bytes:
    """The project's JSON file form: indented, UTF-8, non-ASCII kept as is, trailing newline."""
    return (json.dumps(value, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def safetensors_bytes(tensors: dict[str, Any], metadata: dict[str, str]) -> bytes:
    """`tensors` as safetensors file bytes with `metadata` (plus "format": "pt"), the same bytes for the same input:
    safetensors writes its metadata from a hash map, in an order that changes per process, so the header's metadata
    is rewritten here in sorted key order (same length, tensor offsets untouched). Storage shared between entries (tied
    embeddings) is cloned, as safetensors refuses it."""
    from safetensors.torch import save  # local: imports torch; `mtp-train --help` imports fileio

    seen: set[int] = set()
    clean = {}
    for name, tensor in tensors.items():
        tensor = tensor.detach().to("cpu").contiguous()
        if tensor.data_ptr() in seen:
            tensor = tensor.clone()
        seen.add(tensor.data_ptr())
        clean[name] = tensor
    data = save(clean, metadata={"format": "pt", **metadata})
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return data[:8] + text.ljust(length, b" ") + data[8 + length:]


def write_json_atomic(path: str | os.PathLike[str], value: Any) -> Path:
    return atomic_write_bytes(path, json_bytes(value))


def read_json_object(path: str | os.PathLike[str], what: str = "") -> dict[str, Any]:
    """A JSON object from `path`; UserError naming the file (and `what` it should be) when it is missing, unreadable,
    not JSON or not an object."""
    path = Path(path)
    label = f"{path} ({what})" if what else str(path)
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{label}: not found") from None
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"{label}: unreadable ({err})") from None
    except json.JSONDecodeError as err:
        raise UserError(f"{label}: invalid JSON ({err})") from None
    if not isinstance(value, dict):
        raise UserError(f"{label}: expected a JSON object, got {type(value).__name__}")
    return value


def file_sha256(path: str | os.PathLike[str], hasher: Any = None) -> str:
    """Hex sha256 of a file's bytes, read in 4 MiB blocks (or feed them into `hasher` and return its hex digest)."""
    hasher = hasher if hasher is not None else hashlib.sha256()
    with Path(path).open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 22), b""):
            hasher.update(block)
    return hasher.hexdigest()


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def recover_replaced_directory(target: str | os.PathLike[str]) -> None:
    """Finish or undo a `replace_directory` that a crash interrupted. It renames the old `target` aside as
    `.<name>.old-<pid>`, renames the new one into place, then removes the old: a kill between the two renames leaves
    no `target` and the old copy hidden; a kill after them leaves the hidden copy beside the new one. Here, for copies
    whose process is gone: with `target` missing the newest copy is renamed back (the output as it was before the
    interrupted replace), and every other copy is removed. A copy whose process is alive is a replace in progress and
    is left alone."""
    target = Path(target)
    retired = []
    for path in target.parent.glob(f".{target.name}.old-*"):
        pid = path.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _process_alive(int(pid)):
            retired.append(path)
    if not retired:
        return
    retired.sort(key=lambda path: path.lstat().st_mtime)
    if not target.exists() and not target.is_symlink():
        os.replace(retired.pop(), target)
    for path in retired:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def replace_directory(staging: str | os.PathLike[str], target: str | os.PathLike[str]) -> Path:
    """Rename the complete directory `staging` to `target`. An existing `target` is first renamed aside and removed
    only once the new one is in place, so a crash leaves either the old or the new directory, never a mix."""
    staging, target = Path(staging), Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    recover_replaced_directory(target)
    retired = None
    if target.exists() or target.is_symlink():
        retired = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, retired)
    os.replace(staging, target)
    if retired is not None:
        if retired.is_dir() and not retired.is_symlink():
            shutil.rmtree(retired, ignore_errors=True)
        else:
            retired.unlink(missing_ok=True)
    return target


@contextmanager
def staged_directory(target: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a fresh hidden sibling `.<name>.tmp-<pid>` of `target` (mode as umask allows) to fill; on normal exit it
    replaces `target` (`replace_directory`), on an exception it is removed and `target` is left as it was."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    recover_replaced_directory(target)
    staging = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir()
    try:
        yield staging
        replace_directory(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


# ---------------------------------------------------------------------------------------------------------------
# output directories: ours only where our marker says so
# ---------------------------------------------------------------------------------------------------------------

OUTPUT_MARKER = ".mtp_train-output.json"
# kind -> the command that writes such a directory (the marker says which, so that one stage never replaces another's)
OUTPUT_KINDS = {"prepared": "mtp-train prepare", "features": "mtp-train precompute", "export": "mtp-train export"}


def output_kind(directory: str | os.PathLike[str]) -> str | None:
    """The kind our marker in `directory` names; None without a readable marker."""
    marker = Path(directory) / OUTPUT_MARKER
    try:
        value = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    kind = value.get("kind") if isinstance(value, dict) else None
    return kind if kind in OUTPUT_KINDS else None


def output_marker_bytes(kind: str) -> bytes:
    """The marker file's contents for a directory of `kind` (a staged directory writes it with its other files)."""
    return json_bytes({"kind": kind, "written_by": OUTPUT_KINDS[kind]})


def write_output_marker(directory: str | os.PathLike[str], kind: str) -> None:
    atomic_write_bytes(Path(directory) / OUTPUT_MARKER, output_marker_bytes(kind))


def check_output_dir(directory: str | os.PathLike[str], kind: str, option: str) -> None:
    """Refuse to write into, replace or delete `directory` unless it is absent, an empty directory, or carries our
    marker of `kind`: a directory the user points an output at by mistake (their source data, the downloaded models,
    other exports) is never touched, `--force`/`--overwrite` included. `option` names the setting that chose it."""
    directory = Path(directory)
    if not directory.exists() and not directory.is_symlink():
        return
    if not directory.is_dir():
        raise UserError(f"{option} {directory}: exists and is not a directory; choose another {option}")
    found = output_kind(directory)
    if found == kind or not any(directory.iterdir()):
        return
    if found is not None:
        raise UserError(f"{option} {directory}: holds the output of {OUTPUT_KINDS[found]} ({found}), not of "
                        f"{OUTPUT_KINDS[kind]}; refusing to write there or replace it: choose another {option}")
    raise UserError(f"{option} {directory}: not empty and not written by {OUTPUT_KINDS[kind]} (no {OUTPUT_MARKER} "
                    f"of kind {kind} in it); refusing to write there or replace it, --force/--overwrite included: "
                    f"choose an empty or new directory for {option} (an output of an older mtp_train without the "
                    "marker: move it aside or delete it yourself)")


# ---------------------------------------------------------------------------------------------------------------
# one writer per output
# ---------------------------------------------------------------------------------------------------------------


class OutputLock:
    """An exclusive lock on the file `path` (flock: the kernel drops it when the holder dies, however it dies) for one
    writer of an output. The file holds `pid host command` of the holder; `busy(who)` is the message a second writer
    gets (`who`: "pid N on host H, `mtp-train ...`"). A file left by a holder that is gone is taken over with a note."""

    def __init__(self, path: str | os.PathLike[str], busy, label: str = "mtp-train"):
        self.path = Path(path)
        self.busy = busy
        self.label = label
        self.stream = None

    def acquire(self) -> OutputLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        stream = open(self.path, "a+", encoding="utf-8", errors="replace")
        try:
            fcntl.flock(stream.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            stream.seek(0)
            holder = stream.read()
            stream.close()
            if err.errno == errno.ENOLCK:
                raise UserError(f"{self.path}: cannot take the lock: this file system offers no locks (an NFS mount "
                                "without a lock service?); put this output on a file system that has them (a local "
                                "disk, or NFS with lockd / NFSv4)") from None
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise UserError(f"{self.path}: cannot take the lock ({err})") from None
            raise UserError(self.busy(_describe_holder(holder))) from None
        stream.seek(0)
        previous = stream.read()
        if previous.strip():
            print(f"{self.label}: taking over the lock {self.path} left by {_describe_holder(previous)}, which ended "
                  "without releasing it", flush=True)
        program = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path("python")
        program_name = f"python -m {program.parent.name}" if program.name == "__main__.py" else program.name
        command = " ".join([program_name, *sys.argv[1:]])
        stream.seek(0)
        stream.truncate()
        stream.write(f"{os.getpid()} {socket.gethostname()} {command}\n")
        stream.flush()
        self.stream = stream
        return self

    def release(self) -> None:
        if self.stream is None:
            return
        try:
            self.stream.seek(0)
            self.stream.truncate()  # an empty file: released cleanly
            fcntl.flock(self.stream.fileno(), fcntl.LOCK_UN)
        except OSError:
            pass
        self.stream.close()
        self.stream = None

    def __enter__(self) -> OutputLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _describe_holder(text: str) -> str:
    parts = text.split(maxsplit=2)
    if len(parts) < 2:
        return "another process"
    command = f", `{parts[2].strip()}`" if len(parts) > 2 and parts[2].strip() else ""
    return f"pid {parts[0]} on host {parts[1]}{command}"


def sibling_lock_path(output: str | os.PathLike[str]) -> Path:
    """`.<name>.lock` beside an output directory (outside it: the output itself is replaced whole)."""
    output = Path(output)
    return output.with_name(f".{output.name}.lock")


# ---------------------------------------------------------------------------------------------------------------
# the file system's refusals, said as what to do
# ---------------------------------------------------------------------------------------------------------------

_FILE_SYSTEM_ADVICE = {
    errno.ENOSPC: "the disk is full: free space there (or point the output elsewhere) and rerun the same command",
    errno.EDQUOT: "the disk quota is exhausted: free space there (or point the output elsewhere) and rerun the same "
                  "command",
    errno.EROFS: "the file system is read-only: point the output at a writable one",
    errno.EACCES: "no permission: point the output at a directory you can write to, or fix its permissions",
    errno.EPERM: "not permitted: point the output at a directory you can write to, or fix its permissions",
}


def file_system_error(err: BaseException) -> str | None:
    """A one-line message for an OSError the file system raised where a stage wrote (full disk, quota, read-only file
    system, no permission): the file, the reason and what to do, and that finished work is kept (every stage writes
    through a temporary name and resumes). None for any other error (a bug's traceback stays a traceback)."""
    if not isinstance(err, OSError) or err.errno not in _FILE_SYSTEM_ADVICE:
        return None
    where = err.filename or "a file it was writing (the system named none)"
    return (f"{where}: {os.strerror(err.errno)}; {_FILE_SYSTEM_ADVICE[err.errno]}. Finished work is kept: a file or "
            "directory being written when it failed is never left under its final name")
